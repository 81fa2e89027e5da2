"""The length-decay LR scheduler (Beyond-Precision, Algorithm 1) and its response-length surge detector.

Algorithm 1: start at eta_0; for update t = 1..T, if t mod P == 0 then eta_t = max(eta_{t-1} / 2,
eta_inf); update with eta_t. Unrolled, the LR used for update t is

    lr(t) = max(eta_0 * 2 ** -(t // P), min_lr_ratio * eta_0)

so update P is the first one at eta_0 / 2 (e.g. P = 3: 1, 1, .5, .5, .5, .25, ...).

The paper picks P by hand: watch the mean response length; at the "surge" (mean length roughly
triples within a few steps) at step s, set P ~= 1.8 s. Departures from the paper:
- ``decay_period=None`` automates that choice with ``SurgeDetector`` (definition and defaults in
  its docstring); when it fires at update s, P = max(1, round(surge_factor * s)) (round half up).
  Since P > s for surge_factor >= 1 + 1/s, every past update keeps lr(t) = eta_0 and the formula
  simply applies from then on.
- With a fixed ``decay_period`` the detector still runs on the signal, so ``surge_step`` reports
  where the automatic rule would have fired (it never changes P then).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from torch.optim import Optimizer

from timlab.errors import UsageError
from timlab.schedulers.base import SCHEDULERS, FactorLR, _check_ratio

METRIC_KEYS = ("train/lr", "scheduler/lr_factor", "scheduler/response_length", "scheduler/surge_step",
               "scheduler/decay_period")
"""What the length-decay schedule reports, under the names the trainer and the plug-ins share
(docs/metrics.md): the LR an update ran with, the factor on the base LR, the response length
fed in, the detected surge step and the period (NaN until known)."""


def _nan_if_none(x: int | None) -> float:
    return float("nan") if x is None else float(x)


class SurgeDetector:
    """Online detector of the response-length surge.

    Feed one mean response length per update (``update(step, length)``). Let
    s_n = median of the last ``smoothing`` lengths (fewer while n < smoothing). The first
    ``min_history`` observations only warm the detector up: they never fire and never enter the
    baseline. Afterwards the detector fires at the first observation n with

        s_n >= ratio * baseline_n,   baseline_n = min(s_k : max(n - window, min_history + 1) <= k < n) > 0

    (so the earliest possible firing is n = min_history + 2) and then stays fired;
    ``surge_step`` is the ``step`` passed with that observation.

    Defaults and why:
    - ``ratio=2.0``: the paper's surge roughly triples the mean length within a few steps
      (Qwen3-4B/8B: ~1000 -> 3000-4000 around step 90-110); firing at 2x catches it on the way up,
      while batch-mean noise (a few % with 1024 responses per batch) and ordinary drift are far
      from doubling.
    - ``window=10`` updates: "within a few steps" -- a rise has to happen inside 10 updates to
      count, so a slow drift (doubling over >> 10 updates) never fires.
    - ``smoothing=3``: a median of 3 ignores a single outlier batch; it delays firing on a clean
      jump by one update (fires at jump + 1).
    - ``min_history=10``: the first 10 updates are ignored, so a start-up transient (lengths
      moving fast while the model learns the format) cannot fire it or serve as a low baseline;
      the paper's surges come ~100 updates in. Raise it if the transient lasts longer.
    """

    def __init__(self, ratio: float = 2.0, window: int = 10, smoothing: int = 3, min_history: int = 10):
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 1.0):
            raise UsageError(f"surge_ratio must be a finite number > 1, got {ratio!r}")
        for name, v in (("surge_window", window), ("surge_smoothing", smoothing)):
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(min_history, int) or min_history < 1:
            raise UsageError(f"surge_min_history must be an int >= 1, got {min_history!r}")
        self.ratio = float(ratio)
        self.window = window
        self.smoothing = smoothing
        self.min_history = min_history
        self.num_seen = 0
        self.surge_step: int | None = None
        self._raw: deque[float] = deque(maxlen=smoothing)
        self._smoothed: deque[float] = deque(maxlen=window)

    @property
    def fired(self) -> bool:
        return self.surge_step is not None

    def update(self, step: int, length: float) -> bool:
        """Record the mean response length of update ``step``; True exactly when it fires now."""
        length = float(length)
        if not (math.isfinite(length) and length >= 0.0):
            raise UsageError(f"response_length must be a finite number >= 0, got {length!r}")
        self._raw.append(length)
        smoothed = statistics.median(self._raw)
        self.num_seen += 1
        if self.num_seen <= self.min_history:  # warm-up: neither fires nor sets the baseline
            return False
        fire = False
        if not self.fired and self._smoothed:
            baseline = min(self._smoothed)
            if baseline > 0.0 and smoothed >= self.ratio * baseline:
                self.surge_step = int(step)
                fire = True
        self._smoothed.append(smoothed)
        return fire

    def state_dict(self) -> dict:
        return {
            "num_seen": self.num_seen,
            "surge_step": self.surge_step,
            "raw": list(self._raw),
            "smoothed": list(self._smoothed),
        }

    def load_state_dict(self, state: dict) -> None:
        self.num_seen = int(state["num_seen"])
        self.surge_step = state["surge_step"]
        self._raw = deque(state["raw"], maxlen=self.smoothing)
        self._smoothed = deque(state["smoothed"], maxlen=self.window)


@SCHEDULERS.register("length_decay")
class LengthDecayLR(FactorLR):
    """Beyond-Precision Algorithm 1: halve the LR every ``decay_period`` updates, floor at
    ``min_lr_ratio`` x the initial LR; ``decay_period=None`` picks it from the response-length
    surge (``SurgeDetector``; P = round(surge_factor * surge_step)).

    Call ``step(response_length=<mean response length of the update just taken>)`` after each
    ``optimizer.step()``; ``step()`` without it is a step with no signal (chaining works).
    ``surge_step`` / ``decay_period`` are None until known and are saved in ``state_dict``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        decay_period: int | None = None,
        min_lr_ratio: float = 0.1,
        surge_factor: float = 1.8,
        surge_ratio: float = 2.0,
        surge_window: int = 10,
        surge_smoothing: int = 3,
        surge_min_history: int = 10,
        last_epoch: int = -1,
    ):
        if decay_period is not None and (not isinstance(decay_period, int) or decay_period < 1):
            raise UsageError(f"decay_period must be an int >= 1 or None, got {decay_period!r}")
        _check_ratio("min_lr_ratio", min_lr_ratio)
        if not (isinstance(surge_factor, (int, float)) and math.isfinite(surge_factor) and surge_factor > 0):
            raise UsageError(f"surge_factor must be a finite number > 0, got {surge_factor!r}")
        self.decay_period = decay_period
        self.auto = decay_period is None
        self.min_lr_ratio = float(min_lr_ratio)
        self.surge_factor = float(surge_factor)
        self.detector = SurgeDetector(surge_ratio, surge_window, surge_smoothing, surge_min_history)
        super().__init__(optimizer, last_epoch)

    @classmethod
    def config_kwargs(cls, section, *, total_steps: int) -> dict:
        kwargs = super().config_kwargs(section, total_steps=total_steps)
        kwargs["decay_period"] = kwargs["decay_period"] or None  # 0 in a config: automatic
        return kwargs

    @property
    def surge_step(self) -> int | None:
        return self.detector.surge_step

    def metrics(self) -> dict[str, float]:
        """``scheduler/surge_step`` and ``scheduler/decay_period``, NaN until known."""
        return {"scheduler/surge_step": _nan_if_none(self.surge_step),
                "scheduler/decay_period": _nan_if_none(self.decay_period)}

    def lr_factor(self, t: int) -> float:
        if self.decay_period is None:
            return 1.0
        return max(2.0 ** -(t // self.decay_period), self.min_lr_ratio)

    def step(self, epoch: int | None = None, *, response_length: float | None = None) -> None:
        """Advance one update; ``response_length`` is the mean length of the update just taken."""
        if response_length is not None:
            t = self.last_epoch + 1  # the update whose batch produced this length
            if self.detector.update(t, float(response_length)) and self.auto:
                self.decay_period = max(1, math.floor(self.surge_factor * t + 0.5))
        super().step(epoch)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["detector"] = self.detector.state_dict()
        state["surge_step"] = self.surge_step  # informational copy; the detector's is loaded
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        self.detector.load_state_dict(state.pop("detector"))
        state.pop("surge_step", None)
        super().load_state_dict(state)


class LengthDecayView:
    """``surge_step`` / ``decay_period`` of an object that runs a ``LengthDecayLR`` as
    ``self.schedule`` (the TRL callback and the verl hook): None until known."""

    schedule: LengthDecayLR

    @property
    def surge_step(self) -> int | None:
        return self.schedule.surge_step

    @property
    def decay_period(self) -> int | None:
        return self.schedule.decay_period
