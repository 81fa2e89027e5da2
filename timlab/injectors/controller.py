"""Hold the realized mismatch at a target: a feedback controller of the injector's magnitude.

Every injector's realized k3 drifts when the magnitude is fixed: the policy sharpens, and a
perturbation of fixed relative size moves less probability mass (in the committed studies the
arms' k3 shrank 2.4-5.5x over 500 steps). Real stacks see k3 hold or grow instead. With
``mismatch.target_k3 > 0`` the magnitude becomes a controlled variable: after each step's
mismatch metrics are computed (on that step's batch, before the update), the controller moves
the magnitude of the NEXT step's rollout towards the target:

    log m_{t+1} = log m_t + gain * (log target_{t+1} - log k3_t) / 2,

the step in log m clamped to +-L. The 2 is the exponent of k3 in the magnitude for the
continuous parts (head_perturb, logit_noise, temperature) on a smooth policy: k3 ~ m^2 for a
small logit perturbation, so with ``gain`` 0.5 the log error halves each step and never changes
sign. A response k3 ~ m^p settles by a factor (1 - gain * p / 2) per step: monotone for p < 2 /
gain, oscillating but converging for p < 4 / gain, and diverging beyond, until the clamp holds
it. A sharp policy is such a plant: its k3 is a few near-deterministic tokens tipping over, and
on Study L1's shortest learned start k3 grows about as m^13 between magnitudes 0.8 and 1.6.
There the fixed law goes bang-bang: the magnitude alternates between two values a factor
``max_change`` apart, one far below the target and one far above, so the median k3 can sit on
the target while its mean is 100x it (docs/realistic.md, "Hold k3 where real runs have it").

Two laws, chosen by ``mismatch.target_adapt``:

- fixed step (the default, and the law of every committed run): L = log(``max_change``);
- adaptive step (``target_adapt``): Rprop's rule on the step limit. L starts at
  log(``max_change``); when the log error changes sign after a move that L cut short (that move
  overshot because L was too long), L is multiplied by ``ADAPT_SHRINK`` (down to ``ADAPT_FLOOR``);
  when the error keeps its sign, by ``ADAPT_GROW`` (up to log(``max_change``)). A sign change after
  an uncut move is the proportional law's own answer to noise or to p > 2 / gain and leaves L as
  it is, so on a smooth policy (p = 2), whose moves L rarely cuts, the law stays the fixed one
  (exactly so on a noiseless approach). On a steep plant every move is cut: the magnitude
  brackets the target, the bracket shrinks geometrically, and the steady state is a dither of
  +-``ADAPT_FLOOR`` in log m (a factor 1.02^p in k3: 1.3 at p = 13). A sustained drift keeps the
  sign, and L grows back 1.2x a step (from the floor to log 2 in 19 steps).

What neither law can do: hold each step's k3 near the target when a batch's k3 at a fixed
magnitude is itself spread over decades. On that L1 start it is: at one magnitude a batch
realizes ~1e-5 when no token tips and ~1e-2 when one does, and which happens depends on the
batch. The adaptive law then holds the magnitude steady (no bang-bang) where about half the
batches land above the target, which caps the spikes, but the per-step k3 stays bimodal, and its
median and mean over steps bracket the target rather than meet it.

A batch with k3 exactly 0 counts as far below the target (the clamp applies), under both laws.

The magnitude never exceeds ``MAX_MAGNITUDE``, where every continuous part has saturated. A target
still above k3 there cannot be reached: the magnitude stays at the cap, and the run, which goes on,
records it (``note``: "target not reached ... on N steps from step S" in its status message)
instead of overflowing to a non-finite magnitude that read as a divergence.

The target follows the mismatch schedule (``mismatch.schedule``, ``start_step``,
``ramp_steps``: constant, linear or geometric from ``target_k3`` to ``target_k3_end``), so a
mismatch can be held or grown as in real runs. Before ``start_step`` nothing acts (k3 exactly 0,
the zero-mismatch guard holds); ``mismatch.magnitude`` is the first step's magnitude, or
``START_MAGNITUDE`` when it is 0 (the clamp lets the magnitude double each step, so a target 100x
off is reached in about 7 steps).

Used by ``RolloutInjector`` (timlab.injectors): ``magnitude()`` in ``begin_step``,
``observe(k3)`` after the step's metrics (the trainer calls ``RolloutInjector.observe``). Its
state (the adaptive law's L and last sign included) is checkpointed with the injector, so a
resumed run continues bit for bit.
"""

from __future__ import annotations

import math

from timlab.errors import UsageError
from timlab.injectors.schedule import scheduled_magnitude

K3_EXPONENT = 2.0
"""The exponent of k3 in the magnitude the control law assumes (a small logit perturbation)."""
START_MAGNITUDE = 0.1
"""The first step's magnitude when mismatch.magnitude is 0 (a multiplicative law cannot leave 0)."""
ADAPT_SHRINK = 0.5
"""target_adapt: the factor on the step limit L when the log error changes sign (Rprop's eta-)."""
ADAPT_GROW = 1.2
"""target_adapt: the factor on L when the log error keeps its sign (Rprop's eta+)."""
ADAPT_FLOOR = math.log(1.02)
"""target_adapt: the smallest L, in log m (a 2% move; it bounds how fast a drift is caught up)."""
MAX_MAGNITUDE = 100.0
"""The largest magnitude the controller sets. Each continuous part saturates well below it (logit
noise of sd 100, a head that is 99% noise, a temperature of 101: sampling is near uniform), so a
target not reached there is not reached at all; without the cap an unreachable target doubled the
magnitude each step to about 1e38, and the overflow was recorded as a divergence."""


def check_target(*, target_k3: float, target_k3_end: float, target_gain: float, target_max_change: float,
                 magnitude: float, magnitude_end: float, schedule: str, kinds: list[str],
                 target_adapt: bool) -> None:
    """One-line UsageError for controller settings no run can use (``kinds``: the parts'
    ``magnitude_kind``)."""
    if not (math.isfinite(target_k3) and target_k3 >= 0):
        raise UsageError(f"mismatch.target_k3 must be a finite number >= 0 (0 = off), got {target_k3}")
    if target_k3 == 0:
        if target_k3_end:
            raise UsageError("mismatch.target_k3_end is set but mismatch.target_k3 is 0 (off); set mismatch.target_k3 > 0")
        if target_adapt:
            raise UsageError("mismatch.target_adapt=true adapts the k3 controller's step, but mismatch.target_k3 is 0 "
                             "(off); set mismatch.target_k3 > 0 or mismatch.target_adapt=false")
        return
    if "continuous" not in kinds:
        raise UsageError("mismatch.target_k3 controls a continuous magnitude: add one of head_perturb, kv_cache, logit_noise, "
                         "temperature to mismatch.injector (stale's lag is an integer)")
    if "integer" in kinds:
        raise UsageError("mismatch.target_k3 cannot control the integer lag of stale; remove stale from mismatch.injector")
    if not (math.isfinite(magnitude) and 0 <= magnitude <= MAX_MAGNITUDE):
        raise UsageError(f"mismatch.magnitude (the controller's first value; 0 = {START_MAGNITUDE}) must be a number "
                         f"in [0, {MAX_MAGNITUDE:g}] (the controller's cap), got {magnitude}")
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
                 magnitude: float, gain: float, max_change: float, adapt: bool):
        self.target_k3, self.target_k3_end = target_k3, target_k3_end
        self.schedule, self.start_step, self.ramp_steps = schedule, start_step, ramp_steps
        self.gain, self.max_change, self.adapt = gain, max_change, adapt
        self.current = float(magnitude) if magnitude > 0 else START_MAGNITUDE
        """The magnitude the next active step rolls out with."""
        self.step = 0
        """The step the last ``magnitude`` call was for."""
        self.limit = math.log(max_change)
        """L: the largest move of log m in one step (the adaptive law moves it)."""
        self.last_sign = 0
        """Adaptive law: the sign of the last nonzero log error (0 before the first)."""
        self.clipped = False
        """Adaptive law: whether the last move was cut to L."""
        self.short: tuple[int, int] | None = None
        """(first step, number of steps) at which k3 was below the target with the magnitude at
        ``MAX_MAGNITUDE``; None while the cap has not held it back."""

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
        cap = math.log(self.max_change)
        err = math.log(nxt) - math.log(k3) if k3 > 0 else cap * K3_EXPONENT / self.gain
        if self.adapt:
            self._adapt_limit(err)
        limit = self.limit if self.adapt else cap
        want = self.gain * err / K3_EXPONENT
        self.clipped = abs(want) >= limit
        self.current = min(MAX_MAGNITUDE, self.current * math.exp(max(-limit, min(limit, want))))
        if self.current >= MAX_MAGNITUDE and err > 0:  # at the cap and still below the target
            self.short = (self.short[0] if self.short else self.step, (self.short[1] if self.short else 0) + 1)

    def note(self) -> str:
        """"" when the target was reached at every step, else what the run's status says: the
        steps at which k3 stayed below the target with the magnitude at ``MAX_MAGNITUDE``."""
        if self.short is None:
            return ""
        first, n = self.short
        return (f"target not reached: k3 stayed below mismatch.target_k3 with the magnitude at its cap "
                f"{MAX_MAGNITUDE:g} on {n} step{'s' if n != 1 else ''} from step {first}")

    def _adapt_limit(self, err: float) -> None:
        """Rprop's rule on L, from the sign of this step's log error against the last one's."""
        sign = (err > 0) - (err < 0)
        if sign * self.last_sign < 0 and self.clipped:  # a move cut to L overshot: L is too long
            self.limit = max(min(ADAPT_FLOOR, math.log(self.max_change)), self.limit * ADAPT_SHRINK)
        elif sign * self.last_sign > 0:  # still on the same side: let L grow back
            self.limit = min(math.log(self.max_change), self.limit * ADAPT_GROW)
        if sign:
            self.last_sign = sign

    def metrics(self) -> dict:
        """The target of the current step (0 before start_step) and, under the adaptive law, the L
        that applied to the move made from this step's k3 (``observe`` runs first)."""
        t = self.target(self.step) if self.step else None
        out = {"mismatch/target_k3": 0.0 if t is None else float(t)}
        if self.adapt:
            out["mismatch/target_step_limit"] = float(self.limit)
        return out

    def state_dict(self) -> dict:
        state = {"current": self.current, "step": self.step}
        if self.adapt:  # the fixed law's checkpoints keep the layout they had before target_adapt
            state["adapt"] = {"limit": self.limit, "last_sign": self.last_sign, "clipped": self.clipped}
        if self.short is not None:  # (and before the cap: only a run the cap held back has it)
            state["short"] = list(self.short)
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.adapt != ("adapt" in state):
            now, then = ("adaptive", "fixed-step") if self.adapt else ("fixed-step", "adaptive")
            raise UsageError(f"--resume: the checkpoint's k3 controller ran the {then} law but "
                             f"mismatch.target_adapt={str(self.adapt).lower()} asks for the {now} one; "
                             "the law cannot change within a run, start a new run")
        self.current, self.step = float(state["current"]), int(state["step"])
        self.short = (int(state["short"][0]), int(state["short"][1])) if state.get("short") else None
        if self.adapt:
            a = state["adapt"]
            self.limit, self.last_sign, self.clipped = float(a["limit"]), int(a["last_sign"]), bool(a["clipped"])


__all__ = ["ADAPT_FLOOR", "ADAPT_GROW", "ADAPT_SHRINK", "K3Controller", "K3_EXPONENT", "MAX_MAGNITUDE", "START_MAGNITUDE",
           "check_target"]
