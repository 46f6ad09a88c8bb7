"""``grad_passes``: the passes run without gradient compute no logits and no loss (the LM head projects no position
there), their ``pass_losses`` are NaN, and the gradient passes' losses and the gradients are those of the K-pass
objective written here from the raw modules (every pass scored, the no-gradient ones detached)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import BOS, random_ids, tiny_model

K, N, B, T, LAM = 5, 2, 2, 12, 0.7
EPS = torch.finfo(torch.float32).eps


def _reference(model, ids):
    """The K-pass objective from the embeddings, the fusion, the backbone's hidden states and the LM head: passes
    1..K-N under no_grad, each pass's cross-entropy over next tokens, L_1 + λ·mean(L_2..L_K)."""
    emb = model.get_input_embeddings()(ids)
    mask = (ids != BOS).clone()
    mask[:, 0] = False
    hidden, losses = None, []
    for k in range(K):
        with torch.set_grad_enabled(k >= K - N):
            x = emb
            if hidden is not None:
                state = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
                x = torch.where(mask[..., None], model.feedback(state, emb), emb)
            hidden = model.backbone(inputs_embeds=x, output_hidden_states=True).hidden_states[-1]
            logits = model.get_output_embeddings()(hidden).float()
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            losses.append(ce if k >= K - N else ce.detach())
    return losses


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("score_all", [False, True])
def test_no_gradient_passes_compute_no_logits(score_all):
    model = tiny_model(fusion="glu", jitter=0.0).train()
    ids = random_ids(B, T, seed=4)
    projected = []  # positions the LM head projects, per call
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: projected.append(args[0].shape[:-1].numel()))
    out = model(ids, labels=ids, num_passes=K, grad_passes=N, feedback_weight=LAM, score_all_passes=score_all)
    hook.remove()
    scored = K if score_all else N
    assert sum(projected) == scored * B * T  # no-gradient passes: the LM head on no position (or not called)
    assert sorted(projected, reverse=True)[:scored] == [B * T] * scored
    ref = _reference(model, ids)
    if score_all:  # as before: every pass scored, the no-gradient ones detached, in the loss's value
        assert out.pass_losses.tolist() == pytest.approx([float(x) for x in ref], rel=8 * T * EPS)
        ref_loss = ref[0] + LAM * torch.stack(ref[1:]).mean()
    else:
        assert torch.isnan(out.pass_losses[:K - N]).all()  # not scored: NaN
        assert out.pass_losses[K - N:].tolist() == pytest.approx([float(x) for x in ref[K - N:]], rel=8 * T * EPS)
        ref_loss = LAM * torch.stack(ref[K - N:]).sum() / (K - 1)  # the part of the objective with gradient
    assert float(out.loss) == pytest.approx(float(ref_loss), rel=8 * T * EPS)
    got, want = _grads(model, out.loss), _grads(model, ref[0] + LAM * torch.stack(ref[1:]).mean())
    assert got.keys() == want.keys()
    for name, g in want.items():  # a gradient entry sums over the B x T positions and the N passes
        assert (got[name] - g).abs().max() <= 8 * B * T * N * EPS * g.abs().max(), name
