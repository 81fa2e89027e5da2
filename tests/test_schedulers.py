"""timlab.schedulers: Algorithm 1's exact LR sequence, the floor, resume, surge detection, chaining."""

from __future__ import annotations

import copy
import io
import math
import warnings

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import ChainedScheduler, LinearLR, SequentialLR

from timlab.registry import UnknownNameError
from timlab.schedulers import (
    SCHEDULERS,
    ConstantLR,
    CosineWithFloorLR,
    LengthDecayLR,
    SurgeDetector,
    build_scheduler,
)


def _opt(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _run(opt, sched, n, lengths=None):
    """The torch loop; returns the LR each of the n updates used."""
    used = []
    for i in range(n):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        if lengths is None:
            sched.step()
        else:
            sched.step(response_length=lengths[i])
    return used


def test_algorithm1_exact_sequence():
    opt = _opt(1.0)
    s = LengthDecayLR(opt, decay_period=3, min_lr_ratio=0.1)
    used = _run(opt, s, 12)
    assert used == [1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125, 0.125, 0.125, 0.1]


def test_algorithm1_unrolled_matches_loop():
    """The closed form equals the paper's loop: if t mod P == 0, eta = max(eta / 2, eta_inf)."""
    for P in range(1, 8):
        opt = _opt(3e-6)
        used = _run(opt, LengthDecayLR(opt, decay_period=P, min_lr_ratio=0.1), 40)
        eta, loop = 3e-6, []
        for t in range(1, 41):
            if t % P == 0:
                eta = max(eta / 2, 0.1 * 3e-6)
            loop.append(eta)
        assert used == pytest.approx(loop, rel=1e-12), P
        assert used == pytest.approx([max(3e-6 * 2.0 ** -(t // P), 3e-7) for t in range(1, 41)], rel=1e-12)


def test_floor_holds():
    opt = _opt(1.0)
    used = _run(opt, LengthDecayLR(opt, decay_period=1, min_lr_ratio=0.2), 8)
    assert used == [0.5, 0.25, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]
    opt = _opt(1.0)
    assert _run(opt, LengthDecayLR(opt, decay_period=1, min_lr_ratio=0.0), 3) == [0.5, 0.25, 0.125]


def test_without_signal_auto_mode_stays_constant():
    opt = _opt(0.5)
    s = LengthDecayLR(opt)  # decay_period=None, no response_length ever
    assert _run(opt, s, 50) == [0.5] * 50
    assert s.surge_step is None and s.decay_period is None


def _surge_curve(seed, jump_at=40, n=100, cv=0.1):
    g = np.random.default_rng(seed)
    base = np.where(np.arange(1, n + 1) < jump_at, 10.0, 35.0)
    return (base * (1 + cv * g.standard_normal(n))).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_auto_mode_fires_at_the_surge(seed):
    lengths = _surge_curve(seed)
    opt = _opt(1.0)
    s = LengthDecayLR(opt, surge_factor=1.8)
    used = _run(opt, s, 100, lengths)
    assert 40 <= s.surge_step <= 43
    assert s.decay_period == round(1.8 * s.surge_step)
    P = s.decay_period
    assert used[: s.surge_step] == [1.0] * s.surge_step  # nothing changes retroactively
    assert used == pytest.approx([max(2.0 ** -(t // P), 0.1) for t in range(1, 101)])


def test_auto_mode_clean_jump_fires_one_after_due_to_median():
    d = SurgeDetector()
    fired = [t for t, x in enumerate([10.0] * 39 + [35.0] * 10, start=1) if d.update(t, x)]
    assert fired == [41] and d.surge_step == 41
    assert not d.update(50, 1000.0)  # fires once


@pytest.mark.parametrize("seed", range(10))
def test_no_fire_on_noisy_flat_curve(seed):
    g = np.random.default_rng(100 + seed)
    lengths = (1000 * (1 + 0.1 * g.standard_normal(300))).tolist()
    opt = _opt()
    s = LengthDecayLR(opt)
    _run(opt, s, 300, lengths)
    assert s.surge_step is None and s.decay_period is None


def test_no_fire_on_slow_drift_or_single_spike():
    g = np.random.default_rng(7)
    drift = (10 + 0.3 * np.arange(300) + 0.5 * g.standard_normal(300)).tolist()  # 10 -> 100
    spike = [10.0] * 60
    spike[30] = 100.0  # one outlier batch
    for lengths in (drift, spike):
        opt = _opt()
        s = LengthDecayLR(opt)
        _run(opt, s, len(lengths), lengths)
        assert s.surge_step is None


def test_no_fire_before_min_history():
    d = SurgeDetector(min_history=10)
    fired = [t for t, x in enumerate([10.0] * 3 + [50.0] * 40, start=1) if d.update(t, x)]
    assert fired == [] and d.surge_step is None  # the jump lands in the warm-up
    d = SurgeDetector(min_history=3)  # obs 4 (median 10) is the first baseline value
    assert [t for t, x in enumerate([10.0] * 3 + [50.0] * 5, start=1) if d.update(t, x)] == [5]
    d = SurgeDetector()  # a start-up transient: short responses for 8 updates, then steady
    assert not any(d.update(t, x) for t, x in enumerate([300.0] * 8 + [1000.0] * 100, start=1))


def test_fixed_period_reports_surge_without_changing_it():
    opt = _opt(1.0)
    s = LengthDecayLR(opt, decay_period=500)
    used = _run(opt, s, 60, [10.0] * 39 + [35.0] * 21)
    assert s.surge_step == 41 and s.decay_period == 500
    assert used == [1.0] * 60


def _roundtrip(obj_state):
    buf = io.BytesIO()
    torch.save(obj_state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("resume_at", [20, 45])  # before and after the surge
def test_state_dict_roundtrip_continues_identically(resume_at):
    lengths = _surge_curve(3, n=120)
    opt = _opt(1.0)
    s = LengthDecayLR(opt)
    head = _run(opt, s, resume_at, lengths[:resume_at])
    ckpt = _roundtrip({"opt": opt.state_dict(), "sched": s.state_dict()})
    assert ckpt["sched"]["decay_period"] == s.decay_period
    assert ckpt["sched"]["surge_step"] == s.surge_step
    tail_a = _run(opt, s, 120 - resume_at, lengths[resume_at:])

    opt2 = _opt(1.0)
    s2 = LengthDecayLR(opt2)  # torch order: build both, then load both
    opt2.load_state_dict(ckpt["opt"])
    s2.load_state_dict(ckpt["sched"])
    assert isinstance(s2.detector, SurgeDetector)
    tail_b = _run(opt2, s2, 120 - resume_at, lengths[resume_at:])
    assert tail_a == tail_b
    assert (s2.surge_step, s2.decay_period) == (s.surge_step, s.decay_period)
    assert 40 <= s2.surge_step <= 43
    assert head == [1.0] * resume_at


def test_state_dict_is_plain_data():
    opt = _opt()
    s = LengthDecayLR(opt)
    _run(opt, s, 5, [10.0] * 5)
    state = s.state_dict()
    assert state["detector"] == {"num_seen": 5, "surge_step": None, "raw": [10.0] * 3, "smoothed": []}
    _run(opt, s, 15, [10.0] * 15)
    assert s.state_dict()["detector"]["smoothed"] == [10.0] * 10  # the window, warm-up excluded
    assert "optimizer" not in state
    copy.deepcopy(state)


def test_response_length_validation():
    opt = _opt()
    s = LengthDecayLR(opt)
    opt.step()
    with pytest.raises(ValueError, match="response_length"):
        s.step(response_length=float("nan"))
    s.step(response_length=torch.tensor(12.5))  # 0-d tensors are fine


def test_constructor_validation():
    with pytest.raises(ValueError, match="^decay_period"):
        LengthDecayLR(_opt(), decay_period=0)
    with pytest.raises(ValueError, match="^min_lr_ratio"):
        LengthDecayLR(_opt(), min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="^surge_factor"):
        LengthDecayLR(_opt(), surge_factor=0)
    with pytest.raises(ValueError, match="^surge_ratio"):
        LengthDecayLR(_opt(), surge_ratio=1.0)
    with pytest.raises(ValueError, match="^surge_window"):
        LengthDecayLR(_opt(), surge_window=0)
    with pytest.raises(ValueError, match="^warmup_steps"):
        CosineWithFloorLR(_opt(), total_steps=5, warmup_steps=5)
    with pytest.raises(ValueError, match="^total_steps"):
        CosineWithFloorLR(_opt(), total_steps=0)


def test_chained_with_warmup_multiplies():
    opt = _opt(1.0)
    warm = LinearLR(opt, start_factor=0.25, total_iters=3)  # .25, .5, .75, 1, ...
    s = ChainedScheduler([warm, LengthDecayLR(opt, decay_period=2)])  # 1, .5, .5, .25, ...
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        used = _run(opt, s, 8)
    assert used == pytest.approx([0.25, 0.25, 0.375, 0.25, 0.25, 0.125, 0.125, 0.1])


def test_sequential_after_warmup_restarts_count():
    opt = _opt(1.0)
    s = SequentialLR(
        opt,
        [LinearLR(opt, start_factor=0.25, total_iters=3), LengthDecayLR(opt, decay_period=2)],
        milestones=[3],
    )
    assert _run(opt, s, 8) == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.5, 0.5, 0.25, 0.25])


def test_cosine_with_floor_values():
    opt = _opt(1.0)
    s = CosineWithFloorLR(opt, total_steps=6, min_lr_ratio=0.1, warmup_steps=2)
    used = _run(opt, s, 9, [1.0] * 9)  # the signal is accepted and ignored
    cos = lambda p: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
    assert used == pytest.approx([1 / 3, 2 / 3, 1.0, cos(1 / 3), cos(2 / 3), 0.1, 0.1, 0.1, 0.1])
    assert used[3] == pytest.approx(0.775)
    opt = _opt(2.0)
    used = _run(opt, CosineWithFloorLR(opt, total_steps=3, min_lr_ratio=0.0), 4)
    assert used == pytest.approx([2.0, 1.0, 0.0, 0.0])


def test_constant_and_registry():
    opt = _opt(0.3)
    s = build_scheduler("constant", opt)
    assert isinstance(s, ConstantLR)
    assert _run(opt, s, 5, [1.0] * 5) == [0.3] * 5
    assert s.get_last_lr() == [0.3]
    assert SCHEDULERS.names() == ["constant", "cosine", "length_decay"]
    assert isinstance(build_scheduler("length_decay", _opt(), decay_period=4), LengthDecayLR)
    assert isinstance(build_scheduler("cosine", _opt(), total_steps=10), CosineWithFloorLR)
    with pytest.raises(UnknownNameError, match="valid choices: constant, cosine, length_decay"):
        build_scheduler("step", _opt())


def test_get_last_lr_and_param_groups():
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [p1], "lr": 1e-6}, {"params": [p2], "lr": 4e-6}])
    s = LengthDecayLR(opt, decay_period=2)
    opt.step()
    s.step()
    assert s.get_last_lr() == [0.5e-6, 2e-6]


def test_standalone_factor_schedule_follows_algorithm_1_without_warnings():
    import warnings

    s = LengthDecayLR.standalone(decay_period=2, min_lr_ratio=0.1)
    factors = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stepping without an optimizer step must not warn
        for _ in range(9):
            factors.append(s.get_last_lr()[0])
            s.step(response_length=10.0)
    assert factors == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.1, 0.1]


def test_every_schedule_builds_from_the_config_section():
    """Each registered schedule builds itself from a run's scheduler section; the trainer names none."""
    import dataclasses

    from timlab.config import SchedulerSection
    from timlab.schedulers import SCHEDULERS, scheduler_from_config

    for name in SCHEDULERS.names():
        s = scheduler_from_config(_opt(), SchedulerSection(name=name), total_steps=10)
        assert isinstance(s, SCHEDULERS.get(name))
    auto = scheduler_from_config(_opt(), SchedulerSection(name="length_decay"), total_steps=10)
    assert auto.decay_period is None  # decay_period 0 in a config: from the surge
    fixed = SchedulerSection(name="length_decay", decay_period=7, surge_window=4)
    s = scheduler_from_config(_opt(), fixed, total_steps=10)
    assert (s.decay_period, s.detector.window) == (7, 4)
    assert math.isnan(auto.metrics()["scheduler/surge_step"]) and s.metrics()["scheduler/decay_period"] == 7.0
    assert build_scheduler("constant", _opt()).metrics() == {}
    cos = scheduler_from_config(_opt(), dataclasses.replace(fixed, name="cosine", warmup_steps=2), total_steps=10)
    assert (cos.total_steps, cos.warmup_steps) == (10, 2)


def test_config_section_defaults_are_the_schedules_defaults():
    """SchedulerSection records the schedules' own defaults (so config.yaml shows every value a
    run used); they must not drift from the classes' signatures."""
    import inspect

    from timlab.config import SchedulerSection

    section = SchedulerSection()
    for cls in (LengthDecayLR, CosineWithFloorLR):
        for key, p in inspect.signature(cls.__init__).parameters.items():
            if hasattr(section, key) and p.default is not inspect.Parameter.empty:
                assert getattr(section, key) == (0 if p.default is None else p.default), (cls.__name__, key)


def test_train_says_when_length_decay_never_saw_a_surge(tmp_path, capsys):
    """Issue 60: on a task with no response-length surge the automatic length_decay schedule never
    changes the LR, and `timlab train` says so at the end of the run."""
    from timlab import cli
    from timlab.config import resolve

    argv = ["train", "--preset", "smoke", "--set", "run.steps=2", "--set", "run.eval_every=2", "--quiet"]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "a"), "--set", "scheduler.name=length_decay"]) == 0
    out = capsys.readouterr().out
    lr = resolve(preset="smoke").optim.lr
    assert f"note: scheduler length_decay never changed the LR ({lr:.4g}): no response-length surge was " \
           "detected in 2 steps (the mean length never grew 2x within 10 updates)" in out
    assert cli.main([*argv, "--run-dir", str(tmp_path / "b")]) == 0
    assert "note: scheduler" not in capsys.readouterr().out  # a constant LR is what was asked for
    fired = resolve(preset="smoke", overrides={"scheduler": {"name": "length_decay"}})
    assert cli._no_surge_note(fired, {"scheduler/surge_step": 12.0, "step": 40}) is None
    fixed = resolve(preset="smoke", overrides={"scheduler": {"name": "length_decay", "decay_period": 5}})
    assert cli._no_surge_note(fixed, {"scheduler/surge_step": float("nan"), "step": 40}) is None
