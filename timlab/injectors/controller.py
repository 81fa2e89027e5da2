"""Hold the realized mismatch at a target: a feedback controller of the injector's magnitude.

Every injector's realized k3 drifts when the magnitude is fixed: the policy sharpens, and a
perturbation of fixed relative size moves less probability mass (in the committed studies the
arms' k3 shrank 2.4-5.5x over 500 steps). Real stacks see k3 hold or grow instead. With
``mismatch.target_k3 > 0`` the magnitude becomes a controlled variable: after each step's
mismatch metrics are computed (on that step's batch, before the update), the controller moves
the magnitude of the NEXT step's rollout towards the target:

    log m_{t+1} = log m_t + gain * (log target_{t+1} - log k3_t) / 2,

the step in log m clamped to +-log(``max_change``). The 2 is the exponent of k3 in the
magnitude for the continuous parts (head_perturb, logit_noise, temperature): k3 ~ m^2 for a small
logit perturbation, so with ``gain`` 0.5 the log error halves each step and never changes sign
(no oscillation) while that holds; a part whose k3 grows as m^p settles by a factor
(1 - gain * p / 2) per step, monotone for p < 4. A batch with k3 exactly 0 counts as far below
the target (the clamp applies).

The target follows the mismatch schedule (``mismatch.schedule``, ``start_step``,
``ramp_steps``: constant, linear or geometric from ``target_k3`` to ``target_k3_end``), so a
mismatch can be held or grown as in real runs. Before ``start_step`` nothing acts (k3 exactly 0,
the zero-mismatch guard holds); ``mismatch.magnitude`` is the first step's magnitude, or
``START_MAGNITUDE`` when it is 0 (the clamp lets the magnitude double each step, so a target 100x
off is reached in about 7 steps).

Used by ``RolloutInjector`` (timlab.injectors): ``magnitude()`` in ``begin_step``,
``observe(k3)`` after the step's metrics (the trainer calls ``RolloutInjector.observe``). Its
state is checkpointed with the injector, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import math

from timlab.errors import UsageError
from timlab.injectors.schedule import scheduled_magnitude

K3_EXPONENT = 2.0
"""The exponent of k3 in the magnitude the control law assumes (a small logit perturbation)."""
START_MAGNITUDE = 0.1
"""The first step's magnitude when mismatch.magnitude is 0 (a multiplicative law cannot leave 0)."""


def check_target(*, target_k3: float, target_k3_end: float, target_gain: float, target_max_change: float,
                 magnitude: float, magnitude_end: float, schedule: str, kinds: list[str]) -> None:
    """One-line UsageError for controller settings no run can use (``kinds``: the parts'
    ``magnitude_kind``)."""
    if not (math.isfinite(target_k3) and target_k3 >= 0):
        raise UsageError(f"mismatch.target_k3 must be a finite number >= 0 (0 = off), got {target_k3}")
    if target_k3 == 0:
        if target_k3_end:
            raise UsageError("mismatch.target_k3_end is set but mismatch.target_k3 is 0 (off); set mismatch.target_k3 > 0")
        return
    if "continuous" not in kinds:
        raise UsageError("mismatch.target_k3 controls a continuous magnitude: add one of head_perturb, logit_noise, "
                         "temperature to mismatch.injector (stale's lag is an integer)")
    if "integer" in kinds:
        raise UsageError("mismatch.target_k3 cannot control the integer lag of stale; remove stale from mismatch.injector")
    if not (math.isfinite(magnitude) and magnitude >= 0):
        raise UsageError(f"mismatch.magnitude (the controller's first value; 0 = {START_MAGNITUDE}) must be a finite "
                         f"number >= 0, got {magnitude}")
    if magnitude_end:
        raise UsageError("mismatch.magnitude_end is set with mismatch.target_k3: the schedule moves the target, "
                         "so set mismatch.target_k3_end instead")
    if schedule != "constant" and not (math.isfinite(target_k3_end) and target_k3_end > 0):
        raise UsageError(f"mismatch.schedule={schedule} with mismatch.target_k3 needs mismatch.target_k3_end > 0, "
                         f"got {target_k3_end}")
    if not (0 < target_gain <= 1):
        raise UsageError(f"mismatch.target_gain must be in (0, 1], got {target_gain}")
    if not (math.isfinite(target_max_change) and target_max_change > 1):
        raise UsageError(f"mismatch.target_max_change must be a finite number > 1, got {target_max_change}")


class K3Controller:
    """The magnitude of each step's rollout, from the k3 the previous steps realized (module doc)."""

    def __init__(self, *, target_k3: float, target_k3_end: float, schedule: str, start_step: int, ramp_steps: int,
                 magnitude: float, gain: float, max_change: float):
        self.target_k3, self.target_k3_end = target_k3, target_k3_end
        self.schedule, self.start_step, self.ramp_steps = schedule, start_step, ramp_steps
        self.gain, self.max_change = gain, max_change
        self.current = float(magnitude) if magnitude > 0 else START_MAGNITUDE
        """The magnitude the next active step rolls out with."""
        self.step = 0
        """The step the last ``magnitude`` call was for."""

    def target(self, step: int) -> float | None:
        """The target k3 of training step ``step`` (from 1); None before start_step."""
        return scheduled_magnitude(step, schedule=self.schedule, magnitude=self.target_k3,
                                   magnitude_end=self.target_k3_end or self.target_k3,
                                   start_step=self.start_step, ramp_steps=self.ramp_steps)

    def magnitude(self, step: int) -> float | None:
        """The magnitude of step ``step``'s rollout; None before start_step (roll out exactly)."""
        self.step = step
        return None if self.target(step) is None else self.current

    def observe(self, k3: float) -> None:
        """The realized k3 of the current step's batch: set the next step's magnitude."""
        nxt = self.target(self.step + 1)
        if nxt is None or self.target(self.step) is None:
            return
        limit = math.log(self.max_change)
        err = math.log(nxt) - math.log(k3) if k3 > 0 else limit * K3_EXPONENT / self.gain
        move = max(-limit, min(limit, self.gain * err / K3_EXPONENT))
        self.current = self.current * math.exp(move)

    def metrics(self) -> dict:
        """The target of the current step (0 before start_step)."""
        t = self.target(self.step) if self.step else None
        return {"mismatch/target_k3": 0.0 if t is None else float(t)}

    def state_dict(self) -> dict:
        return {"current": self.current, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.current, self.step = float(state["current"]), int(state["step"])


__all__ = ["K3Controller", "K3_EXPONENT", "START_MAGNITUDE", "check_target"]
