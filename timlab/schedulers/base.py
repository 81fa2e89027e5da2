"""Factor-based LR schedulers on the torch ``LRScheduler`` contract, and the ``SCHEDULERS`` registry.

Every timlab scheduler is ``lr(t) = base_lr * factor(t)`` where t (from 1) is the optimizer update
the LR is used for. Torch's base class steps once at construction (``last_epoch`` = 0), so during
update t ``last_epoch == t - 1`` and ``get_lr`` returns ``base_lr * factor(last_epoch + 1)``.

Usage is the torch loop; ``step`` takes an optional keyword-only signal that schedulers which do
not use it ignore, so a trainer can call every scheduler the same way::

    sched = build_scheduler("length_decay", opt, decay_period=None)
    for batch in batches:
        loss.backward(); opt.step()
        sched.step(response_length=mean_len)   # or sched.step()

Composition: ``get_lr`` is chainable (it rescales the current ``group["lr"]`` by
factor(t) / factor(t-1), like torch's StepLR/LinearLR), so ``ChainedScheduler`` with e.g. a
LinearLR warmup multiplies the two; when nobody else touched the LR it returns the closed form
``base_lr * factor(t)`` exactly. ``_get_closed_form_lr`` serves ``SequentialLR`` milestones.
Resume like torch: build optimizer and scheduler, then load both state dicts.
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from timlab.errors import UsageError
from timlab.registry import Registry

SCHEDULERS: Registry[type] = Registry("scheduler")

_EARLY_STEP_WARNING = "Detected call of `lr_scheduler.step\\(\\)` before"


class FactorLR(LRScheduler):
    """Base: subclasses define ``lr_factor(t)`` for update t >= 1 (a pure function of t and state)."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        self._last_factor = 1.0  # factor applied to the current group["lr"] (1 before the start)
        super().__init__(optimizer, last_epoch)

    def lr_factor(self, t: int) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        prev = self._last_factor
        new = self.lr_factor(self.last_epoch + 1)
        self._last_factor = new
        out = []
        for base, group in zip(self.base_lrs, self.optimizer.param_groups):
            lr = group["lr"]
            if prev == 0.0 or bool(lr == base * prev):  # untouched by others: exact closed form
                out.append(base * new)
            else:  # chained with another scheduler: rescale what is there
                out.append(lr * (new / prev))
        return out

    def _get_closed_form_lr(self) -> list[float]:
        self._last_factor = self.lr_factor(self.last_epoch + 1)
        return [base * self._last_factor for base in self.base_lrs]

    def step(self, epoch: int | None = None, *, response_length: float | None = None) -> None:
        """Advance one update. ``response_length`` (keyword-only) is ignored by this class.

        torch warns when a scheduler steps before its optimizer ever has. Here that is expected:
        an RL step whose groups were all rejected makes no optimizer update, and a
        ``standalone`` schedule has no real optimizer. So that one warning is silenced.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EARLY_STEP_WARNING)
            if epoch is None:
                super().step()
            else:  # deprecated torch path, still used by SequentialLR in older torch
                super().step(epoch)

    @classmethod
    def config_kwargs(cls, section, *, total_steps: int) -> dict:
        """The keyword arguments a run's scheduler section gives this schedule: the section's
        fields that ``__init__`` takes, and the run's length as ``total_steps`` where it is taken."""
        params = inspect.signature(cls.__init__).parameters
        kwargs = {k: getattr(section, k) for k in params if k not in ("self", "optimizer", "last_epoch")
                  and hasattr(section, k)}
        if "total_steps" in params:
            kwargs["total_steps"] = total_steps
        return kwargs

    @classmethod
    def from_config(cls, optimizer: Optimizer, section, *, total_steps: int) -> "FactorLR":
        """This schedule on ``optimizer``, built from a run's scheduler section (``config_kwargs``)."""
        return cls(optimizer, **cls.config_kwargs(section, total_steps=total_steps))

    def metrics(self) -> dict[str, float]:
        """What this schedule reports after a step, beside ``train/lr`` (none by default)."""
        return {}

    @classmethod
    def standalone(cls, **kwargs):
        """This schedule on a one-parameter shadow optimizer with LR 1, so ``get_last_lr()[0]``
        is the factor to apply to an LR that lives elsewhere (TRL's LambdaLR, verl's workers)."""
        shadow = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        return cls(shadow, **kwargs)


def _check_ratio(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise UsageError(f"{name} must be in [0, 1], got {value!r}")


@SCHEDULERS.register("constant")
class ConstantLR(FactorLR):
    """Flat LR: factor 1 for every update (timlab's; unlike torch's ConstantLR it never scales)."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        super().__init__(optimizer, last_epoch)

    def lr_factor(self, t: int) -> float:
        return 1.0


@SCHEDULERS.register("cosine")
class CosineWithFloorLR(FactorLR):
    """Linear warmup, then cosine from the peak down to ``min_lr_ratio`` x peak, then flat.

    factor(t) = t / (W + 1) for t <= W (W = warmup_steps); from update W + 1 (factor 1) the
    cosine 0.5 (1 + cos(pi p)), p = (t - 1 - W) / (total_steps - 1 - W), is mapped into
    [min_lr_ratio, 1]; for t >= total_steps the factor stays at min_lr_ratio.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 0,
        last_epoch: int = -1,
    ):
        if not isinstance(total_steps, int) or total_steps < 1:
            raise UsageError(f"total_steps must be an int >= 1, got {total_steps!r}")
        if not isinstance(warmup_steps, int) or not 0 <= warmup_steps < total_steps:
            raise UsageError(f"warmup_steps must be an int in [0, total_steps), got {warmup_steps!r}")
        _check_ratio("min_lr_ratio", min_lr_ratio)
        self.total_steps = total_steps
        self.min_lr_ratio = float(min_lr_ratio)
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def lr_factor(self, t: int) -> float:
        W = self.warmup_steps
        if t <= W:
            return t / (W + 1)
        p = min(1.0, (t - 1 - W) / max(1, self.total_steps - 1 - W))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
