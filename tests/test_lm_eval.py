"""The lm-eval adapter: registration, loglikelihood per feedback mode against ``fullband eval``, and the shipped
tasks (multiple choice, generate-until, rolling loglikelihood) run through ``lm_eval.simple_evaluate``."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (pip install 'lm-eval[hf]')")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from conftest import TEXTS  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from fullband.eval import lm_eval_adapter as A  # noqa: E402
from fullband.eval.scoring import evaluate_loss  # noqa: E402

TEXT = TEXTS[0] + TEXTS[1]


_LMS: dict = {}


def lm(path, mode, **kw):
    key = (path, mode, tuple(sorted(kw.items())))
    if key not in _LMS:
        _LMS[key] = A.FullBandLM(pretrained=path, feedback_mode=mode, device="cpu", batch_size=2, **kw)
    return _LMS[key]


def req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_registered():
    assert get_model("fullband") is A.FullBandLM
    A.register()  # idempotent
    assert os.path.isfile(os.path.join(A.tasks_dir(), "fullband_shakespeare_mc.yaml"))


@pytest.mark.parametrize("mode, eval_mode, k", [
    ("standard", "standard", 1), ("passes", "passes", 2), ("exact", "exact", None),
    ("soft", "exact", None),  # with only BOS as context, soft decoding is the exact recurrence
])
def test_rolling_loglikelihood_equals_fullband_eval(model_dir, mode, eval_mode, k):
    model = lm(model_dir, mode)
    ids = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    rows = torch.tensor([[model.tokenizer.bos_token_id, *ids]])
    assert rows.shape[1] < model.max_length  # one window
    ref = evaluate_loss(model.model, rows, mode=eval_mode, num_passes=k or 1)
    (ll,) = model.loglikelihood_rolling([req("loglikelihood_rolling", TEXT)], disable_tqdm=True)
    assert ll == pytest.approx(-ref["loss"] * ref["tokens"], rel=1e-5)


def test_loglikelihood_chain_rule_and_modes(model_dir):
    ctx, cont = TEXTS[0].rstrip(), "\n" + TEXTS[1]  # lm-eval moves a context's trailing space to the continuation
    exact, soft = lm(model_dir, "exact"), lm(model_dir, "soft")
    whole = exact.loglikelihood_rolling([req("loglikelihood_rolling", ctx + cont)], disable_tqdm=True)[0]
    head = exact.loglikelihood_rolling([req("loglikelihood_rolling", ctx)], disable_tqdm=True)[0]
    (tail, _), = exact.loglikelihood([req("loglikelihood", ctx, cont)], disable_tqdm=True)
    assert head + tail == pytest.approx(whole, rel=1e-5)  # the recurrence treats context and continuation alike
    # soft prefills the context plainly, so it scores the continuation differently -- as generate() would
    (soft_tail, _), = soft.loglikelihood([req("loglikelihood", ctx, cont)], disable_tqdm=True)
    from fullband.model.generation import score

    tok = soft.tokenizer
    c_ids = tok(ctx)["input_ids"]
    full = tok(ctx + cont)["input_ids"]
    ref = score(soft.model, torch.tensor([c_ids]), torch.tensor([full[len(c_ids):]]), mode="soft")
    assert soft_tail == pytest.approx(float(ref.sum()), rel=1e-5)
    assert abs(soft_tail - tail) > 1e-4


def test_batched_scoring_matches_one_by_one(model_dir):
    soft = lm(model_dir, "soft")
    reqs = [req("loglikelihood", TEXTS[0], " And"), req("loglikelihood", "No", " more"),
            req("loglikelihood", TEXTS[2][:30], TEXTS[1][:25])]
    batched = soft.loglikelihood(reqs, disable_tqdm=True)
    single = [soft.loglikelihood([r], disable_tqdm=True)[0] for r in reqs]
    for (a, ga), (b, gb) in zip(batched, single):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5) and ga == gb


@pytest.mark.parametrize("mode", ["soft", "exact", "standard"])
def test_greedy_flag(model_dir, mode):
    from fullband.model.generation import generate

    model = lm(model_dir, mode)
    ctx = model.tokenizer(TEXTS[0])["input_ids"]
    greedy = generate(model.model, torch.tensor([ctx]), mode=mode, max_new_tokens=3, ignore_eos=True)
    cont = greedy.new_tokens[0].tolist()
    other = [(cont[0] + 1) % len(model.tokenizer)] + cont[1:]
    (_, yes), (_, no) = model._loglikelihood_tokens([(None, ctx, cont), (None, ctx, other)], disable_tqdm=True)
    assert yes and not no


def test_mode_checks(plain_dir, model_dir):
    with pytest.raises(ValueError, match="needs a fullband model"):
        A.FullBandLM(pretrained=plain_dir, feedback_mode="soft", device="cpu")
    with pytest.raises(ValueError, match="unknown feedback_mode"):
        A.FullBandLM(pretrained=model_dir, feedback_mode="bogus", device="cpu")
    with pytest.raises(FileNotFoundError):
        A.FullBandLM(pretrained=os.path.join(plain_dir, "nope"), device="cpu")
    default = lm(model_dir, None)
    assert default.feedback_mode == default.model.config.default_feedback_mode
    assert lm(model_dir, "passes", num_passes=3).decode_mode == ("fused", 2)
    plain = lm(plain_dir, None)
    assert plain.feedback_mode == "standard"
    # the plain backbone scores like the fullband model in standard mode
    r = [req("loglikelihood", TEXTS[0], TEXTS[1][:20])]
    assert plain.loglikelihood(r, disable_tqdm=True)[0][0] == pytest.approx(
        lm(model_dir, "standard").loglikelihood(r, disable_tqdm=True)[0][0], rel=1e-5)
    assert plain.get_model_info()["model_sha"] == ""


def test_shipped_tasks_through_simple_evaluate(model_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=A.tasks_dir(), include_defaults=False)
    assert {"fullband_shakespeare_mc", "fullband_arithmetic", "fullband_shakespeare_ppl"} <= set(tm.all_tasks)
    out = lm_eval.simple_evaluate(model="fullband", model_args=f"pretrained={model_dir},feedback_mode=soft",
                                  tasks=["fullband_shakespeare_mc", "fullband_arithmetic"], limit=2,
                                  task_manager=tm, batch_size=2, device="cpu", gen_kwargs="max_gen_toks=4",
                                  log_samples=True)
    res = out["results"]
    assert 0.0 <= res["fullband_shakespeare_mc"]["acc,none"] <= 1.0
    assert "exact_match,strict-match" in res["fullband_arithmetic"]
    mc = out["samples"]["fullband_shakespeare_mc"][0]
    assert len(mc["resps"]) == 4  # four choices scored
    assert mc["arguments"][0][0].count("\n\n") == 3  # three few-shot examples before the question
    gen = out["samples"]["fullband_arithmetic"][0]
    prompt, gen_kwargs = gen["arguments"][0]
    assert prompt.endswith(f"Q: {gen['doc']['question']}\nA:") and prompt.count("\nA: ") == 3
    assert gen_kwargs["until"] == ["\n\n", "\nQ:"]


def test_task_data_is_reproducible(tmp_path):
    counts = A.build_task_data(str(tmp_path))
    assert counts["shakespeare_mc.test"] == 200 and counts["arithmetic.test"] == 100
    shipped = os.path.join(A.tasks_dir(), "data")
    for name in counts:
        with open(os.path.join(shipped, f"{name}.jsonl")) as f, open(tmp_path / f"{name}.jsonl") as g:
            assert f.read() == g.read(), f"{name}.jsonl is stale: run python -m fullband.eval.lm_eval_adapter build-tasks"
    mc = [json.loads(line) for line in open(tmp_path / "shakespeare_mc.test.jsonl")]
    for item in mc:
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4 and 0 <= item["label"] < 4
    ds = A.load_task_data("shakespeare_mc")
    assert set(ds) == {"train", "test"} and len(ds["test"]) == 200


def test_command_line_adds_the_task_folder():
    assert A.cli_args(["run", "--model", "fullband"])[-2:] == ["--include_path", A.tasks_dir()]
    assert A.cli_args(["--model", "fullband", "--tasks", "x"])[-1] == A.tasks_dir()
    assert A.cli_args(["run", "--include_path", "/x"]) == ["run", "--include_path", "/x"]
    assert A.cli_args(["run", "-h"]) == ["run", "-h"]
