"""The injector protocol and registry: one class per kind of controlled mismatch.

An injector changes what the ROLLOUT computes, never the trainer. It may act at four points,
each a method with a do-nothing default, so a class overrides only what it changes:

- ``check()``: refuse settings it cannot use (one-line ``UsageError``);
- the rollout model: ``copies_weights`` (the rollout needs its own copy of every weight),
  ``transform_model`` (change the copy's structure once), ``map_weight`` (the value a trainer
  weight takes on the rollout side) and ``refresh`` (weights it owns, after each update);
- ``rollout_engine``: the engine the rollout runs on;
- ``process_logits``: change the logits each decode step samples from (``scoped``: the scope
  ``mismatch.prob_below`` applies to it);
- ``trainer_logits``: the trainer's logits of the step being decoded, for a part that changed the
  rollout model but can keep them (``step_scoped``: the per-step scopes ``mismatch.entropy_*``,
  ``mismatch.position_*`` and ``mismatch.after_text`` / ``before_text`` apply to it; out of scope
  the step samples from these logits);
- across steps: ``begin_step`` (a training step is about to roll out; the lagged ``stale``
  keeps its ring of weight versions here) and ``source_model`` (the model whose weights the
  rollout side maps: the trainer's, or an older copy).

``magnitude_kind`` says what ``mismatch.magnitude`` is to a part (unused, a continuous size, an
integer); the mismatch schedule (``timlab.injectors.schedule``) moves it for the parts that take
one, and sets ``self.settings.magnitude`` before each step's rollout.

Parts composed with '+' act in the order of their ``order`` attribute, whatever the order of
the spec, so 'a+b' and 'b+a' are one injector. A new injector is one file in this package with
one class registered by ``@register("name")``; the package imports every module in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from timlab.errors import UsageError
from timlab.model.llama import CausalLM
from timlab.registry import Registry

INJECTORS: Registry = Registry("injector")
INJECTORS.add("none", None)  # zero mismatch: no part at all


@dataclass
class Settings:
    """The ``mismatch`` config section's knobs, shared by every part of one injector (their
    meaning is documented on ``timlab.config.MismatchSection``)."""

    magnitude: float
    dtype: str
    engine: str
    prob_below: float
    seed: int
    schedule: str
    magnitude_end: float
    start_step: int
    ramp_steps: int
    scale_granularity: str
    entropy_min: float = 0.0
    entropy_max: float = 0.0
    position_min: int = 0
    position_max: int = 0
    after_text: str = ""
    before_text: str = ""
    target_k3: float = 0.0
    target_k3_end: float = 0.0
    target_gain: float = 0.5
    target_max_change: float = 2.0
    target_adapt: bool = False
    redraw_every: int = 0

    @property
    def step_scope(self) -> bool:
        """True when a per-step scope is set (entropy, position or marker text): the mismatch acts at
        some decode steps only."""
        return bool(self.entropy_min > 0 or self.entropy_max > 0 or self.position_min > 0 or self.position_max > 0
                    or self.after_text or self.before_text)


MAGNITUDE_KINDS = ("none", "continuous", "integer")
"""none: the part ignores mismatch.magnitude; continuous: a size; integer: a count (a scheduled
value is rounded half up)."""

WeightMap = Callable[[torch.Tensor], torch.Tensor]


class Injector:
    """One part of a rollout injector. Subclasses set ``order`` and override what they change."""

    name: ClassVar[str] = ""
    order: ClassVar[int] = 0
    """Where the part acts among the composed ones (lower first)."""
    copies_weights: ClassVar[bool] = False
    """True when the rollout model needs its own copy of every weight (else it shares them)."""
    owns: ClassVar[tuple[str, ...]] = ()
    """Parameter names whose rollout value this part sets itself in ``refresh``."""
    processes_logits: ClassVar[bool] = False
    scoped: ClassVar[bool] = False
    """True when ``mismatch.prob_below`` limits this part's logits change."""
    step_scoped: ClassVar[bool] = False
    """True when the per-step scopes (``mismatch.entropy_min/max``, ``position_min/max``, ``after_text``,
    ``before_text``) confine this part: it changes the logits (a processor), or it keeps the
    trainer's (``trainer_logits``)."""
    magnitude_kind: ClassVar[str] = "none"
    """What ``mismatch.magnitude`` is to this part: one of MAGNITUDE_KINDS."""
    redraws: ClassVar[bool] = False
    """True when the part draws a random direction that ``mismatch.redraw_every`` can renew."""
    changes_model_code: ClassVar[bool] = False
    """True when the part changes what timlab's model code computes (not only weights), which
    engines that serve their own copy of the weights (hf, vllm) do not run."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def check(self) -> None:
        """Raise a one-line UsageError for settings this part cannot use."""

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        """Change the rollout model's structure once (``model``: the trainer's, read-only)."""
        return rollout_model

    def map_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The rollout-side value of a trainer weight ``w`` (before the cast to the rollout dtype)."""
        return w

    @torch.no_grad()
    def refresh(self, rollout_model: CausalLM, model: CausalLM, map_weight: WeightMap) -> None:
        """Set the weights named in ``owns`` from the trainer's (``map_weight``: every part's map)."""

    def rollout_engine(self, default: str) -> str:
        return default

    def begin_step(self, step: int, model: CausalLM) -> bool:
        """Training step ``step`` (from 1) is about to roll out; ``model`` is the trainer's, with
        the weights of ``step - 1`` updates. True when the rollout weights must be set again."""
        return False

    def source_model(self, model: CausalLM) -> CausalLM:
        """The model whose weights the rollout side maps (``model``: the trainer's)."""
        return model

    def process_logits(self, logits: torch.Tensor, col: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """(B, V) logits of one decode step -> the logits to sample from. ``generator``: the
        injector's own seeded generator, for any noise."""
        return logits

    def trainer_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The trainer's (B, V) logits of the decode step whose rollout logits are ``logits``: the same
        tensor, unless this part changed the rollout model and kept the trainer's (``step_scoped``)."""
        return logits

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def register(name: str):
    """Class decorator: ``@register("logit_noise")`` names the class and adds it to INJECTORS."""

    def deco(cls: type[Injector]) -> type[Injector]:
        INJECTORS.add(name, cls)
        cls.name = name
        return cls

    return deco


def check_dtype(part: str, dtype: str, valid: tuple[str, ...]) -> None:
    """Refuse a ``mismatch.dtype`` that the part ``part`` cannot use."""
    if dtype not in valid:
        raise UsageError(f"mismatch.dtype {dtype!r} for {part}; valid choices: {', '.join(valid)}")
