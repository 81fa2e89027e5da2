"""The k3 controller (mismatch.target_k3): the control law on a known plant (hand-computed steps,
convergence without oscillation), its one-line errors, and in the trainer: exact before
start_step, the logged target and magnitude, tracking on the smoke preset, bitwise resume."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from timlab.config import resolve
from timlab.errors import UsageError
from timlab.injectors.controller import K3Controller
from timlab.rundir.metrics_log import without_timings
from timlab.trainer.run import train


def controller(**kw):
    args = {"target_k3": 1e-3, "target_k3_end": 0.0, "schedule": "constant", "start_step": 0, "ramp_steps": 0,
            "magnitude": 0.1, "gain": 0.5, "max_change": 2.0, **kw}
    return K3Controller(**args)


def test_one_step_of_the_law_by_hand():
    c = controller()
    assert c.magnitude(1) == 0.1
    c.observe(4e-3)  # 4x too high: log m moves by 0.5 * log(1/4) / 2 = -log(2)/2 -> m / sqrt(2)
    assert c.magnitude(2) == pytest.approx(0.1 / math.sqrt(2), rel=1e-12)
    c.observe(1e-3)  # on target: no move
    assert c.magnitude(3) == pytest.approx(0.1 / math.sqrt(2), rel=1e-12)
    c.observe(1e-9)  # far below: clamped at x2
    assert c.magnitude(4) == pytest.approx(0.2 / math.sqrt(2), rel=1e-12)
    c.observe(0.0)  # no mismatch at all: counts as far below, clamped
    assert c.magnitude(5) == pytest.approx(0.4 / math.sqrt(2), rel=1e-12)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0])
def test_converges_without_oscillation_on_a_power_plant(p):
    """Plant k3 = c * m^p (the policy fixed): the log error shrinks by (1 - gain p / 2) per step and
    never changes sign, so the magnitude approaches the one that realizes the target monotonically."""
    c, cst = controller(magnitude=0.05), 0.2
    want = (1e-3 / cst) ** (1 / p)
    errs = []
    for step in range(1, 40):
        m = c.magnitude(step)
        errs.append(math.log(m / want))
        c.observe(cst * m ** p)
    signs = {math.copysign(1, e) for e in errs if abs(e) > 1e-12}
    assert len(signs) == 1  # monotone approach: no overshoot
    assert abs(errs[-1]) <= max(1e-12, abs(errs[0]) * (1 - 0.5 * p / 2) ** 30) and abs(errs[5]) < abs(errs[0])
    if p == 2.0:  # the designed case: the log error halves each step (after the clamp stops binding)
        late = [b / a for a, b in zip(errs[4:10], errs[5:11])]
        assert late == pytest.approx([0.5] * 6, rel=1e-6)


def test_a_zero_magnitude_starts_from_the_default():
    assert controller(magnitude=0.0).magnitude(1) == 0.1


def test_the_target_follows_the_schedule():
    c = controller(target_k3=1e-3, target_k3_end=1e-2, schedule="geometric", start_step=3, ramp_steps=2)
    assert [c.target(s) for s in (1, 2)] == [None, None]
    assert [c.target(s) for s in (3, 4, 5, 9)] == pytest.approx([1e-3, 10 ** -2.5, 1e-2, 1e-2])
    assert c.magnitude(2) is None  # before start_step: exact
    c.observe(5.0)  # ignored before start_step
    assert c.magnitude(3) == 0.1


def smoke(**sets):
    return resolve(preset="smoke", overrides=[f"{k}={v}" for k, v in sets.items()])


@pytest.mark.parametrize("sets, msg", [
    ({"mismatch.injector": "precision"}, "mismatch.target_k3 controls a continuous magnitude"),
    ({"mismatch.injector": "stale", "mismatch.magnitude": 1}, "mismatch.target_k3 controls a continuous magnitude"),
    ({"mismatch.injector": "head_perturb+stale", "mismatch.magnitude": 1}, "cannot control the integer lag of stale"),
    ({"mismatch.injector": "head_perturb", "mismatch.magnitude": -1}, "mismatch.magnitude must be >= 0"),
    ({"mismatch.magnitude_end": 0.5, "mismatch.schedule": "linear", "mismatch.ramp_steps": 2},
     "set mismatch.target_k3_end instead"),
    ({"mismatch.schedule": "linear", "mismatch.ramp_steps": 2}, "needs mismatch.target_k3_end > 0"),
    ({"mismatch.target_gain": 0}, r"mismatch.target_gain must be in \(0, 1\], got 0"),
    ({"mismatch.target_max_change": 1.0}, "mismatch.target_max_change must be a finite number > 1"),
    ({"mismatch.target_k3": -1}, "mismatch.target_k3 must be a finite number >= 0"),
])
def test_bad_controller_settings_are_refused_before_the_run(tmp_path, sets, msg):
    base = {"mismatch.injector": "head_perturb", "mismatch.magnitude": 0.3, "mismatch.target_k3": 1e-3}
    with pytest.raises(UsageError, match=msg):
        train(smoke(**{**base, **sets}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


class _StopAt(BaseException):
    pass


def test_trainer_tracks_the_target_and_resumes_bitwise(tmp_path):
    """head_perturb held at k3 = 2e-3 from step 3 on the smoke preset: steps 1-2 exact (guard on);
    the logged target, and the magnitude moved by the law from each step's realized k3 (recomputed
    here from the log); the realized k3 ends within 2x of the target from a start over 6x off; a run
    cut after step 8 and resumed equals the uninterrupted one bit for bit."""
    cfg = smoke(**{"run.steps": 14, "run.checkpoint_every": 3, "mismatch.injector": "head_perturb",
                   "mismatch.magnitude": 0.02, "mismatch.target_k3": 2e-3, "mismatch.start_step": 3})
    train(cfg, tmp_path / "ref")
    df = without_timings(pd.read_parquet(tmp_path / "ref" / "metrics.parquet")).set_index("step").loc[1:]
    assert (df.loc[[1, 2], "rollout_corr/k3_kl"] == 0).all() and (df.loc[[1, 2], "mismatch/frac_bitwise_equal"] == 1).all()
    assert df.loc[[1, 2], "mismatch/magnitude"].tolist() == [0.0, 0.0]
    assert df.loc[3:, "mismatch/target_k3"].tolist() == [2e-3] * 12
    m, k3 = df.loc[3:, "mismatch/magnitude"].to_numpy(), df.loc[3:, "rollout_corr/k3_kl"].to_numpy()
    assert m[0] == 0.02
    for i in range(len(m) - 1):  # each next magnitude is the law applied to this step's realized k3
        move = max(-math.log(2), min(math.log(2), 0.5 * (math.log(2e-3) - math.log(k3[i])) / 2))
        assert m[i + 1] == pytest.approx(m[i] * math.exp(move), rel=1e-12)
    assert abs(math.log(k3[0] / 2e-3)) > math.log(6)  # the first magnitude is far off the target
    assert abs(math.log(k3[-4:].mean() / 2e-3)) < math.log(2)  # and the controller brought it within 2x

    def stop(phase, step, total, row):
        if phase == "train" and step == 8:
            raise _StopAt()

    with pytest.raises(_StopAt):
        train(cfg, tmp_path / "cut", progress=stop)
    train(cfg, tmp_path / "cut", resume=True)
    pd.testing.assert_frame_equal(without_timings(pd.read_parquet(tmp_path / "ref" / "metrics.parquet")),
                                  without_timings(pd.read_parquet(tmp_path / "cut" / "metrics.parquet")), check_exact=True)
    latest = lambda d: d / "checkpoints" / (d / "checkpoints" / "latest").read_text().strip()  # noqa: E731
    wa, wb = (load_file(str(latest(tmp_path / d) / "model.safetensors")) for d in ("ref", "cut"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
