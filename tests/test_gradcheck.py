"""timlab gradcheck: exact vs mismatched policy gradients on the smoke model, and its CLI."""

from __future__ import annotations

import json

import pytest
import torch

from timlab.cli import main
from timlab.config import resolve
from timlab.engines import SamplingParams
from timlab.injectors import build_injector
from timlab.model.hf_io import load_model
from timlab.tasks import build_task, make_splits
from timlab.tokenizer import load_tokenizer
from timlab.gradcheck.estimator import GradcheckError, gradcheck, length_buckets
from timlab.trainer.pretrain import ensure_warm_start


def smoke(*sets: str):
    return resolve(preset="smoke", overrides=list(sets))


@pytest.fixture(scope="module")
def parts():
    cfg = smoke()
    path = ensure_warm_start(cfg).path
    task = build_task(cfg)
    pool, _ = make_splits(task, seed=cfg.task.split_seed, n_train=300, n_val=cfg.task.n_val)
    return cfg, load_model(path), load_tokenizer(path), task, pool


def _check(parts, injector="none", magnitude=0.0, engine="fast", **kw):
    cfg, model, tok, task, pool = parts
    c = smoke(f"mismatch.injector={injector}", f"mismatch.magnitude={magnitude}", f"mismatch.engine={engine}")
    inj = build_injector(c.mismatch, model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    kw = {"samples": 64, "max_new_tokens": cfg.rollout.max_new_tokens, "n_boot": 200, "score_seqs": 2, "dense_reward": True, **kw}
    return gradcheck(model, tok, task, pool, inj, **kw), inj


def test_zero_mismatch_gives_identical_gradients(parts):
    res, _ = _check(parts)
    p = res.pooled
    assert p["bias_norm_plugin"] == 0.0 and p["bias_norm"] == 0.0 and p["bias_norm_hi"] == 0.0
    # a defined cosine of 1 needs a non-zero mean gradient: the equality is not between zeros
    assert p["cosine_plugin"] == pytest.approx(1.0, abs=1e-12)
    assert res.buckets[0]["same_response_frac"] == 1.0
    assert res.bound["delta_max"] == 0.0
    assert res.mismatch["rollout_corr/k3_kl"] == 0.0
    assert p["bias_norm_is"] == p["bias_norm_is_hi"] == 0.0  # rho = 1 bit for bit
    assert p["rel_bias_is"] == 0.0 or p["rel_bias_is"] != p["rel_bias_is"]  # 0, or NaN if g_exact is unresolved
    assert res.bound["holds"] is True and res.buckets[0]["tightness"] == 0.0
    assert res.notes[0].startswith("zero mismatch")


def test_mismatch_grows_with_magnitude_and_stays_under_the_bound(parts):
    rows = [_check(parts, "head_perturb", m)[0] for m in (0.5, 1.0, 2.0)]
    k3 = [r.mismatch["rollout_corr/k3_kl"] for r in rows]
    tv = [r.bound["delta_mean"] for r in rows]
    same = [r.buckets[0]["same_response_frac"] for r in rows]
    assert k3 == sorted(k3) and k3[0] > 0
    assert tv == sorted(tv) and tv[0] > 0
    assert same == sorted(same, reverse=True) and same[-1] < 1.0
    assert rows[-1].pooled["bias_norm_plugin"] > 0
    for r in rows:
        assert r.bound["applies"] and r.bound["holds"]
        assert 0 < r.buckets[0]["tightness_hi"] < 1


def test_importance_weighted_bias_agrees_with_the_paired_one(parts):
    res, _ = _check(parts, "logit_noise", 0.5, samples=128)
    p = res.pooled
    assert p["bias_norm_plugin"] > 0 and res.settings["importance_weighted"]
    # two estimators of the same ||g_tim - g_exact||: their intervals overlap
    assert p["bias_norm_is_lo"] <= p["bias_norm_hi"] and p["bias_norm_lo"] <= p["bias_norm_is_hi"]
    off, _ = _check(parts, "logit_noise", 0.5, sampling=SamplingParams(temperature=0.7))
    assert "bias_norm_is" not in off.pooled and any("temperature 1" in n for n in off.notes)


def test_tv_is_aligned_with_the_trainers_columns(parts):
    # fast engine in fp32 differs from exact by rounding only; comparing mu's distribution for
    # column c with pi's for another column would give a TV of order 0.1-1
    res, _ = _check(parts, "engine", engine="fast")
    assert 0 < res.bound["delta_max"] < 1e-4
    if res.buckets[0]["same_response_frac"] == 1.0:  # nonzero TV that flipped no token is not called zero
        assert "no sampled token differed" in res.notes[0]


def test_same_seed_same_result_and_nothing_is_left_behind(parts):
    cfg, model, *_ = parts
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a, inj = _check(parts, "logit_noise", 0.5, seed=3)
    state = inj.generator.get_state()
    b, _ = _check(parts, "logit_noise", 0.5, seed=3)
    same = lambda r: json.dumps([r.pooled, r.buckets, r.bound, r.mismatch])  # noqa: E731  (NaN == NaN here)
    assert same(a) == same(b)
    assert torch.equal(inj.generator.get_state(), state)  # the injector's random state is restored
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    c, _ = _check(parts, "logit_noise", 0.5, seed=4)
    assert same(c) != same(a)


def test_length_buckets_and_param_filter(parts):
    cfg, model, *_ = parts
    res, _ = _check(parts, "head_perturb", 1.0, samples=128, buckets=2, param_filter="lm_head")
    lo, hi = res.buckets
    assert lo["answer_len_max"] < hi["answer_len_min"]
    assert lo["T_mean"] < hi["T_mean"]
    assert res.settings["params"] == model.lm_head.weight.numel()
    assert len(length_buckets(parts[4], 5)) == 5


@pytest.mark.parametrize("kw, needle", [
    ({"estimator": "ppo"}, "unknown estimator 'ppo'; valid choices: reinforce, rloo"),
    ({"estimator": "rloo", "group_size": 1}, "rloo needs group_size >= 2"),
    ({"estimator": "rloo", "group_size": 3}, "must be a positive multiple of group_size (3)"),
    ({"samples": 32}, "a confidence interval needs >= 8 per bucket"),
    ({"samples": 60}, "must be a positive multiple of micro_batch"),
    ({"buckets": 9, "samples": 576}, "only 5 distinct lengths"),
    ({"param_filter": "nothing_matches"}, "matches no trainable parameter"),
    ({"buckets": 0}, "buckets must be >= 1, got 0"),
    ({"n_boot": 10}, "n_boot must be >= 100"),
    ({"n_boot": 10**9}, "n_boot (--boot) must be at most 10000, got 1000000000"),
    ({"samples": 10**9}, "samples must be at most 1048576, got 1000000000"),
    ({"score_seqs": 10**8}, "score_seqs must be at most 1048576"),
])
def test_bad_input_is_one_clear_error(parts, kw, needle):
    with pytest.raises(GradcheckError, match=None) as e:
        _check(parts, **kw)
    assert needle in str(e.value)


def test_rloo_runs_and_skips_the_bound(parts):
    res, _ = _check(parts, "head_perturb", 1.0, estimator="rloo", group_size=4)
    assert not res.bound["applies"]
    assert any("rloo" in n for n in res.notes)


# ------------------------------------------------------------------------------ the CLI
def _cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_writes_json_and_plot(tmp_path, capsys):
    code, out, _ = _cli(["gradcheck", "--preset", "smoke", "--injector", "head_perturb", "--magnitude", "1",
                         "--samples", "64", "--dense-reward", "--boot", "100", "--json", str(tmp_path / "g.json"),
                         "--plot", str(tmp_path / "g.png"), "--quiet"], capsys)
    assert code == 0
    assert "relative bias" in out and "2BΔT²" in out
    d = json.loads((tmp_path / "g.json").read_text())
    assert d["settings"]["injector"] == "head_perturb" and d["pooled"]["bias_norm_plugin"] > 0
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_on_a_run_directory_and_its_errors(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"]) == 0
    code, out, _ = _cli(["gradcheck", "--run-dir", str(run), "--step", "2", "--samples", "64", "--boot", "100", "--quiet"], capsys)
    assert code == 0 and "gradcheck: injector none" in out
    for argv, needle in [
        (["--run-dir", str(tmp_path / "missing")], "does not exist"),
        (["--run-dir", str(tmp_path)], "not a timlab run directory"),
        (["--run-dir", str(run), "--step", "3"], "no checkpoint for step 3; available steps: 0, 2, 4"),
        (["--preset", "demo", "--model", str(run / "checkpoints" / "step_000004")], "does not match the model config"),
        (["--preset", "smoke", "--injector", "bogus"], "unknown injector 'bogus'; valid choices:"),
        (["--preset", "smoke", "--samples", "16"], "confidence interval needs >= 8"),
        (["--step", "2", "--preset", "smoke"], "--step needs --run-dir"),
        (["--preset", "smoke", "--seed", "100000000000000000000000"], "--seed must be an integer in [0, 4294967295]"),
        (["--preset", "smoke", "--boot", "1000000000"], "n_boot (--boot) must be at most 10000, got 1000000000"),
    ]:
        code, _, err = _cli(["gradcheck", *argv, "--quiet"], capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_the_summary_explains_the_plain_cosine_and_every_na_bucket():
    """Issue 60: `1.0000 [0.9425, 1.0000] (plug-in 0.9401)` read as an interval excluding its own
    estimate, and 3 of 4 length buckets printed a bare `nan`."""
    from timlab.gradcheck.command import format_gradcheck
    from timlab.gradcheck.estimator import GradcheckResult

    nan = float("nan")
    stats = {"rel_bias": 0.3, "bias_norm": 0.2, "grad_norm_exact": 0.7, "snr_exact": 0.01, "snr_tim": 0.01}
    pooled = {**{f"{k}{e}": v for k, v in stats.items() for e in ("", "_lo", "_hi")},
              "cosine": 1.0, "cosine_lo": 0.9425, "cosine_hi": 1.0, "cosine_plugin": 0.9401,
              "rel_bias_plugin": 0.4, "noise_floor_rel": 0.2}
    row = {"answer_len_min": 3, "answer_len_max": 4, "T_mean": 4.0, "T_max": 5, "tv_max": 0.1,
           "same_response_frac": 0.5, **stats, "cosine": 0.99, "bound": nan, "tightness": nan}  # rloo: no bound
    rows = [row, {**row, "cosine": nan}, {**row, "cosine": nan, "rel_bias": nan}]
    res = GradcheckResult(
        settings={"injector": "head_perturb", "magnitude": 1.0, "estimator": "reinforce", "samples": 256,
                  "micro_batches": 32, "micro_batch": 8, "params": 1000},
        pooled=pooled, buckets=rows, mismatch={"rollout_corr/k3_kl": 0.1, "mismatch/max_abs_diff": 1.0},
        bound={"delta_max": 0.1, "delta_mean": 0.01, "applies": False},
        cost={"total_s": 1.0, "rollout_s": 0.5, "gradient_s": 0.4, "score_norm_s": 0.1, "vector_bytes": 0})
    text = format_gradcheck(res)
    assert "cosine(g_tim, g_exact)      1.0000 [0.9425, 1.0000]  (noise-corrected; its estimate passed 1 and is " \
           "clamped)" in text
    assert "  plug-in                   0.9401  (the plain cosine of the mean gradients: noise pulls it toward 0; " \
           "here below the noise-corrected interval, which removes that pull)" in text
    assert "nan" not in text.replace("n/a", "")
    table = text.split("ratio\n")[1].splitlines()[:5]
    assert [line.split().count("n/a") for line in table[:3]] == [2, 3, 4]  # bound + ratio, then cosine, rel bias
    why = [line for line in text.splitlines() if line.startswith("n/a: ")]
    assert len(why) == 3 and why[0].startswith("n/a: 2BΔT², ratio: the T^2 bound is not evaluated")
    assert why[1].startswith("n/a: cosine: the bucket's g_exact or g_tim is not resolved")
    assert why[2].startswith("n/a: rel bias: the bucket's noise-corrected ||g_exact||^2 came out <= 0")
