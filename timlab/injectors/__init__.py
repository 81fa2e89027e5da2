"""Controlled training-inference mismatch, injected on the rollout side only.

The trainer always runs the exact forward; an injector changes what the ROLLOUT computes, so
the realized mismatch is known to come from the injector alone (the VeXact design: switch TIM
off exactly, then add a controlled amount back). Three kinds of parts compose with '+':

- model transforms (the rollout runs a different copy of the weights):
  ``precision`` (a bf16/fp16 cast of the trainer's weights, ``mismatch.dtype``),
  ``weight_rounding`` (weights rounded to bf16/fp16/int8 and computed in the trainer's dtype),
  ``head_perturb`` (output head W + magnitude * |W|/|R| * R with R a fixed Gaussian: a
  persistent, biased mismatch), ``fp8`` (the decoder's linears in simulated FP8, e4m3 weights
  and activations), ``kv_cache`` (keys and values stored in ``mismatch.dtype``), ``stale`` (the
  weights of ``mismatch.magnitude`` training steps ago: asynchronous RL's lag);
- an engine swap: ``engine`` (``mismatch.engine``: fast or hf kernels instead of exact);
- logits processors: ``logit_noise`` (fresh N(0, magnitude^2) per logit and token: random TIM),
  ``temperature`` (rollout logits / (1 + magnitude): biased TIM). Only these two honour the
  vocabulary scope ``mismatch.prob_below`` (perturb only entries whose unperturbed probability,
  i.e. the trainer's, is below the threshold).

Three per-step scopes confine ``logit_noise``, ``temperature`` and ``head_perturb`` to some decode
steps (combined by AND); every other step samples from the trainer's logits, bit for bit:
``mismatch.entropy_min`` / ``entropy_max`` (steps whose unperturbed next-token entropy lies in
[min, max): the high-entropy "decision" tokens, or the near-deterministic rest),
``mismatch.position_min`` / ``position_max`` (response tokens at index [min, max), from 0) and
``mismatch.after_text`` / ``before_text`` (steps whose response so far does / does not yet contain
a marker token, e.g. scratch_add's ':' that opens the worked answer; the engines hand the
processor the tokens so far for it, ``timlab.engines.base.call_processor``). ``head_perturb``
keeps the trainer's logits of each step for this (its own module says how). ``timlab probe --injector``
measures what a scoped arm realizes in total, T * k3, and calibrates its magnitude to a target.

Every run measures the realized mismatch (rollout_corr/*, mismatch/*), so a knob's effect is
measured, not assumed. Injector randomness comes from its own seeded generator (checkpointed).

The magnitude can follow a schedule and the injector can start late (``mismatch.schedule``,
``start_step``, ``ramp_steps``, ``magnitude_end``; ``timlab.injectors.schedule``): the trainer
calls ``begin_step(step)`` before each rollout; before ``start_step`` the rollout is the
trainer's own model on the default engine (``off``), so k3 is exactly 0 and the guard holds.
Or the realized k3 can be held at a (scheduled) target, ``mismatch.target_k3``: a feedback
controller (``timlab.injectors.controller``) sets the magnitude, and the trainer reports each
step's k3 through ``observe``.

Each part is one class in its own module of this package, behind the small protocol of
``timlab.injectors.base.Injector``; ``RolloutInjector`` composes them and never names one.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import math
import pkgutil
from typing import Callable

import torch

from timlab.engines import ENGINES, Rollout, SamplingParams, build_engine
from timlab.engines.base import reads_tokens
from timlab.errors import UsageError
from timlab.injectors.base import INJECTORS, Injector, Settings, register
from timlab.injectors.controller import K3Controller, check_target
from timlab.injectors.schedule import check_schedule, scheduled_magnitude
from timlab.injectors.weight_rounding import round_weight
from timlab.model.llama import CausalLM

for _module in pkgutil.iter_modules(__path__):  # each module (but base, schedule, controller) registers its injector class
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["INJECTORS", "Injector", "RolloutInjector", "Settings", "build_injector", "check_section", "parse_parts",
           "register", "round_weight"]


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


def check_parts(injectors: list[Injector], s: Settings, *, default_engine: str) -> str:
    """Every check of the mismatch settings that needs no model (ranges, each part's own, the
    schedule, the engine the parts need); returns the rollout engine's name."""
    if s.magnitude < 0:
        raise UsageError(f"mismatch.magnitude must be >= 0, got {s.magnitude}")
    if not 0.0 < s.prob_below <= 1.0:
        raise UsageError(f"mismatch.prob_below must be in (0, 1], got {s.prob_below}")
    if s.prob_below < 1.0 and not any(inj.scoped for inj in injectors):
        raise UsageError(f"mismatch.prob_below scopes {' and '.join(_names_where('scoped'))} only; add one of them")
    for key in ("entropy_min", "entropy_max", "position_min", "position_max"):
        v = getattr(s, key)
        if key.startswith("entropy") and not (math.isfinite(v) and v >= 0):
            raise UsageError(f"mismatch.{key} must be a finite number of nats >= 0 (0 = no bound), got {v}")
        if key.startswith("position") and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise UsageError(f"mismatch.{key} must be a response token index >= 0 (0 = no bound), got {v!r}")
        if v > 0 and not any(inj.step_scoped for inj in injectors):
            raise UsageError(f"mismatch.{key} scopes {', '.join(_names_where('step_scoped'))} only; add one of them")
    if s.entropy_max > 0 and s.entropy_min >= s.entropy_max:
        raise UsageError(f"mismatch.entropy_min ({s.entropy_min}) must be below mismatch.entropy_max ({s.entropy_max})")
    if s.position_max > 0 and s.position_min >= s.position_max:
        raise UsageError(f"mismatch.position_min ({s.position_min}) must be below mismatch.position_max ({s.position_max})")
    for key in MARKER_KEYS:
        v = getattr(s, key)
        if not isinstance(v, str):
            raise UsageError(f"mismatch.{key} must be a text of one token ('' = off), got {v!r}")
        if v and not any(inj.step_scoped for inj in injectors):
            raise UsageError(f"mismatch.{key} scopes {', '.join(_names_where('step_scoped'))} only; add one of them")
    if isinstance(s.redraw_every, bool) or not isinstance(s.redraw_every, int) or s.redraw_every < 0:
        raise UsageError(f"mismatch.redraw_every must be a number of steps >= 0 (0 = one draw for the run), "
                         f"got {s.redraw_every!r}")
    if s.redraw_every and not any(inj.redraws for inj in injectors):
        raise UsageError(f"mismatch.redraw_every renews the direction of {', '.join(_names_where('redraws'))} only; "
                         "add one of them")
    if s.after_text and s.after_text == s.before_text:
        raise UsageError(f"mismatch.after_text and mismatch.before_text are both {s.after_text!r}: no decode step "
                         "is in scope; keep one of them")
    for inj in injectors:
        inj.check()
    check_target(target_k3=s.target_k3, target_k3_end=s.target_k3_end, target_gain=s.target_gain,
                 target_max_change=s.target_max_change, magnitude=s.magnitude, magnitude_end=s.magnitude_end,
                 schedule=s.schedule, kinds=[inj.magnitude_kind for inj in injectors], target_adapt=s.target_adapt)
    start, end = (s.target_k3, s.target_k3_end) if s.target_k3 > 0 else (s.magnitude, s.magnitude_end)
    check_schedule(schedule=s.schedule, magnitude=start, magnitude_end=end,  # under target_k3 it moves the target
                   start_step=s.start_step, ramp_steps=s.ramp_steps)
    if s.schedule != "constant" and not any(inj.magnitude_kind != "none" for inj in injectors):
        raise UsageError(f"mismatch.schedule={s.schedule} moves the magnitude of "
                         f"{', '.join(_names_where('magnitude_kind'))} only; add one of them")
    engine_name = default_engine
    for inj in injectors:
        engine_name = inj.rollout_engine(engine_name)
    keeps = [inj.name for inj in injectors if inj.step_scoped and not inj.processes_logits]
    if s.step_scope and keeps:
        body = [inj.name for inj in injectors if inj.copies_weights or inj.changes_model_code
                or type(inj).rollout_engine is not Injector.rollout_engine]
        if body or ENGINES.get(engine_name).copies_weights:
            why = f"part {body[0]} changes the rest of the rollout" if body else f"the engine {engine_name!r} runs its own copy"
            raise UsageError(f"a per-step scope (mismatch.entropy_*, position_*, after_text, before_text) confines "
                             f"{keeps[0]} only when the rest of the rollout is the trainer's own model, and {why}; "
                             "drop the scope or that part")
    code = [inj.name for inj in injectors if inj.changes_model_code]
    if code and ENGINES.get(engine_name).copies_weights:
        raise UsageError(f"mismatch.injector part {code[0]} changes timlab's model code, which the rollout engine "
                         f"{engine_name!r} does not run; use the exact or fast engine")
    return engine_name


MARKER_KEYS = ("after_text", "before_text")
"""The per-step scopes by a marker token in the response so far."""


def marker_token(key: str, text: str, tokenizer, *, vocab_size: int) -> int:
    """The token id of ``mismatch.<key>``'s ``text`` (``tokenizer``: ``encode`` / ``decode``, with
    ``eos_token_id`` / ``pad_token_id``); a one-line UsageError unless it is exactly one ordinary
    token of the model's vocabulary: in range, not EOS or pad, and decoding back to ``text`` (an
    unknown character encodes to the special <unk>, which decodes to '')."""
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise UsageError(f"mismatch.{key} {text!r} is {len(ids)} tokens of the model's tokenizer, not one; "
                         "use a single token (for a character tokenizer, one character)")
    (i,) = ids
    if (not 0 <= i < vocab_size or i in (tokenizer.eos_token_id, tokenizer.pad_token_id)
            or tokenizer.decode([i], skip_special_tokens=True) != text):
        raise UsageError(f"mismatch.{key} {text!r} is token {i}, not an ordinary token of the model's "
                         f"vocabulary of {vocab_size} that decodes back to it (EOS, pad, unknown excluded)")
    return i


def _names_where(attr: str) -> list[str]:
    """Registered parts whose class attribute ``attr`` is set (true, or not 'none')."""
    classes = {name: INJECTORS.get(name) for name in INJECTORS if INJECTORS.get(name) is not None}
    return sorted(n for n, cls in classes.items() if getattr(cls, attr) not in (False, "none"))


def settings_from(section) -> Settings:
    """The Settings of a config ``mismatch`` section (or anything with the same attributes)."""
    return Settings(**{f.name: getattr(section, f.name) for f in dataclasses.fields(Settings)})


def check_section(section, *, default_engine: str) -> None:
    """Validate a config ``mismatch`` section before any model is loaded (one-line errors)."""
    settings = settings_from(section)
    check_parts([INJECTORS.get(p)(settings) for p in parse_parts(section.injector)], settings,
                default_engine=default_engine)


class RolloutInjector:
    """Runs rollouts for the trainer with the configured mismatch applied: the parts of the spec
    (``parts``, in spec order), each an ``Injector``, acting in their ``order``."""

    def __init__(self, parts: list[str], model: CausalLM, settings: Settings, *, default_engine: str,
                 eos_token_id: int, pad_token_id: int, tokenizer=None):
        self.parts = parts
        self.settings = settings
        self.model = model
        self.injectors: list[Injector] = sorted((INJECTORS.get(p)(settings) for p in parts), key=lambda i: i.order)
        engine_name = check_parts(self.injectors, settings, default_engine=default_engine)
        self.markers: dict[str, int] = {}
        """The token ids of the set marker scopes (``after_text``, ``before_text``); empty when none is."""
        for key in MARKER_KEYS:
            if getattr(settings, key) and parts:
                if tokenizer is None:
                    raise UsageError(f"mismatch.{key} needs the model's tokenizer to find its token; "
                                     "pass tokenizer= to build_injector")
                self.markers[key] = marker_token(key, getattr(settings, key), tokenizer,
                                                 vocab_size=model.config.vocab_size)
        self.generator = torch.Generator().manual_seed(1_000_003 * settings.seed + 7)
        self.magnitude = settings.magnitude
        """The magnitude of the current step's rollout (the schedule's value)."""
        self.active = True
        """False before mismatch.start_step: the step rolls out with no part acting."""
        self.controller = None if settings.target_k3 <= 0 or not parts else K3Controller(
            target_k3=settings.target_k3, target_k3_end=settings.target_k3_end, schedule=settings.schedule,
            start_step=settings.start_step, ramp_steps=settings.ramp_steps, magnitude=settings.magnitude,
            gain=settings.target_gain, max_change=settings.target_max_change, adapt=settings.target_adapt)
        """Sets the magnitude from the realized k3 when mismatch.target_k3 > 0 (else None)."""
        self.rollout_model = self._build_model(model)
        self.engine = build_engine(engine_name, self.rollout_model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        if settings.step_scope and any(i.step_scoped and not i.processes_logits for i in self.injectors):
            self.engine.share_prefill = False  # a kept-logits part needs one row per sequence (same bits: exact prefill is row-invariant)
        self.engine_name = engine_name
        self.base_engine = None
        """The default engine on the trainer's own model, for the steps before start_step."""
        if self.parts and settings.start_step > 1:
            self.base_engine = build_engine(default_engine, model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)

    @property
    def is_identity(self) -> bool:
        return not self.parts

    @property
    def off(self) -> bool:
        """True when this step's rollout is the trainer's own model on the default engine: no
        part, or a step before mismatch.start_step."""
        return self.is_identity or not self.active

    # -- the schedule -----------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Training step ``step`` (from 1) is about to roll out with the trainer's current weights:
        set its scheduled magnitude (or switch every part off before start_step) and let the
        parts that keep state across steps (``stale``) see the weights."""
        s = self.settings
        if self.controller is not None:
            m = self.controller.magnitude(step)
        else:
            m = scheduled_magnitude(step, schedule=s.schedule, magnitude=s.magnitude, magnitude_end=s.magnitude_end,
                                    start_step=s.start_step, ramp_steps=s.ramp_steps)
        was_active, self.active = self.active, m is not None
        resync = False
        if m is not None and m != self.magnitude:
            self.magnitude = m
            for inj in self.injectors:
                inj.settings = dataclasses.replace(s, magnitude=m)
            resync = True
        for inj in self.injectors:
            resync = inj.begin_step(step, self.model) or resync
        if self.active and (resync or not was_active):
            self.refresh()

    def observe(self, k3: float) -> None:
        """The k3 this step's batch realized (before the update): the controller, if any, sets the
        next step's magnitude from it."""
        if self.controller is not None:
            self.controller.observe(k3)

    def note(self) -> str:
        """What the run's status should say of the injector: the k3 controller's "target not
        reached" (``K3Controller.note``), or ""."""
        return self.controller.note() if self.controller is not None else ""

    def metrics(self) -> dict:
        """The step's magnitude (0 while the rollout is exact, before start_step) and, under
        mismatch.target_k3, the step's target."""
        out = {"mismatch/magnitude": float(self.magnitude) if self.active else 0.0}
        if self.controller is not None:
            out.update(self.controller.metrics())
        return out

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

    def _source(self) -> CausalLM:
        """The model whose weights the rollout side maps: the trainer's, or an older copy (stale)."""
        source = self.model
        for inj in self.injectors:
            source = inj.source_model(source)
        return source

    @torch.no_grad()
    def _sync(self, m: CausalLM) -> None:
        source = self._source()
        src = dict(source.named_parameters())
        owned = {name for inj in self.injectors for name in inj.owns}
        for name, p in m.named_parameters():
            if name in owned or p is src[name]:
                continue
            p.copy_(self._map_weight(src[name]).to(p.dtype))
        for inj in self.injectors:
            inj.refresh(m, source, self._map_weight)

    def refresh(self) -> None:
        """The trainer's weights changed: bring the rollout side up to date."""
        if self.rollout_model is not self.model:
            self._sync(self.rollout_model)
        self.engine.sync_weights()

    # -- logits processors ----------------------------------------------------------------
    @property
    def processes_logits(self) -> bool:
        """True when the rollout needs a logits processor: a part changes the logits, or a per-step
        scope picks between the rollout's and the trainer's logits."""
        return any(inj.processes_logits or (inj.step_scoped and self.settings.step_scope) for inj in self.injectors)

    def _process(self, logits: torch.Tensor, col: torch.Tensor, tokens: torch.Tensor | None = None, *,
                 prompt_width: int) -> torch.Tensor:
        """The logits to sample from at column ``col`` (B,); ``tokens`` (B, col): the rows' tokens so
        far, given (``reads_tokens``) when a marker scope is set."""
        clean = logits  # (B, V): the trainer's logits, unless a part changed the model and did not keep them
        for inj in self.injectors:
            clean = inj.trainer_logits(clean)
        out = logits
        for inj in self.injectors:
            if inj.processes_logits:
                out = inj.process_logits(out, col, self.generator)
        s = self.settings
        if s.prob_below < 1.0:
            p_clean = torch.softmax(clean, dim=-1)
            out = torch.where(p_clean < s.prob_below, out, clean)
        if s.entropy_min > 0 or s.entropy_max > 0:
            logp = torch.log_softmax(clean.float(), dim=-1)  # (B, V)
            entropy = -(logp.exp() * logp).nan_to_num().sum(-1)  # (B,) nats, 0 * log 0 = 0
            keep = entropy >= s.entropy_min
            if s.entropy_max > 0:
                keep &= entropy < s.entropy_max
            out = torch.where(keep[:, None], out, clean)
        if s.position_min > 0 or s.position_max > 0:
            position = col - prompt_width  # (B,) response token index, from 0
            keep = position >= s.position_min
            if s.position_max > 0:
                keep &= position < s.position_max
            out = torch.where(keep[:, None], out, clean)
        if self.markers:
            response = tokens[:, prompt_width:]  # (B, col - P): the response so far
            if "after_text" in self.markers:
                out = torch.where((response == self.markers["after_text"]).any(-1)[:, None], out, clean)
            if "before_text" in self.markers:
                out = torch.where((response == self.markers["before_text"]).any(-1)[:, None], clean, out)
        return out

    def rollout(self, prompts: list[list[int]], *, max_new_tokens: int, sampling: SamplingParams,
                generator: torch.Generator, observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                record_routing: bool = False) -> Rollout:
        """Sample with the mismatch applied. ``observe(logits, col)``, if given, sees the logits
        each decode step samples from (after the injector's processing): mu's full distribution.
        ``record_routing``: record an MoE model's expert choices (``Rollout.experts``) where the
        engine can."""
        engine = self.engine
        width = max(len(p) for p in prompts) if prompts else 0  # the engines' prompt width P: responses from column P
        proc = functools.partial(self._process, prompt_width=width) if self.processes_logits else None
        if proc is not None and self.markers:
            proc.reads_tokens = True  # the engine passes the tokens so far (timlab.engines.base.call_processor)
        if not self.active:  # before start_step: the trainer's own model, no part acting
            engine = self.base_engine if self.base_engine is not None else self.engine
            proc = None
        if observe is not None:
            inner = proc

            def proc(logits: torch.Tensor, col: torch.Tensor, *tokens: torch.Tensor) -> torch.Tensor:
                out = inner(logits, col, *tokens) if inner is not None else logits
                observe(out, col)
                return out

            proc.reads_tokens = reads_tokens(inner)

        return engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, generator=generator,
                               logits_processor=proc, record_routing=record_routing and engine.records_routing)

    def state_dict(self) -> dict:
        state = {"generator": self.generator.get_state()}
        if self.controller is not None:
            state["controller"] = self.controller.state_dict()
        for inj in self.injectors:
            if inj.state_dict():
                state[inj.name] = inj.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state and "generator" in state:
            self.generator.set_state(state["generator"])
        if state and self.controller is not None and "controller" in state:
            self.controller.load_state_dict(state["controller"])
        for inj in self.injectors:
            if state and inj.name in state:
                inj.load_state_dict(state[inj.name])


def build_injector(section, model: CausalLM, *, default_engine: str = "exact", eos_token_id: int,
                   pad_token_id: int, tokenizer=None) -> RolloutInjector:
    """From a config ``mismatch`` section (or anything with the same attributes). ``tokenizer``
    (the model's; needed by ``mismatch.after_text`` / ``before_text``) finds a marker's token."""
    parts = parse_parts(section.injector)
    settings = settings_from(section)
    return RolloutInjector(parts, model, settings, default_engine=default_engine,
                           eos_token_id=eos_token_id, pad_token_id=pad_token_id, tokenizer=tokenizer)
