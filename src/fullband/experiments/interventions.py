"""State interventions of the synthetic experiments: what replacing a model's fed-back state with something else
removes, each removing the state alone (the token stays in the fused input).

Owns :data:`INTERVENTIONS` (``mean``: the set's mean state at that step; ``shuffle``: another row's state at that
step; ``zero``: a zero state, only where it leaves the token, :func:`zero_keeps_token`), :func:`exact_states` (the
un-intervened recurrence's states the interventions are taken from), :func:`intervention_hook` (a
``recurrent_forward`` ``state_hook``) and :func:`interventions_for` (the ones that apply to a model's fusion).
"""

from __future__ import annotations

import torch

INTERVENTIONS = ("mean", "shuffle", "zero")  # "zero" only where a zero state leaves the token: zero_keeps_token


def zero_keeps_token(model) -> bool:
    """Whether fusing a zero state still leaves the token in the input (then zeroing the state removes the state
    alone). The residual entry: ``u = e + norm(W_U·0 ⊙ gate) = e``, yes; the pure GLU entry: ``norm(W_U·0 ⊙ gate)
    = 0`` for every token, no -- a zeroed state there removes the token too, so it is no state intervention."""
    emb = model.get_input_embeddings().weight
    ids = torch.arange(emb.shape[0], device=emb.device)
    zero = torch.zeros(emb.shape[0], model.backbone.config.hidden_size, dtype=emb.dtype, device=emb.device)
    with torch.no_grad():
        u = model.fuse(zero, ids, emb)
    return not torch.allclose(u, u[:1].expand_as(u))


@torch.no_grad()
def exact_states(model, rows, batch: int = 256) -> torch.Tensor:
    """``[N, n, d]``: the final hidden states of the un-intervened token-by-token recurrence (the states it feeds)."""
    return torch.cat([model.recurrent_forward(rows[i:i + batch]).last_hidden_state for i in range(0, len(rows), batch)])


def intervention_hook(name: str, states: torch.Tensor, index: torch.Tensor):
    """The ``state_hook(t, h_prev)`` of intervention ``name`` for the rows ``index`` of a set (one task, one length)
    whose un-intervened exact states are ``states`` ``[N, n, d]``; each replaces the state alone, the token stays:

    * ``mean``: the mean over the set's rows of the state at that step (the row's own information gone, what every
      row has there kept: at step 1 every row feeds its BOS state, which this leaves as it is);
    * ``shuffle``: the state another row of the set had at the same step (row i takes row i-1's, cyclically: a
      derangement of the whole set, so every row gets another row's state whatever the scoring batch size; a set of
      one row has no other row -- a one-line error);
    * ``zero``: a zero state (only where :func:`zero_keeps_token`)."""
    if name == "zero":
        return lambda t, prev: torch.zeros_like(prev)
    if name == "mean":
        mean = states.mean(0, keepdim=True)
        return lambda t, prev: mean[:, t - 1:t].to(prev).expand_as(prev)
    if name == "shuffle":
        if states.shape[0] < 2:
            raise ValueError("the shuffle intervention takes the state from another row: it needs >= 2 test rows, "
                             "got 1 (raise --test-rows)")
        partner = (index - 1) % states.shape[0]
        return lambda t, prev: states[partner.to(states.device), t - 1:t].to(prev)
    raise ValueError(f"unknown intervention {name!r}: choose from {', '.join(INTERVENTIONS)}")


def interventions_for(model) -> list[str]:
    return [n for n in INTERVENTIONS if n != "zero" or zero_keeps_token(model)]
