"""Mismatch schedules: the magnitude at given steps, the exact rollout before start_step (k3
exactly 0, the guard on), the logged magnitude, and bitwise resume of a scheduled stale run."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from timlab.config import resolve
from timlab.errors import TimlabError, UsageError
from timlab.injectors.schedule import SCHEDULES, check_schedule, round_half_up, scheduled_magnitude
from timlab.rundir.metrics_log import without_timings
from timlab.trainer.run import train


def at(step, schedule="linear", magnitude=0.1, magnitude_end=0.5, start_step=10, ramp_steps=4):
    return scheduled_magnitude(step, schedule=schedule, magnitude=magnitude, magnitude_end=magnitude_end,
                               start_step=start_step, ramp_steps=ramp_steps)


def test_schedule_values_at_given_steps():
    assert [at(s) for s in (1, 9)] == [None, None]  # before start_step: exact
    assert [at(s) for s in (10, 11, 12, 13, 14, 15, 100)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5])
    assert [at(s, "geometric", 0.01, 1.0, 0, 2) for s in (1, 2, 3, 4)] == pytest.approx([0.01, 0.1, 1.0, 1.0])
    assert [at(s, "constant", 0.3, 9.0, 0, 0) for s in (1, 50)] == [0.3, 0.3]
    assert [at(s, "linear", 0.5, 0.1, 1, 2) for s in (1, 2, 3)] == pytest.approx([0.5, 0.3, 0.1])  # down ramps too
    assert at(1, start_step=0) == at(1, start_step=1) == 0.1  # 0 and 1 both mean: from the first step
    assert SCHEDULES.names() == ["constant", "geometric", "linear"]
    assert [round_half_up(x) for x in (1.0, 1.49, 1.5, 2.5, 3.7)] == [1, 1, 2, 3, 4]


@pytest.mark.parametrize("kw, msg", [
    ({"schedule": "cosine"}, "unknown mismatch.schedule 'cosine'; valid choices: constant, geometric, linear"),
    ({"start_step": -1}, "mismatch.start_step must be >= 0, got -1"),
    ({"ramp_steps": 0}, "mismatch.ramp_steps must be >= 1 for mismatch.schedule=linear, got 0"),
    ({"schedule": "geometric", "magnitude": 0.0}, "mismatch.schedule=geometric needs mismatch.magnitude > 0"),
    ({"magnitude_end": -1.0}, "mismatch.magnitude_end must be a finite number >= 0, got -1.0"),
])
def test_bad_schedules_one_line(kw, msg):
    args = {"schedule": "linear", "magnitude": 0.1, "magnitude_end": 0.5, "start_step": 0, "ramp_steps": 4, **kw}
    with pytest.raises(TimlabError, match=msg):  # one line, a user's error
        check_schedule(**args)


def test_42_17_a_start_step_after_the_last_step_is_refused(capsys):
    """Issue 42, finding 17: the run went to its end with no injection and no word."""
    from timlab import cli
    from timlab.config import ConfigError

    ok = resolve(preset="smoke", overrides=["mismatch.injector=logit_noise", "mismatch.magnitude=0.5", "run.steps=4",
                                            "mismatch.start_step=4"])  # the last step injects
    assert ok.mismatch.start_step == ok.run.steps == 4
    resolve(preset="smoke", overrides=["run.steps=4", "mismatch.start_step=9"])  # no injector: nothing to start
    with pytest.raises(ConfigError) as e:
        resolve(preset="smoke", overrides=["mismatch.injector=logit_noise", "mismatch.magnitude=0.5", "run.steps=4",
                                           "mismatch.start_step=5"])
    assert str(e.value) == ("mismatch.start_step=5 is after the run's last step (run.steps=4): "
                            "mismatch.injector=logit_noise would never act and the run would be a control; "
                            "set mismatch.start_step <= run.steps")
    assert cli.main(["train", "--preset", "smoke", "--run-dir", "/nonexistent/never", "--set", "run.steps=4",
                     "--set", "mismatch.injector=head_perturb", "--set", "mismatch.start_step=100"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("timlab: error: mismatch.start_step=100 is after the run's last step") and "\n" not in err


def smoke(**sets):
    return resolve(preset="smoke", overrides=[f"{k}={v}" for k, v in sets.items()])


def _metrics(run_dir):
    return without_timings(pd.read_parquet(run_dir / "metrics.parquet"))


def test_a_schedule_needs_a_part_with_a_magnitude(tmp_path):
    cfg = smoke(**{"mismatch.injector": "precision", "mismatch.schedule": "linear", "mismatch.ramp_steps": 2})
    with pytest.raises(UsageError, match="mismatch.schedule=linear moves the magnitude of head_perturb, kv_cache, logit_noise, "
                                         "stale, temperature only; add one of them"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before any model or run directory


def test_exact_before_start_step_then_the_ramp(tmp_path):
    """Steps 1-2 roll out exactly (the guard is on and holds, k3 exactly 0, every token equal);
    from step 3 the head perturbation ramps 0.2 -> 0.6 over 2 steps, and the log says so."""
    cfg = smoke(**{"run.steps": 5, "mismatch.injector": "head_perturb", "mismatch.magnitude": 0.2,
                   "mismatch.schedule": "linear", "mismatch.magnitude_end": 0.6, "mismatch.ramp_steps": 2,
                   "mismatch.start_step": 3})
    train(cfg, tmp_path / "run")
    df = pd.read_parquet(tmp_path / "run" / "metrics.parquet").set_index("step").loc[1:]
    assert df["mismatch/magnitude"].tolist() == pytest.approx([0.0, 0.0, 0.2, 0.4, 0.6])
    assert (df.loc[[1, 2], "rollout_corr/k3_kl"] == 0.0).all()
    assert (df.loc[[1, 2], "mismatch/frac_bitwise_equal"] == 1.0).all()
    assert (df.loc[[3, 4, 5], "rollout_corr/k3_kl"] > 0).all()


def test_constant_schedule_logs_the_magnitude_and_changes_nothing(tmp_path):
    """A constant schedule from the first step is today's injector, bit for bit."""
    base = {"run.steps": 2, "mismatch.injector": "logit_noise", "mismatch.magnitude": 0.3}
    train(smoke(**base), tmp_path / "a")
    train(smoke(**base, **{"mismatch.start_step": 1}), tmp_path / "b")
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert a["mismatch/magnitude"].iloc[1:].tolist() == [0.3, 0.3]


class _StopAt(BaseException):
    pass


def test_scheduled_stale_run_resumes_bitwise(tmp_path):
    """stale with the lag ramping 1 -> 2 from step 2: a run interrupted after step 5 (last
    checkpoint at 4) and resumed ends with the uninterrupted run's metrics and weights, bit for bit."""
    cfg = smoke(**{"run.steps": 7, "run.checkpoint_every": 2, "mismatch.injector": "stale", "mismatch.magnitude": 1,
                   "mismatch.schedule": "linear", "mismatch.magnitude_end": 2, "mismatch.ramp_steps": 2,
                   "mismatch.start_step": 2})
    train(cfg, tmp_path / "ref")

    def stop(phase, step, total, row):
        if phase == "train" and step == 5:
            raise _StopAt()

    with pytest.raises(_StopAt):
        train(cfg, tmp_path / "cut", progress=stop)
    train(cfg, tmp_path / "cut", resume=True)
    ref, cut = _metrics(tmp_path / "ref"), _metrics(tmp_path / "cut")
    pd.testing.assert_frame_equal(ref, cut, check_exact=True)
    df = ref.set_index("step").loc[1:]
    assert df["mismatch/magnitude"].tolist() == pytest.approx([0.0, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0])
    assert df.loc[1, "rollout_corr/k3_kl"] == 0.0 and df.loc[1, "mismatch/frac_bitwise_equal"] == 1.0  # exact
    assert (df.loc[2:, "rollout_corr/k3_kl"] > 0).all()  # from step 2 the rollout trails the trainer
    latest = lambda d: (d / "checkpoints" / (d / "checkpoints" / "latest").read_text().strip())  # noqa: E731
    wa = load_file(str(latest(tmp_path / "ref") / "model.safetensors"))
    wb = load_file(str(latest(tmp_path / "cut") / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
