"""Controlled training-inference mismatch, injected on the rollout side only.

The trainer always runs the exact forward; an injector changes what the ROLLOUT computes, so
the realized mismatch is known to come from the injector alone (the VeXact design: switch TIM
off exactly, then add a controlled amount back). Three kinds of parts compose with '+':

- model transforms (the rollout runs a different copy of the weights):
  ``precision`` (a bf16/fp16 cast of the trainer's weights, ``mismatch.dtype``),
  ``weight_rounding`` (weights rounded to bf16/fp16/int8 and computed in the trainer's dtype),
  ``head_perturb`` (output head W + magnitude * |W|/|R| * R with R a fixed Gaussian: a
  persistent, biased mismatch);
- an engine swap: ``engine`` (``mismatch.engine``: fast or hf kernels instead of exact);
- logits processors: ``logit_noise`` (fresh N(0, magnitude^2) per logit and token: random TIM),
  ``temperature`` (rollout logits / (1 + magnitude): biased TIM). Only these two honour the
  scope ``mismatch.prob_below`` (perturb only vocabulary entries whose unperturbed probability,
  i.e. the trainer's, is below the threshold).

Every run measures the realized mismatch (rollout_corr/*, mismatch/*), so a knob's effect is
measured, not assumed. Injector randomness comes from its own seeded generator (checkpointed).

Each part is one class in its own module of this package, behind the small protocol of
``timlab.injectors.base.Injector``; ``RolloutInjector`` composes them and never names one.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
from typing import Callable

import torch

from timlab.engines import Rollout, SamplingParams, build_engine
from timlab.errors import UsageError
from timlab.injectors.base import INJECTORS, Injector, Settings, register
from timlab.injectors.weight_rounding import round_weight
from timlab.model.llama import CausalLM

for _module in pkgutil.iter_modules(__path__):  # each module registers its injector class
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["INJECTORS", "Injector", "RolloutInjector", "Settings", "build_injector", "parse_parts", "register",
           "round_weight"]


def parse_parts(spec: str) -> list[str]:
    """'precision+logit_noise' -> ['precision', 'logit_noise'] (validated, 'none' dropped)."""
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    if not parts:
        raise UsageError("mismatch.injector is empty; use 'none' for zero mismatch")
    for p in parts:
        INJECTORS.get(p)  # raises with the valid choices
    if len(set(parts)) != len(parts):
        raise UsageError(f"mismatch.injector {spec!r} names a part twice")
    return [p for p in parts if p != "none"]


def _shallow_view(model: CausalLM) -> CausalLM:
    """A CausalLM sharing every module with ``model`` except the ones later replaced."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._parameters = dict(model._parameters)
    view._buffers = dict(model._buffers)
    view.hooks = []
    return view


class RolloutInjector:
    """Runs rollouts for the trainer with the configured mismatch applied: the parts of the spec
    (``parts``, in spec order), each an ``Injector``, acting in their ``order``."""

    def __init__(self, parts: list[str], model: CausalLM, settings: Settings, *, default_engine: str,
                 eos_token_id: int, pad_token_id: int):
        self.parts = parts
        self.s = settings
        self.model = model
        self.injectors: list[Injector] = sorted((INJECTORS.get(p)(settings) for p in parts), key=lambda i: i.order)
        self._check()
        self.generator = torch.Generator().manual_seed(1_000_003 * settings.seed + 7)
        self.rollout_model = self._build_model(model)
        engine_name = default_engine
        for inj in self.injectors:
            engine_name = inj.rollout_engine(engine_name)
        self.engine = build_engine(engine_name, self.rollout_model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        self.engine_name = engine_name

    @property
    def is_identity(self) -> bool:
        return not self.parts

    def _check(self) -> None:
        s = self.s
        if s.magnitude < 0:
            raise UsageError(f"mismatch.magnitude must be >= 0, got {s.magnitude}")
        if not 0.0 < s.prob_below <= 1.0:
            raise UsageError(f"mismatch.prob_below must be in (0, 1], got {s.prob_below}")
        if s.prob_below < 1.0 and not any(inj.scoped for inj in self.injectors):
            scoped = sorted(name for name in INJECTORS if INJECTORS.get(name) is not None and INJECTORS.get(name).scoped)
            raise UsageError(f"mismatch.prob_below scopes {' and '.join(scoped)} only; add one of them")
        for inj in self.injectors:
            inj.check()

    # -- the rollout model ----------------------------------------------------------------
    def _build_model(self, model: CausalLM) -> CausalLM:
        if not any(inj.copies_weights or inj.owns for inj in self.injectors):
            return model  # the rollout runs the trainer's own model
        m = copy.deepcopy(model) if any(inj.copies_weights for inj in self.injectors) else _shallow_view(model)
        for inj in self.injectors:
            m = inj.transform_model(m, model)
        m.hooks = []
        m.eval()
        self._sync(m)
        return m

    def _map_weight(self, w: torch.Tensor) -> torch.Tensor:
        for inj in self.injectors:
            w = inj.map_weight(w)
        return w

    @torch.no_grad()
    def _sync(self, m: CausalLM) -> None:
        src = dict(self.model.named_parameters())
        owned = {name for inj in self.injectors for name in inj.owns}
        for name, p in m.named_parameters():
            if name in owned or p is src[name]:
                continue
            p.copy_(self._map_weight(src[name]).to(p.dtype))
        for inj in self.injectors:
            inj.refresh(m, self.model, self._map_weight)

    def refresh(self) -> None:
        """The trainer's weights changed: bring the rollout side up to date."""
        if self.rollout_model is not self.model:
            self._sync(self.rollout_model)
        self.engine.sync_weights()

    # -- logits processors ----------------------------------------------------------------
    def _process(self, logits: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        clean = logits  # (B, V)
        out = logits
        for inj in self.injectors:
            if inj.processes_logits:
                out = inj.process_logits(out, col, self.generator)
        if self.s.prob_below < 1.0:
            p_clean = torch.softmax(clean, dim=-1)
            out = torch.where(p_clean < self.s.prob_below, out, clean)
        return out

    def rollout(self, prompts: list[list[int]], *, max_new_tokens: int, sampling: SamplingParams,
                generator: torch.Generator, observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                ) -> Rollout:
        """Sample with the mismatch applied. ``observe(logits, col)``, if given, sees the logits
        each decode step samples from (after the injector's processing): mu's full distribution."""
        proc = self._process if any(inj.processes_logits for inj in self.injectors) else None
        if observe is not None:
            inner = proc

            def proc(logits: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
                out = inner(logits, col) if inner is not None else logits
                observe(out, col)
                return out

        return self.engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                    generator=generator, logits_processor=proc)

    def state_dict(self) -> dict:
        state = {"generator": self.generator.get_state()}
        for inj in self.injectors:
            if inj.state_dict():
                state[inj.name] = inj.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state and "generator" in state:
            self.generator.set_state(state["generator"])
        for inj in self.injectors:
            if state and inj.name in state:
                inj.load_state_dict(state[inj.name])


def build_injector(section, model: CausalLM, *, default_engine: str = "exact", eos_token_id: int,
                   pad_token_id: int) -> RolloutInjector:
    """From a config ``mismatch`` section (or anything with the same attributes)."""
    parts = parse_parts(section.injector)
    settings = Settings(section.magnitude, section.dtype, section.engine, section.prob_below, section.seed)
    return RolloutInjector(parts, model, settings, default_engine=default_engine,
                           eos_token_id=eos_token_id, pad_token_id=pad_token_id)
