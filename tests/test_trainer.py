"""The RL loop: smoke runs of the real entry point, determinism, kill/resume, bad input."""

from __future__ import annotations

import json
import math
import random
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from timlab.cli import main
from timlab.config import resolve
from timlab.metrics import DECISION_FRAC, HARM_CANDIDATES
from timlab.trainer.advantages import grpo, informative_groups, reinforce, rloo
from timlab.rundir.metrics_log import without_timings
from timlab.trainer.losses import aggregate, ppo_clip_loss
from timlab.trainer.run import train

REPO = Path(__file__).resolve().parents[1]


def smoke(**sets):
    return resolve(preset="smoke", overrides=[f"{k}={v}" for k, v in sets.items()])


def _weights(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def _metrics(run_dir: Path) -> pd.DataFrame:
    return without_timings(pd.read_parquet(run_dir / "metrics.parquet"))


# ------------------------------------------------------------------------------ pure pieces
def test_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.allclose(reinforce(r)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # rloo: r_i - mean(others): 1 - 1/3, 0 - 2/3
    assert torch.allclose(rloo(r)[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    std = torch.tensor([1.0, 0, 0, 1]).std()
    assert torch.allclose(grpo(r)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(grpo(r)[1], torch.zeros(4))
    assert informative_groups(r).tolist() == [True, False]


def test_ppo_loss_clipping_and_aggregation():
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.25, 0.5], [0.9, 0.2]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # ratios: [2, 1], [1, 0.5]; A=+1 clips 2 -> 1.28; A=-1 row: ratio 1 -> 1 (masked 0.5 ignored)
    expected = (-1.28 + -1.0 + 1.0) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["train/clip_frac_high"] == pytest.approx(1 / 3)
    per = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    assert aggregate(per, mask, "seq_mean").item() == pytest.approx((2.0 + 5.0) / 2)
    assert aggregate(per, mask, "token_mean").item() == pytest.approx(9.0 / 3)
    with pytest.raises(ValueError, match="valid choices"):
        aggregate(per, mask, "sum")


# ------------------------------------------------------------------------------ runs
def test_smoke_run_cli(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"]) == 0
    df = pd.read_parquet(run / "metrics.parquet")
    assert df["step"].tolist() == [0, 1, 2, 3, 4]
    required = ["train/reward_mean", "train/reward_std", "train/response_length_mean", "train/response_length_max",
                "train/response_length_p90", "train/entropy", "train/grad_norm", "train/grad_norm_ema", "train/lr",
                "train/clip_frac", "train/step_time_s", "train/tokens_per_s", "val/accuracy",
                "mismatch/max_abs_diff", "rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff"]
    for k in required:
        assert k in df.columns, k
    assert (df["mismatch/max_abs_diff"].iloc[1:] == 0).all()
    assert (df["mismatch/frac_bitwise_equal"].iloc[1:] == 1).all()
    assert df["val/accuracy"].notna().sum() == 3  # steps 0, 2, 4
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert (run / "config.yaml").exists() and (run / "distributions.jsonl").exists()
    # the checkpoint is an ordinary HF folder
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "config.json").exists() and (latest / "tokenizer.json").exists()


def test_same_seed_same_bits_and_updates_happen(tmp_path):
    cfg = smoke(**{"run.steps": 3, "rollout.samples_per_prompt": 8, "rollout.prompts_per_step": 6})
    train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b")
    ma, mb = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    pd.testing.assert_frame_equal(ma, mb, check_exact=True)
    assert ma["train/updated"].iloc[1:].sum() >= 1, "no step updated the weights: the test would be vacuous"
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    other = smoke(**{"run.steps": 3, "rollout.samples_per_prompt": 8, "rollout.prompts_per_step": 6, "run.seed": 1})
    train(other, tmp_path / "c")
    assert not _metrics(tmp_path / "c").equals(ma)


def test_in_run_gradcheck_logs_metrics_and_leaves_the_trajectory_alone(tmp_path):
    base = {"run.steps": 4, "mismatch.injector": "logit_noise", "mismatch.magnitude": 0.5}
    train(smoke(**base), tmp_path / "off")
    train(smoke(**base, **{"run.gradcheck_every": 2}), tmp_path / "on")
    on, off = _metrics(tmp_path / "on"), _metrics(tmp_path / "off")
    gc_cols = [c for c in on.columns if c.startswith("gradcheck/")]
    assert {"gradcheck/cosine", "gradcheck/rel_bias", "gradcheck/snr_exact", "gradcheck/tv_max"} <= set(gc_cols)
    checked = on.dropna(subset=["gradcheck/tv_max"])["step"].tolist()
    assert checked == [2, 4]
    assert (on.loc[on["step"].isin(checked), "gradcheck/tv_max"] > 0).all()
    pd.testing.assert_frame_equal(on.drop(columns=gc_cols), off, check_exact=True)
    wa, wb = _weights(tmp_path / "on"), _weights(tmp_path / "off")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    t = pd.read_parquet(tmp_path / "on" / "metrics.parquet")["time/gradcheck_s"].dropna()
    assert len(t) == 2 and (t > 0).all()


@pytest.mark.parametrize("sets, needle", [
    ({"run.gradcheck_every": 1, "run.gradcheck_samples": 40}, "run.gradcheck_samples must be a multiple of 8 and >= 64"),
    ({"run.gradcheck_every": 1, "run.gradcheck_estimator": "ppo"}, "valid choices: reinforce, rloo"),
    ({"run.gradcheck_every": -1}, "run.gradcheck_every: expected an integer in [0, "),
])
def test_bad_gradcheck_settings(tmp_path, sets, needle):
    with pytest.raises(ValueError, match=None) as e:
        train(smoke(**sets), tmp_path / "r")
    assert needle in str(e.value)


def test_kill_and_resume_matches_uninterrupted(tmp_path):
    sets = ["run.steps=8", "run.checkpoint_every=2", "run.eval_every=4", "rollout.samples_per_prompt=8"]
    ref = tmp_path / "ref"
    assert main(["train", "--preset", "smoke", "--run-dir", str(ref), "--quiet", *sum([["--set", s] for s in sets], [])]) == 0

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "timlab", "train", "--preset", "smoke", "--run-dir", str(killed), "--quiet"]
    cmd += sum([["--set", s] for s in sets], [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once step 5 is logged (between checkpoints 4 and 6)
        try:
            if (killed / "metrics.parquet").exists() and pd.read_parquet(killed / "metrics.parquet")["step"].max() >= 5:
                break
        except Exception:
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((killed / "status.json").read_text())["state"] == "running"  # killed, not finished
    assert pd.read_parquet(killed / "metrics.parquet")["step"].max() < 8

    assert main(["train", "--run-dir", str(killed), "--resume", "--quiet"]) == 0
    pd.testing.assert_frame_equal(_metrics(ref), _metrics(killed), check_exact=True)
    wr, wk = _weights(ref), _weights(killed)
    assert all(torch.equal(wr[k], wk[k]) for k in wr)


def test_nonfinite_stops_and_keeps_metrics_and_checkpoint(tmp_path):
    run = tmp_path / "run"
    cfg = smoke(**{"optim.lr": 1e30, "optim.grad_clip": 0, "run.steps": 6, "run.checkpoint_every": 1,
                   "rollout.samples_per_prompt": 8, "rollout.prompts_per_step": 8, "algorithm.reject_equal_groups": False,
                   "task.dense_reward": True})
    with pytest.raises(RuntimeError, match=r"step \d+: non-finite values in"):
        train(cfg, run)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "diverged" and "non-finite" in status["message"]
    assert len(pd.read_parquet(run / "metrics.parquet")) >= 2
    assert (run / "checkpoints" / "latest").exists()


# ------------------------------------------------------------------------------ bad input
def _cli_err(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("sets, needle", [
    (["optim.lrr=1"], "unknown key optim.lrr; valid choices: lr,"),
    (["algo.name=grpo"], "unknown section 'algo'; valid choices: model,"),
    (["algorithm.name=ppo2"], "unknown algorithm.name 'ppo2'; valid choices: grpo, reinforce, rloo"),
    (["rollout.engine=vllmx"], "unknown rollout.engine 'vllmx'; valid choices:"),
    (["scheduler.name=step"], "valid choices: constant, cosine, length_decay"),
    (["correction.mode=clip"], "valid choices: mask, none, truncate, two_sided"),
    (["mismatch.injector=magic"], "unknown injector 'magic'; valid choices:"),
    (["run.steps=abc"], "run.steps: expected an integer"),
    (["task.kwargs={max_len: 3, bogus: 1}"], "task.kwargs"),
])
def test_bad_config_one_line(tmp_path, capsys, sets, needle):
    err = _cli_err(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "r"), *sum([["--set", s] for s in sets], [])], capsys)
    assert needle in err


def test_resume_errors(tmp_path, capsys):
    err = _cli_err(["train", "--run-dir", str(tmp_path / "nothing"), "--resume"], capsys)
    assert "not a timlab run directory" in err
    run = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet", "--set", "run.steps=2"]) == 0
    err = _cli_err(["train", "--preset", "smoke", "--run-dir", str(run)], capsys)
    assert "already holds a run" in err
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    before = _metrics(run)
    (ckpt / "trainer_state.pt").write_bytes(b"garbage")
    # the only checkpoint is damaged: said in one line, and the run resumes from the warm start
    assert main(["train", "--run-dir", str(run), "--resume", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "unusable" in err and str(ckpt) in err and "step 0" in err and "Traceback" not in err
    pd.testing.assert_frame_equal(_metrics(run), before)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_torchrun_two_processes(tmp_path):
    run = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # --standalone: the rendezvous takes a free port, so tests running side by side (xdist) never collide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "timlab", "train", "--preset", "smoke", "--run-dir", str(run), "--quiet",
           "--set", "run.steps=3", "--set", "rollout.samples_per_prompt=8", "--set", "rollout.prompts_per_step=6"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("done:") == 1  # only rank 0 reports
    df = pd.read_parquet(run / "metrics.parquet")
    assert df["step"].max() == 3
    # every rank runs the zero-mismatch guard; rank 0's shard is logged
    assert (df["mismatch/max_abs_diff"].iloc[1:] == 0).all()
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


@pytest.mark.parametrize("sets", [
    {"model.dtype": "bfloat16"},
    {"model.dtype": "float16"},
    {"model.dtype": "bfloat16", "model.lm_head_fp32": True},
    {"algorithm.mini_batches": 2, "algorithm.epochs": 2},
    {"algorithm.name": "rloo", "algorithm.loss_agg": "seq_mean", "correction.mode": "truncate"},
])
def test_zero_mismatch_holds_in_every_precision_and_update_schedule(tmp_path, sets):
    cfg = smoke(**{"run.steps": 2, "rollout.samples_per_prompt": 8, "rollout.prompts_per_step": 4, **sets})
    train(cfg, tmp_path / "run")  # the guard raises on any differing bit
    df = pd.read_parquet(tmp_path / "run" / "metrics.parquet").iloc[1:]
    assert (df["mismatch/frac_bitwise_equal"] == 1.0).all()
    assert (df["rollout_corr/k3_kl"] == 0.0).all()
    assert (df[list(HARM_CANDIDATES)] == 0.0).all().all()  # every harm statistic, advantage-weighted ones too


def test_injected_mismatch_is_measured_and_guard_is_off(tmp_path):
    cfg = smoke(**{"run.steps": 2, "mismatch.injector": "precision", "mismatch.dtype": "bfloat16"})
    train(cfg, tmp_path / "run")
    df = pd.read_parquet(tmp_path / "run" / "metrics.parquet").iloc[1:]
    assert (df["mismatch/max_abs_diff"] > 0).all() and (df["rollout_corr/k3_kl"] > 0).all()
    assert (df["mismatch/tv_mean"] > 0).all() and (df["mismatch/adv_diff_corr"].abs() <= 1).all()
    # the decision tokens (ceil(0.2 N) of the step's N) and the rest split k3 per token
    n = df["mismatch/num_tokens"]
    top = (DECISION_FRAC * n).apply(math.ceil)
    split = (top * df["mismatch/k3_decision"] + (n - top) * df["mismatch/k3_rest"]) / n
    assert split.tolist() == pytest.approx(df["rollout_corr/k3_kl"].tolist(), rel=1e-9)


def test_kl_penalty_to_the_frozen_start(tmp_path):
    """kl_coef > 0 adds k3(ref || pi) against the starting policy: 0 at the first step (pi = ref),
    so the first step's loss equals the no-KL run's; afterwards pi moves away and the runs differ."""
    base = {"run.steps": 3, "rollout.samples_per_prompt": 8, "rollout.prompts_per_step": 6}
    train(smoke(**base), tmp_path / "nokl")
    train(smoke(**base, **{"algorithm.kl_coef": 0.5}), tmp_path / "kl")
    a, b = _metrics(tmp_path / "nokl"), _metrics(tmp_path / "kl")
    assert a["train/loss"].iloc[1] == pytest.approx(b["train/loss"].iloc[1], abs=1e-7)
    assert a["train/updated"].iloc[1:].sum() >= 1
    assert not a["train/loss"].iloc[2:].equals(b["train/loss"].iloc[2:])


def test_tensorboard_option(tmp_path):
    pytest.importorskip("tensorboard")
    train(smoke(**{"run.steps": 2, "run.tensorboard": True}), tmp_path / "run")
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert "train/reward_mean" in acc.Tags()["scalars"] and "rollout_corr/k3_kl" in acc.Tags()["scalars"]


@pytest.mark.parametrize("name", ["smoke", "default", "demo", "surge", "beyond-precision", "surge_moe"])
def test_every_preset_resolves_and_validates(name):
    from timlab.config import PRESETS, validate

    assert name in PRESETS
    cfg = resolve(preset=name)
    validate(cfg)
    if name == "beyond-precision":  # the seed paper's Table 1, scaled
        assert (cfg.algorithm.name, cfg.algorithm.clip_low, cfg.algorithm.clip_high) == ("rloo", 0.2, 0.28)
        assert (cfg.optim.weight_decay, cfg.optim.grad_clip, cfg.rollout.samples_per_prompt) == (0.01, 1.0, 16)
        assert (cfg.scheduler.name, cfg.scheduler.min_lr_ratio, cfg.correction.threshold) == ("length_decay", 0.1, 2.0)


def test_surge_testbed_runs_with_a_mixed_warm_start(tmp_path):
    """The surge preset end to end at a tiny budget: the warm start is trained on both answer forms,
    the RL run is exact, and the guard holds on answers that may run to the scratchpad's length."""
    cfg = resolve(preset="surge", overrides=[
        "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64", "model.pretrain_steps=30",
        "task.kwargs.max_digits=2", "task.n_train=300", "task.n_val=16", "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=16", "run.steps=2", "run.eval_every=2", "run.progress=false"])
    assert cfg.task.name == "scratch_add" and cfg.scheduler.surge_ratio == 1.5
    train(cfg, tmp_path / "run")
    df = pd.read_parquet(tmp_path / "run" / "metrics.parquet").iloc[1:]
    assert (df["mismatch/frac_bitwise_equal"] == 1.0).all() and (df["rollout_corr/k3_kl"] == 0.0).all()
    from timlab.trainer.pretrain import warm_start_dir

    info = json.loads((warm_start_dir(cfg) / "pretrain.json").read_text())
    assert info["task_kwargs"] == {"max_digits": 2, "scratch_frac": 0.2}


def test_progress_bar_of_a_phase_that_starts_at_zero_never_counts_below_zero(capsys):
    """The sweep phase reports 0 runs done first (a training phase reports step 1 first)."""
    from timlab.cli import PhaseBars

    prog = PhaseBars()
    prog("sweep", 0, 8, {})
    assert prog.bars["sweep"].n == 0
    prog("sweep", 3, 8, {})
    assert prog.bars["sweep"].n == 3
    prog("train:r", 1, 4, {"train/reward_mean": 0.5})
    assert prog.bars["train:r"].n == 1
    prog.close()
    err = capsys.readouterr().err
    assert "-1/8" not in err and "clamping" not in err and "3/8" in err


# ------------------------------------------------------------------------------ gold log-prob
def test_gold_logprob_scores_the_worked_answer_teacher_forced(tmp_path):
    from timlab.model.forward import token_logprobs
    from timlab.model.llama import CausalLM, ModelConfig
    from timlab.tasks import get_task
    from timlab.tokenizer import load_tokenizer, save_char_tokenizer
    from timlab.trainer.scoring import gold_logprob

    task = get_task("scratch_add", max_digits=3)
    tok = load_tokenizer(save_char_tokenizer(task.alphabet, tmp_path / "tok"))
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).eval()
    rng = random.Random(0)
    examples = [task.sample_one(rng) for _ in range(9)]
    assert task.gold_completion(examples[0]).startswith(":")  # the worked form, not the terse answer

    # reference: each example alone, unpadded, summed in float64
    ref = []
    for e in examples:
        p, c = tok.encode(e.prompt), tok.encode(task.gold_completion(e)) + [tok.eos_token_id]
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool), mode="exact")
        ref.append(float(logp[0, len(p):].double().sum()))
    got = gold_logprob(model, tok, task, examples, batch_size=4)
    assert got == pytest.approx(sum(ref) / len(ref), rel=1e-6)
    assert got < 0
    # exact mode is batch-invariant: the batch split does not change a bit
    assert gold_logprob(model, tok, task, examples, batch_size=1) == got


def test_smoke_run_logs_gold_logprob_at_each_evaluation(tmp_path):
    cfg = smoke(**{"run.steps": 2, "run.eval_every": 1})
    train(cfg, tmp_path / "r")
    df = pd.read_parquet(tmp_path / "r" / "metrics.parquet")
    gold = df["val/gold_logprob"]
    assert gold.notna().tolist() == df["val/accuracy"].notna().tolist()
    assert (gold.dropna() < 0).all() and gold.dropna().map(math.isfinite).all()


def test_59_25_a_run_resumed_at_its_last_checkpoint_writes_the_columns_of_an_uninterrupted_one(tmp_path):
    """Issue 59, finding 25: killed after its last checkpoint (before its status said finished), a
    run resumed there rewrote metrics.parquet from rows whose NaN values had been dropped, so the
    three mismatch/persistence_* columns (NaN at every step at zero mismatch) were gone."""
    from timlab.rundir import RunDir
    from timlab.rundir.metrics_log import MetricsLog

    ref = tmp_path / "ref"
    train(smoke(**{"run.steps": 2, "run.checkpoint_every": 1, "run.eval_every": 1}), ref)
    full = pd.read_parquet(ref / "metrics.parquet")
    persistence = ["mismatch/persistence_ema", "mismatch/persistence_lag1", "mismatch/persistence_reliability"]
    assert set(persistence) <= set(full.columns) and full[persistence].isna().all().all()
    killed = tmp_path / "killed"
    shutil.copytree(ref, killed)
    RunDir(killed).write_status("running", step=2, total_steps=2)  # as kill -9 after the last checkpoint leaves it
    assert main(["train", "--run-dir", str(killed), "--resume", "--quiet"]) == 0
    pd.testing.assert_frame_equal(_metrics(ref), _metrics(killed), check_exact=True)
    # the writer itself: a resume that keeps rows keeps every column of the file, even an all-NaN one
    log = MetricsLog(tmp_path / "log")
    log.path.parent.mkdir()
    for step in (1, 2, 3):
        log.append({"step": step, "a": float(step), "b": math.nan})
    log = MetricsLog(tmp_path / "log")
    log.load(2)
    assert list(pd.read_parquet(log.path).columns) == ["step", "a", "b"]
    log.append({"step": 3, "a": 3.0, "b": math.nan})
    assert pd.read_parquet(log.path)["a"].tolist() == [1.0, 2.0, 3.0]
    log.load(-1)  # a resume from the warm start keeps nothing, and no column
    log.append({"step": 1, "a": 1.0})
    assert list(pd.read_parquet(log.path).columns) == ["step", "a"]
