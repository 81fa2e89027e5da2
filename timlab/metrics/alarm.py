"""Early-warning alarms on a logged indicator: the rule, and the watcher a trainer keeps.

One rule, two users: ``timlab.experiments.studies.early_warning`` measures each rule's lead time and false
alarms on the committed sweeps (docs/FINDINGS.md, "Early warning of a fall"), and the trainer's
optional alarm (``run.alarm``) runs the same ``alarm_statistic`` on a live run through
``AlarmWatch``. Pure Python (no torch, no numpy): a statistic has the same bits on every machine.

The rules read an indicator's values since the alarm was armed, oldest first, one per training
step. With m the mean of the last ``window`` values and p the mean of the ``baseline`` values
before those:

- ``level``: the statistic is m (direction ``up``) or -m (``down``); defined from ``window`` values.
- ``change``: the fold change (m + EPS) / (p + EPS) (``up``), its inverse (``down``) or the larger
  of the two (``either``); defined from ``window + baseline`` values. EPS keeps an indicator that is
  exactly 0 (k3 of an exact rollout) at a fold change of 1.

The alarm fires at the first step whose statistic exceeds the threshold. ``AlarmWatch`` skips a
step that updated nothing (``train/updated`` 0, or a gradient norm of exactly 0): such a step
neither enters the window nor fires, as the re-registered benchmark removes it before any window
(``timlab.experiments.studies.early_warning2``). The benchmark registered
the change rule as a log fold change; thresholding the fold change itself makes the same decisions
(log is monotone) and needs no ``log``, whose last bit depends on the C library.

``ALARMS`` names the registered rules (an indicator, a rule, a direction and the threshold measured
for it): the benchmark tests them, the trainer looks them up by name.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from timlab.errors import UsageError
from timlab.registry import Registry

RULES = ("level", "change")
"""The alarm rules (see the module docstring)."""
DIRECTIONS = ("up", "down", "either")
"""Which way an indicator is watched; ``either`` only for the change rule."""
WINDOW = 5
"""Values in the trailing mean m."""
BASELINE = 10
"""Values in the preceding mean p of the change rule."""
EPS = 1e-12
"""Added to both means of a fold change: 0 / 0 reads as 1 (no change)."""
EXPERIMENTAL = ("experimental: no alarm rule passed the re-registered early-warning benchmark "
                "(its measured catches and false alarms: docs/metrics.md)")
"""What every alarm says of itself, in the trainer's warning and in `timlab analyze --alarm`."""


def check_rule(rule: str, direction: str, *, window: int = WINDOW, baseline: int = BASELINE) -> None:
    """A one-line error for an unknown rule or direction, a level rule watched ``either`` way, or a
    window below 1."""
    if rule not in RULES:
        raise UsageError(f"alarm rule {rule!r} is unknown; valid choices: {', '.join(RULES)}")
    if direction not in DIRECTIONS:
        raise UsageError(f"alarm direction {direction!r} is unknown; valid choices: {', '.join(DIRECTIONS)}")
    if rule == "level" and direction == "either":
        raise UsageError("alarm direction 'either' needs the change rule; a level rule is watched up or down")
    if window < 1 or baseline < 1:
        raise UsageError(f"alarm window and baseline must be >= 1, got {window} and {baseline}")


def check_threshold(rule: str, direction: str, threshold: float) -> None:
    """A one-line error unless ``threshold`` is one the statistic can stay under: finite, and above
    the floor of ``rule`` (a fold change is never below 1 watched ``either`` way and 1 means no
    change, so a change rule needs more than 1; a level rule watched ``up`` reads a mean of a
    nonnegative indicator, so it needs more than 0). At or below the floor the alarm fires on every
    step it watches."""
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not math.isfinite(threshold):
        raise UsageError(f"alarm threshold must be a finite number, got {threshold!r}")
    floor = 1.0 if rule == "change" else 0.0 if direction == "up" else None
    if floor is not None and threshold <= floor:
        what = "a fold change (1 = no change)" if rule == "change" else "a mean of a nonnegative indicator"
        raise UsageError(f"alarm threshold {threshold:g} of a {rule} rule must be above {floor:g}: its statistic is "
                         f"{what}, so the alarm would fire on every step it watches")


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)  # correctly rounded: the same bits in any order, on any machine


def alarm_statistic(values: Sequence[float], *, rule: str, direction: str, window: int = WINDOW,
                    baseline: int = BASELINE) -> float:
    """The rule's statistic at the last of ``values`` (the indicator since the alarm was armed,
    oldest first); NaN while there are too few values (``window``, or ``window + baseline`` for the
    change rule). Only the last ``window + baseline`` values are read."""
    check_rule(rule, direction, window=window, baseline=baseline)
    return _statistic(values, len(values), rule, direction, window, baseline)


def _statistic(values: Sequence[float], n: int, rule: str, direction: str, window: int, baseline: int) -> float:
    """``alarm_statistic`` of ``values[:n]``, arguments already checked."""
    if rule == "level":
        if n < window:
            return math.nan
        m = _mean(values[n - window:n])
        return m if direction == "up" else -m
    if n < window + baseline:
        return math.nan
    m = _mean(values[n - window:n]) + EPS
    p = _mean(values[n - window - baseline:n - window]) + EPS
    if direction == "up":
        return m / p
    if direction == "down":
        return p / m
    return max(m / p, p / m)


def statistic_series(values: Sequence[float], *, rule: str, direction: str, window: int = WINDOW,
                     baseline: int = BASELINE) -> list[float]:
    """``alarm_statistic`` after each value of ``values`` (NaN where undefined): what a watcher armed
    before the first value would have seen at each step."""
    check_rule(rule, direction, window=window, baseline=baseline)
    values = [float(v) for v in values]
    return [_statistic(values, i + 1, rule, direction, window, baseline) for i in range(len(values))]


def first_alarm(statistics: Iterable[float], threshold: float) -> int | None:
    """The index of the first statistic above ``threshold`` (NaN never is), or None."""
    for i, s in enumerate(statistics):
        if s > threshold:
            return i
    return None


@dataclass(frozen=True)
class AlarmRule:
    """A registered alarm: which logged series it watches, how, and at what threshold."""

    indicator: str
    """The metric key it reads each step, e.g. ``train/grad_norm``."""
    rule: str
    """``level`` or ``change`` (module docstring)."""
    direction: str
    """``up``, ``down`` or ``either``."""
    threshold: float
    """Fires when the statistic exceeds this: the value at which at most 5% of the committed
    healthy runs of the benchmark's choosing half alarmed (a mean for a level rule, a fold change
    for a change rule). tests/test_early_warning.py recomputes it from sweeps/."""

    def __post_init__(self):
        check_rule(self.rule, self.direction)


ALARMS: Registry[AlarmRule] = Registry("alarm")
"""The rules the early-warning benchmark registered (docs/FINDINGS.md), by name."""

for _name, _rule in {
    "k3_level": AlarmRule("rollout_corr/k3_kl", "level", "up", 0.410589876554939),
    "log_ppl_abs_diff_level": AlarmRule("rollout_corr/log_ppl_abs_diff", "level", "up", 0.500168749147534),
    "grad_norm_level": AlarmRule("train/grad_norm", "level", "up", 16.267154693603516),
    "k3_change": AlarmRule("rollout_corr/k3_kl", "change", "up", 12.992658168563208),
    "log_ppl_abs_diff_change": AlarmRule("rollout_corr/log_ppl_abs_diff", "change", "up", 4.71020667950593),
    "response_length_change": AlarmRule("train/response_length_mean", "change", "up", 1.1608799363901268),
    "grad_norm_change": AlarmRule("train/grad_norm", "change", "either", 3.981324269121714),
    "entropy_change": AlarmRule("train/entropy", "change", "either", 2.3422043822167646),
    "reward_std_change": AlarmRule("train/reward_std", "change", "either", 2.7730306374275533),
    "k3_seq_level": AlarmRule("mismatch/k3_seq", "level", "up", 5.380783910084338),
    "k3_seq_change": AlarmRule("mismatch/k3_seq", "change", "up", 9.618232931789585),
}.items():
    ALARMS.add(_name, _rule)


class AlarmWatch:
    """An alarm on a live run: feed it the indicator once per step after it is armed.

    ``update(value, step=, grad_norm=, updated=)`` returns ``(statistic, above)``: the statistic
    after this value (NaN while too few) and whether it exceeds the threshold. A step that updated
    nothing (``updated`` false or ``grad_norm`` exactly 0) is neither added to the window nor able to
    fire. ``fired_step`` is the step of the first time it did
    (None before), so a caller warns once. Keeps the last ``window + baseline`` values;
    ``state_dict`` / ``load_state_dict`` carry them across a resume.
    """

    def __init__(self, *, rule: str, direction: str, threshold: float, window: int = WINDOW,
                 baseline: int = BASELINE):
        check_rule(rule, direction, window=window, baseline=baseline)
        check_threshold(rule, direction, threshold)
        self.rule, self.direction, self.threshold = rule, direction, float(threshold)
        self.window, self.baseline = window, baseline
        self.values: deque[float] = deque(maxlen=window + (baseline if rule == "change" else 0))
        self.fired_step: int | None = None

    def update(self, value: float, *, step: int, grad_norm: float | None = None, updated: bool = True
               ) -> tuple[float, bool]:
        """Add one step's value. Skipped (statistic NaN, not above, the window unchanged): a
        non-finite value, and a step that updated nothing (``updated`` false, or ``grad_norm``
        exactly 0: every reward of every group the same), as the re-registered benchmark removes
        them (docs/FINDINGS.md, "Early warning, re-registered")."""
        if not math.isfinite(value) or not updated or grad_norm == 0:
            return math.nan, False
        self.values.append(float(value))
        stat = _statistic(list(self.values), len(self.values), self.rule, self.direction, self.window, self.baseline)
        above = stat > self.threshold
        if above and self.fired_step is None:
            self.fired_step = int(step)
        return stat, above

    def state_dict(self) -> dict:
        return {"values": list(self.values), "fired_step": self.fired_step}

    def load_state_dict(self, state: dict) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in state["values"])
        self.fired_step = state["fired_step"]


__all__ = ["RULES", "DIRECTIONS", "WINDOW", "BASELINE", "EPS", "check_rule", "check_threshold", "alarm_statistic", "statistic_series",
           "first_alarm", "AlarmRule", "ALARMS", "AlarmWatch"]
