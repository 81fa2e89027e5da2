"""The k3 controller (mismatch.target_k3): the control law on a known plant (hand-computed steps,
convergence without oscillation), the fixed law's oscillation on a steep plant and the adaptive
law (mismatch.target_adapt) that settles it, its one-line errors, the config hash without the
new field, and in the trainer: exact before start_step, the logged target and magnitude, tracking
on the smoke preset, bitwise resume under both laws."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from timlab.config import ConfigError, resolve
from timlab.errors import UsageError
from timlab.injectors.controller import ADAPT_FLOOR, K3Controller
from timlab.rundir.metrics_log import without_timings
from timlab.trainer.run import train


def controller(**kw):
    args = {"target_k3": 1e-3, "target_k3_end": 0.0, "schedule": "constant", "start_step": 0, "ramp_steps": 0,
            "magnitude": 0.1, "gain": 0.5, "max_change": 2.0, "adapt": False, **kw}
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


def run_plant(c: K3Controller, *, p: float, want: float, steps: int, sigma: float = 0.0, seed: int = 0):
    """Plant k3 = 1e-3 * (m / want)^p * exp(sigma * N(0, 1)) (the policy fixed; ``want`` realizes the
    1e-3 target on average): the magnitudes and the realized k3, per step."""
    rng, ms, ks = random.Random(seed), [], []
    for step in range(1, steps + 1):
        m = c.magnitude(step)
        k3 = 1e-3 * (m / want) ** p * math.exp(sigma * rng.gauss(0.0, 1.0))
        ms.append(m)
        ks.append(k3)
        c.observe(k3)
    return ms, ks


@pytest.mark.parametrize("want", [0.25, 0.9, 1.7])
def test_the_fixed_law_oscillates_on_a_steep_plant(want):
    """k3 ~ m^13 (a sharp policy: Study L1's starts): each move of the fixed law is cut to a factor
    2 and overshoots, so the magnitude ends alternating between two values a factor 2 apart, one
    too low and one too high, and no step lands within [0.5, 2]x the target."""
    ms, ks = run_plant(controller(), p=13, want=want, steps=40)
    assert all(ms[i + 2] == pytest.approx(ms[i], rel=1e-12) for i in range(20, 38))
    assert all(max(a, b) / min(a, b) == pytest.approx(2.0, rel=1e-12) for a, b in zip(ms[20:], ms[21:]))
    assert min(abs(math.log(k / 1e-3)) for k in ks[20:]) > math.log(2) * 4  # every step >16x off the target


@pytest.mark.parametrize("want", [0.25, 0.9, 1.7])
def test_the_adaptive_law_settles_on_a_steep_plant(want):
    """The same plant under mismatch.target_adapt: the bracket around the target shrinks, and from
    step 25 on every step's k3 is within 13 * ADAPT_FLOOR in log (a factor 1.29) of the target."""
    ms, ks = run_plant(controller(adapt=True), p=13, want=want, steps=60)
    assert max(abs(math.log(k / 1e-3)) for k in ks[24:]) <= 13 * ADAPT_FLOOR
    assert max(abs(math.log(m / want)) for m in ms[24:]) <= ADAPT_FLOOR


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_a_noisy_steep_plant_the_adaptive_law_tracks_and_the_fixed_one_does_not(seed):
    """k3 ~ m^13 times a log-normal batch noise (sd 0.5 in log k3), steps 21-200: the fixed law
    never lands within [0.5, 2]x the target and its mean k3 is >10x it; the adaptive law lands
    there on 70% of the steps or more, with median and mean within 1.3x of the target."""
    for adapt in (False, True):
        _, ks = run_plant(controller(adapt=adapt), p=13, want=0.9, steps=200, sigma=0.5, seed=seed)
        ratio = [k / 1e-3 for k in ks[20:]]
        in_band = sum(0.5 <= r <= 2 for r in ratio) / len(ratio)
        if adapt:
            assert in_band >= 0.7
            assert 1 / 1.3 < statistics.median(ratio) < 1.3 and 1 / 1.3 < statistics.mean(ratio) < 1.3
        else:
            assert in_band == 0.0 and statistics.mean(ratio) > 10


@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_on_a_smooth_plant_the_adaptive_law_is_the_fixed_one(sigma):
    """k3 ~ m^2 (a smooth policy, the law's design case), noiseless or with log-normal noise of sd
    0.5: no move overshoots after L cut it, so L never shrinks and both laws choose the same
    magnitudes, bit for bit."""
    fixed, _ = run_plant(controller(), p=2, want=0.3, steps=100, sigma=sigma)
    adaptive, _ = run_plant(controller(adapt=True), p=2, want=0.3, steps=100, sigma=sigma)
    assert fixed == adaptive


def test_the_adaptive_law_by_hand():
    """L: log 2 -> halved after each overshooting cut move -> grown 1.2x on a kept sign; a sign change
    after an uncut move keeps L; k3 exactly 0 counts as far below."""
    c, l2 = controller(adapt=True), math.log(2)
    assert c.magnitude(1) == 0.1
    c.observe(0.0)  # far below: up by L = log 2
    assert (c.magnitude(2), c.limit, c.clipped) == (pytest.approx(0.2, rel=1e-12), l2, True)
    c.observe(1.0)  # far above after a cut move: L halves, down by L
    m = 0.2 * math.exp(-l2 / 2)
    assert (c.magnitude(3), c.limit) == (pytest.approx(m, rel=1e-12), pytest.approx(l2 / 2, rel=1e-12))
    c.observe(1e-9)  # below again after a cut move: L halves again
    m *= math.exp(l2 / 4)
    assert (c.magnitude(4), c.limit) == (pytest.approx(m, rel=1e-12), pytest.approx(l2 / 4, rel=1e-12))
    c.observe(0.9e-3)  # still below: L grows 1.2x; the move 0.25 log(1 / 0.9) is below L, uncut
    m *= math.exp(0.25 * math.log(1 / 0.9))
    assert (c.magnitude(5), c.limit, c.clipped) == (pytest.approx(m, rel=1e-12), pytest.approx(1.2 * l2 / 4, rel=1e-12), False)
    c.observe(1.2e-3)  # above, but the last move was uncut: L stays
    m *= math.exp(0.25 * math.log(1 / 1.2))
    assert (c.magnitude(6), c.limit) == (pytest.approx(m, rel=1e-12), pytest.approx(1.2 * l2 / 4, rel=1e-12))
    for _ in range(30):  # k3 0 for many steps: L back at log 2 and no higher
        c.observe(0.0)
    assert c.limit == l2


def test_the_adaptive_law_never_goes_below_its_floor():
    c = controller(adapt=True)
    for step in range(1, 40):  # far above, far below, ...: every move cut, every sign flipped
        c.magnitude(step)
        c.observe(1.0 if step % 2 else 1e-9)
    assert c.limit == ADAPT_FLOOR


def test_the_adaptive_state_round_trips_and_the_law_cannot_change_on_resume():
    a = controller(adapt=True)
    run_plant(a, p=13, want=0.9, steps=7)
    b = controller(adapt=True)
    b.load_state_dict(a.state_dict())
    assert (b.current, b.step, b.limit, b.last_sign, b.clipped) == (a.current, a.step, a.limit, a.last_sign, a.clipped)
    assert run_plant(a, p=13, want=0.9, steps=20) == run_plant(b, p=13, want=0.9, steps=20)
    assert set(controller().state_dict()) == {"current", "step"}  # the fixed law's layout, as before target_adapt
    with pytest.raises(UsageError, match="ran the fixed-step law but mismatch.target_adapt=true"):
        controller(adapt=True).load_state_dict(controller().state_dict())
    with pytest.raises(UsageError, match="ran the adaptive law but mismatch.target_adapt=false"):
        controller().load_state_dict(a.state_dict())


# Computed with this branch's code before mismatch.target_adapt existed (commit cddb221): a config that
# does not set it keeps its hash.
HASHES_BEFORE = {
    ("demo", ()): ("67abb58d009a", "44dc1ae8f041"),
    ("surge", ()): ("3aea9cbdc3d2", "44dc1ae8f041"),
    ("surge", ("mismatch.injector=head_perturb", "mismatch.target_k3=1e-3", "mismatch.target_gain=0.2")):
        ("c55ac2037f75", "b245a824e5b0"),
}


@pytest.mark.parametrize("preset, sets", sorted(HASHES_BEFORE))
def test_a_config_without_target_adapt_hashes_as_before(preset, sets):
    for extra in ((), ("mismatch.target_adapt=false",)):
        cfg = resolve(preset=preset, overrides=[*sets, *extra])
        assert (cfg.hash(), cfg.hash("mismatch")) == HASHES_BEFORE[preset, sets]
    on = resolve(preset=preset, overrides=[*sets, "mismatch.target_adapt=true", "mismatch.injector=head_perturb",
                                           "mismatch.target_k3=1e-3"])
    assert on.hash("mismatch") != resolve(preset=preset, overrides=[*sets, "mismatch.injector=head_perturb",
                                                                    "mismatch.target_k3=1e-3"]).hash("mismatch")


def test_a_zero_magnitude_starts_from_the_default():
    assert controller(magnitude=0.0).magnitude(1) == 0.1


def test_the_target_follows_the_schedule():
    c = controller(target_k3=1e-3, target_k3_end=1e-2, schedule="geometric", start_step=3, ramp_steps=2)
    assert [c.target(s) for s in (1, 2)] == [None, None]
    assert [c.target(s) for s in (3, 4, 5, 9)] == pytest.approx([1e-3, 10 ** -2.5, 1e-2, 1e-2])
    assert c.magnitude(2) is None  # before start_step: exact
    c.observe(5.0)  # ignored before start_step
    assert c.magnitude(3) == 0.1


def test_59_22_an_unreachable_target_holds_the_magnitude_at_the_cap_and_says_so():
    """Issue 59, finding 22: a target the injector cannot reach doubled the magnitude every step (to
    about 1e38, then a non-finite rollout recorded as a divergence). Plant k3 = 1e-6 for every
    magnitude, target 1: from 0.1 the magnitude doubles to 51.2 at step 10, whose move is capped at
    MAX_MAGNITUDE = 100, where it stays; the note counts the 31 steps 10-40 held back by the cap."""
    from timlab.injectors.controller import MAX_MAGNITUDE

    assert MAX_MAGNITUDE == 100.0
    for adapt in (False, True):
        c = controller(target_k3=1.0, adapt=adapt)
        seen = []
        for step in range(1, 41):
            seen.append(c.magnitude(step))
            c.observe(1e-6)
        assert seen[:10] == pytest.approx([0.1 * 2 ** k for k in range(10)], rel=1e-12)
        assert seen[10:] == [100.0] * 30 and c.current == 100.0
        assert c.note() == ("target not reached: k3 stayed below mismatch.target_k3 with the magnitude at its cap 100 "
                            "on 31 steps from step 10")
        d = controller(target_k3=1.0, adapt=adapt)
        d.load_state_dict(c.state_dict())
        assert d.note() == c.note()
    reached = controller()  # a reachable target leaves no note, and its checkpoint keeps its layout
    reached.magnitude(1)
    reached.observe(1e-3)
    assert reached.note() == "" and "short" not in reached.state_dict()


def test_59_22_a_run_whose_target_is_out_of_reach_finishes_and_records_it(tmp_path):
    """In the trainer: logit_noise held at a target k3 of 1e6 from magnitude 60: step 2 rolls out at
    the cap (100, not 120), the run finishes (not diverged) and its status message says the target
    was not reached."""
    import json

    cfg = smoke(**{"run.steps": 3, "run.checkpoint_every": 3, "run.eval_every": 3, "mismatch.injector": "logit_noise",
                   "mismatch.target_k3": 1e6, "mismatch.magnitude": 60})
    train(cfg, tmp_path / "run")
    df = pd.read_parquet(tmp_path / "run" / "metrics.parquet").set_index("step")
    assert df.loc[[1, 2, 3], "mismatch/magnitude"].tolist() == [60.0, 100.0, 100.0]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "finished"
    assert status["message"] == ("target not reached: k3 stayed below mismatch.target_k3 with the magnitude at its cap "
                                 "100 on 3 steps from step 1")


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
    ({"mismatch.magnitude": 101}, r"must be a number in \[0, 100\] \(the controller's cap\), got 101"),
    ({"mismatch.target_k3": 0, "mismatch.target_adapt": "true"},
     r"mismatch.target_adapt=true adapts the k3 controller's step, but mismatch.target_k3 is 0 \(off\)"),
])
def test_bad_controller_settings_are_refused_before_the_run(tmp_path, sets, msg):
    base = {"mismatch.injector": "head_perturb", "mismatch.magnitude": 0.3, "mismatch.target_k3": 1e-3}
    with pytest.raises(UsageError, match=msg):
        train(smoke(**{**base, **sets}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_target_adapt_that_is_not_a_boolean_is_refused():
    with pytest.raises(ConfigError, match="mismatch.target_adapt: expected true or false, got 'maybe'"):
        smoke(**{"mismatch.target_adapt": "maybe"})


class _StopAt(BaseException):
    pass


FIXED = {"mismatch.magnitude": 0.02}
ADAPTIVE = {"mismatch.magnitude": 0.09, "mismatch.target_adapt": "true", "mismatch.target_max_change": 1.1}
"""Started near the target with a short cap, so the smoke batch's noise makes moves that L cuts and
that overshoot: L moves within 12 steps (from log 2 on this smooth plant it would not)."""


@pytest.mark.parametrize("law", [FIXED, ADAPTIVE], ids=["fixed", "adaptive"])
def test_trainer_tracks_the_target_and_resumes_bitwise(tmp_path, law):
    """head_perturb held at k3 = 2e-3 from step 3 on the smoke preset: steps 1-2 exact (guard on);
    the logged target, and the magnitude moved by the law from each step's realized k3 (recomputed
    here from the log; under mismatch.target_adapt by a fresh controller fed the logged k3, whose L
    is logged too); the fixed law brings the realized k3 within 2x of the target from a start over
    6x off; a run cut after step 11 and resumed equals the uninterrupted one bit for bit (the
    adaptive law's state included)."""
    cfg = smoke(**{"run.steps": 14, "run.checkpoint_every": 3, "mismatch.injector": "head_perturb",
                   "mismatch.target_k3": 2e-3, "mismatch.start_step": 3, **law})
    train(cfg, tmp_path / "ref")
    df = without_timings(pd.read_parquet(tmp_path / "ref" / "metrics.parquet")).set_index("step").loc[1:]
    assert (df.loc[[1, 2], "rollout_corr/k3_kl"] == 0).all() and (df.loc[[1, 2], "mismatch/frac_bitwise_equal"] == 1).all()
    assert df.loc[[1, 2], "mismatch/magnitude"].tolist() == [0.0, 0.0]
    assert df.loc[3:, "mismatch/target_k3"].tolist() == [2e-3] * 12
    m, k3 = df.loc[3:, "mismatch/magnitude"].to_numpy(), df.loc[3:, "rollout_corr/k3_kl"].to_numpy()
    assert m[0] == law["mismatch.magnitude"]
    if law is ADAPTIVE:  # the adaptive law replayed on the logged k3 gives the logged magnitudes and L
        c = controller(target_k3=2e-3, magnitude=0.09, max_change=1.1, adapt=True)
        for i in range(len(m)):
            assert c.magnitude(i + 1) == m[i]
            c.observe(float(k3[i]))
            assert df.loc[3 + i, "mismatch/target_step_limit"] == c.limit
        assert df.loc[3:, "mismatch/target_step_limit"].min() < math.log(1.1) / 2  # L did move, twice or more
        assert "| `mismatch/target_step_limit` |" in (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    else:
        assert "mismatch/target_step_limit" not in df.columns
        for i in range(len(m) - 1):  # each next magnitude is the law applied to this step's realized k3
            move = max(-math.log(2), min(math.log(2), 0.5 * (math.log(2e-3) - math.log(k3[i])) / 2))
            assert m[i + 1] == pytest.approx(m[i] * math.exp(move), rel=1e-12)
        assert abs(math.log(k3[0] / 2e-3)) > math.log(6)  # the first magnitude is far off the target
        assert abs(math.log(k3[-4:].mean() / 2e-3)) < math.log(2)  # and the controller brought it within 2x

    def stop(phase, step, total, row):
        if phase == "train" and step == 11:  # resumes from step 9, where the adaptive L is off its start
            raise _StopAt()

    with pytest.raises(_StopAt):
        train(cfg, tmp_path / "cut", progress=stop)
    train(cfg, tmp_path / "cut", resume=True)
    pd.testing.assert_frame_equal(without_timings(pd.read_parquet(tmp_path / "ref" / "metrics.parquet")),
                                  without_timings(pd.read_parquet(tmp_path / "cut" / "metrics.parquet")), check_exact=True)
    latest = lambda d: d / "checkpoints" / (d / "checkpoints" / "latest").read_text().strip()  # noqa: E731
    wa, wb = (load_file(str(latest(tmp_path / d) / "model.safetensors")) for d in ("ref", "cut"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
