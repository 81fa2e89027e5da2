"""``head_perturb``: the rollout's output head is W + magnitude * |W|/|R| * R, with R a fixed
Gaussian drawn once from ``mismatch.seed``: a persistent, biased mismatch of known size. With
``mismatch.redraw_every`` = n > 0, R is drawn anew every n training steps (draw i from the seed
and i; draw 0 is the run-long one), so the mismatch keeps its size but points one way for n steps.

Under a per-step scope (``mismatch.entropy_min/max``, ``position_min/max``, ``after_text``,
``before_text``) the rollout model also computes the trainer's head on the same hidden state at
every decode step and keeps those logits (``trainer_logits``), so out of scope the step samples
from the trainer's logits bit for bit. The
body is the trainer's own (shared), so only alone or with logits processors; the rollout engine
must run timlab's model code (exact, fast)."""

from __future__ import annotations

import torch
from torch import nn

from timlab.injectors.base import Injector, WeightMap, register
from timlab.model.llama import CausalLM


REDRAW_STRIDE = 1_000_003
"""Seed offset between successive draws of R (a prime, so no two (seed, draw) pairs of small seeds meet)."""


@register("head_perturb")
class HeadPerturb(Injector):
    order = 20
    magnitude_kind = "continuous"
    owns = ("lm_head.weight",)
    step_scoped = True
    redraws = True

    def __init__(self, settings):
        super().__init__(settings)
        self.noise: torch.Tensor | None = None
        """R (V, d), fixed for the whole run (or for ``redraw_every`` steps); drawn in
        transform_model, when the model is known."""
        self.draw = 0
        """The index of the draw R is (``mismatch.redraw_every``)."""
        self.kept: torch.Tensor | None = None
        """Under a per-step scope: the trainer's logits (B, V) of the step the rollout model last computed."""

    def _noise(self, W: torch.Tensor, draw: int) -> torch.Tensor:
        """Draw ``draw``'s R (V, d), fp32 on W's device; draw 0 from seed + 99 as before redraws existed."""
        g = torch.Generator().manual_seed(self.settings.seed + 99 + REDRAW_STRIDE * draw)
        return torch.randn(W.shape, generator=g, dtype=torch.float32).to(W.device)

    def begin_step(self, step: int, model: CausalLM) -> bool:
        every = self.settings.redraw_every
        draw = (step - 1) // every if every > 0 else 0
        if draw == self.draw:
            return False
        self.noise, self.draw = self._noise(model.lm_head.weight, draw), draw
        return True  # the rollout head is set again from the new R

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        W = model.lm_head.weight
        self.noise, self.draw = self._noise(W, 0), 0  # (V, d)
        head = nn.Linear(W.shape[1], W.shape[0], bias=False, device=W.device, dtype=W.dtype)
        head.requires_grad_(False)
        rollout_model.lm_head = head  # its own head (the rest may be shared with the trainer)
        if self.settings.step_scope:
            def logits_from_hidden(h: torch.Tensor, mode: str = "exact") -> torch.Tensor:
                self.kept = CausalLM.logits_from_hidden(model, h, mode)  # (B, V): the trainer's head
                return CausalLM.logits_from_hidden(rollout_model, h, mode)

            rollout_model.logits_from_hidden = logits_from_hidden  # this instance only (the engines call it)
        return rollout_model

    def trainer_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.kept is None:
            return logits
        if self.kept.shape != logits.shape:
            raise RuntimeError(f"head_perturb kept logits of shape {tuple(self.kept.shape)} for a step of "
                               f"{tuple(logits.shape)}: the engine reshaped them (share_prefill must be off)")
        return self.kept

    @torch.no_grad()
    def refresh(self, rollout_model: CausalLM, model: CausalLM, map_weight: WeightMap) -> None:
        W = map_weight(model.lm_head.weight.float())
        R = self.noise
        delta = self.settings.magnitude * (W.norm() / R.norm()) * R
        rollout_model.lm_head.weight.copy_((W + delta).to(rollout_model.lm_head.weight.dtype))
