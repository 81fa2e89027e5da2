"""Mismatch schedules: the injected magnitude as a function of the training step.

A dose can be switched on late and grown, so a mismatch can act on a policy that has already
learned and can rise during training (as real stacks' k3 does late in long runs), instead of
the fixed relative error a constant knob gives. Four settings of the ``mismatch`` section:

- ``start_step``: steps before it roll out exactly (the rollout is the trainer's own model on
  the rollout engine, no part of the injector acts: k3 exactly 0, and with the exact engine the
  zero-mismatch guard holds); 0 or 1 = from the first step;
- ``schedule`` (one of ``SCHEDULES``): how the magnitude moves from ``magnitude`` (at
  ``start_step``) to ``magnitude_end`` (``ramp_steps`` steps later, held after that):
  ``constant`` (always ``magnitude``; the end and ramp are ignored), ``linear``, ``geometric``
  (log-linear; both ends > 0).

Used by ``RolloutInjector.begin_step`` (timlab.injectors), which sets the magnitude every part
reads for the step's rollout. A schedule moves the magnitude of the parts that take one
(``Injector.magnitude_kind``): continuous parts take the value as it is, integer parts (the
``stale`` lag) take it rounded half up. A pure function of the step, so resume needs no state.
"""

from __future__ import annotations

import math
from typing import Callable

from timlab.errors import UsageError
from timlab.registry import Registry

SCHEDULES: Registry[Callable[[float, float, float], float]] = Registry("mismatch.schedule")
"""name -> f(start, end, frac) with frac in [0, 1] the fraction of the ramp done."""


@SCHEDULES.register("constant")
def constant(start: float, end: float, frac: float) -> float:
    return start


@SCHEDULES.register("linear")
def linear(start: float, end: float, frac: float) -> float:
    return start + (end - start) * frac


@SCHEDULES.register("geometric")
def geometric(start: float, end: float, frac: float) -> float:
    return start * (end / start) ** frac


def check_schedule(*, schedule: str, magnitude: float, magnitude_end: float, start_step: int, ramp_steps: int) -> None:
    """One-line UsageError for settings no schedule can use."""
    SCHEDULES.get(schedule)  # raises with the valid choices
    if start_step < 0:
        raise UsageError(f"mismatch.start_step must be >= 0, got {start_step}")
    if schedule == "constant":
        return
    if ramp_steps < 1:
        raise UsageError(f"mismatch.ramp_steps must be >= 1 for mismatch.schedule={schedule}, got {ramp_steps}")
    if not (math.isfinite(magnitude_end) and magnitude_end >= 0):
        raise UsageError(f"mismatch.magnitude_end must be a finite number >= 0, got {magnitude_end}")
    if schedule == "geometric" and not (magnitude > 0 and magnitude_end > 0):
        raise UsageError(f"mismatch.schedule=geometric needs mismatch.magnitude > 0 and mismatch.magnitude_end > 0, "
                         f"got {magnitude} and {magnitude_end}")


def scheduled_magnitude(step: int, *, schedule: str, magnitude: float, magnitude_end: float, start_step: int,
                        ramp_steps: int) -> float | None:
    """The magnitude of training step ``step`` (from 1); None before ``start_step`` (roll out exactly)."""
    first = max(start_step, 1)
    if step < first:
        return None
    frac = min((step - first) / ramp_steps, 1.0) if ramp_steps > 0 else 1.0
    return float(SCHEDULES.get(schedule)(magnitude, magnitude_end, frac))


def round_half_up(x: float) -> int:
    """How an integer magnitude (the ``stale`` lag) reads a scheduled value: 1.5 -> 2, 2.49 -> 2."""
    return math.floor(x + 0.5)
