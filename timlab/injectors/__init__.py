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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from timlab.engines import Rollout, SamplingParams, build_engine
from timlab.errors import UsageError
from timlab.model.hf_io import parse_dtype
from timlab.model.llama import CausalLM
from timlab.registry import Registry

INJECTORS: Registry = Registry("injector")
INJECTORS.add("none", None)
for _name in ("precision", "engine", "logit_noise", "temperature", "head_perturb", "weight_rounding"):
    INJECTORS.add(_name, _name)

MODEL_PARTS = ("precision", "weight_rounding", "head_perturb")
LOGIT_PARTS = ("logit_noise", "temperature")
ROUNDING_DTYPES = ("bfloat16", "float16", "int8")
SWAP_ENGINES = ("fast", "hf", "vllm", "exact")
"""Engines the ``engine`` injector may roll out with (exact is allowed: a zero-mismatch swap)."""


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


def round_weight(w: torch.Tensor, dtype: str) -> torch.Tensor:
    """Round a tensor to bf16/fp16, or int8 with per-output-row symmetric scales; same dtype out."""
    if dtype == "int8":
        if w.dim() < 2:
            return w.clone()
        scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0  # (N, 1)
        return (torch.round(w / scale).clamp(-127, 127) * scale).to(w.dtype)
    return w.to(parse_dtype(dtype)).to(w.dtype)


def _shallow_view(model: CausalLM) -> CausalLM:
    """A CausalLM sharing every module with ``model`` except the ones later replaced."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._parameters = dict(model._parameters)
    view._buffers = dict(model._buffers)
    view.hooks = []
    return view


@dataclass
class _Settings:
    magnitude: float
    dtype: str
    engine: str
    prob_below: float
    seed: int


class RolloutInjector:
    """Runs rollouts for the trainer with the configured mismatch applied."""

    def __init__(self, parts: list[str], model: CausalLM, settings: _Settings, *, default_engine: str,
                 eos_token_id: int, pad_token_id: int):
        self.parts = parts
        self.s = settings
        self.model = model
        self._check()
        self.generator = torch.Generator().manual_seed(1_000_003 * settings.seed + 7)
        self._head_noise: torch.Tensor | None = None
        if "head_perturb" in parts:
            W = model.lm_head.weight
            R = torch.randn(W.shape, generator=torch.Generator().manual_seed(settings.seed + 99), dtype=torch.float32)
            self._head_noise = R.to(W.device)  # (V, d), fixed for the whole run
        self.rollout_model = self._build_model(model)
        engine_name = settings.engine if "engine" in parts else default_engine
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
        if s.prob_below < 1.0 and not any(p in LOGIT_PARTS for p in self.parts):
            raise UsageError("mismatch.prob_below scopes logit_noise and temperature only; add one of them")
        if "precision" in self.parts and s.dtype not in ("bfloat16", "float16", "float32"):
            raise UsageError(f"mismatch.dtype {s.dtype!r} for precision; valid choices: bfloat16, float16, float32")
        if "weight_rounding" in self.parts and s.dtype not in ROUNDING_DTYPES:
            raise UsageError(f"mismatch.dtype {s.dtype!r} for weight_rounding; valid choices: {', '.join(ROUNDING_DTYPES)}")
        if "engine" in self.parts and s.engine not in SWAP_ENGINES:
            raise UsageError(f"mismatch.engine {s.engine!r}; valid choices: {', '.join(SWAP_ENGINES)}")

    # -- the rollout model ----------------------------------------------------------------
    def _build_model(self, model: CausalLM) -> CausalLM:
        if not any(p in MODEL_PARTS for p in self.parts):
            return model
        m = copy.deepcopy(model) if any(p in ("precision", "weight_rounding") for p in self.parts) else _shallow_view(model)
        if "head_perturb" in self.parts:
            W = model.lm_head.weight
            head = nn.Linear(W.shape[1], W.shape[0], bias=False, device=W.device, dtype=W.dtype)
            head.requires_grad_(False)
            m.lm_head = head
        if "precision" in self.parts:
            m = m.to(parse_dtype(self.s.dtype))
        m.hooks = []
        m.eval()
        self._sync(m)
        return m

    @torch.no_grad()
    def _sync(self, m: CausalLM) -> None:
        src = dict(self.model.named_parameters())
        for name, p in m.named_parameters():
            if name == "lm_head.weight" and "head_perturb" in self.parts:
                continue
            if p is src[name]:
                continue
            w = src[name]
            if "weight_rounding" in self.parts:
                w = round_weight(w, self.s.dtype)
            p.copy_(w.to(p.dtype))
        if "head_perturb" in self.parts:
            W = self.model.lm_head.weight.float()
            if "weight_rounding" in self.parts:
                W = round_weight(W, self.s.dtype)
            R = self._head_noise
            delta = self.s.magnitude * (W.norm() / R.norm()) * R
            m.lm_head.weight.copy_((W + delta).to(m.lm_head.weight.dtype))

    def refresh(self) -> None:
        """The trainer's weights changed: bring the rollout side up to date."""
        if self.rollout_model is not self.model:
            self._sync(self.rollout_model)
        self.engine.sync_weights()

    # -- logits processors ----------------------------------------------------------------
    def _process(self, logits: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        clean = logits
        out = logits
        if "temperature" in self.parts:
            out = out / (1.0 + self.s.magnitude)
        if "logit_noise" in self.parts and self.s.magnitude > 0:
            noise = torch.randn(out.shape, generator=self.generator, dtype=torch.float32)
            out = out + self.s.magnitude * noise.to(out.device)
        if self.s.prob_below < 1.0:
            p_clean = torch.softmax(clean, dim=-1)
            out = torch.where(p_clean < self.s.prob_below, out, clean)
        return out

    def rollout(self, prompts: list[list[int]], *, max_new_tokens: int, sampling: SamplingParams,
                generator: torch.Generator, observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                ) -> Rollout:
        """Sample with the mismatch applied. ``observe(logits, col)``, if given, sees the logits
        each decode step samples from (after the injector's processing): mu's full distribution."""
        proc = self._process if any(p in LOGIT_PARTS for p in self.parts) else None
        if observe is not None:
            inner = proc

            def proc(logits: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
                out = inner(logits, col) if inner is not None else logits
                observe(out, col)
                return out

        return self.engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                    generator=generator, logits_processor=proc)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if state and "generator" in state:
            self.generator.set_state(state["generator"])


def build_injector(section, model: CausalLM, *, default_engine: str = "exact", eos_token_id: int,
                   pad_token_id: int) -> RolloutInjector:
    """From a config ``mismatch`` section (or anything with the same attributes)."""
    parts = parse_parts(section.injector)
    settings = _Settings(section.magnitude, section.dtype, section.engine, section.prob_below, section.seed)
    return RolloutInjector(parts, model, settings, default_engine=default_engine,
                           eos_token_id=eos_token_id, pad_token_id=pad_token_id)
