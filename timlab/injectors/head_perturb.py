"""``head_perturb``: the rollout's output head is W + magnitude * |W|/|R| * R, with R a fixed
Gaussian drawn once from ``mismatch.seed``: a persistent, biased mismatch of known size.

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


@register("head_perturb")
class HeadPerturb(Injector):
    order = 20
    magnitude_kind = "continuous"
    owns = ("lm_head.weight",)
    step_scoped = True

    def __init__(self, settings):
        super().__init__(settings)
        self.noise: torch.Tensor | None = None
        """R (V, d), fixed for the whole run; drawn in transform_model, when the model is known."""
        self.kept: torch.Tensor | None = None
        """Under a per-step scope: the trainer's logits (B, V) of the step the rollout model last computed."""

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        W = model.lm_head.weight
        g = torch.Generator().manual_seed(self.settings.seed + 99)
        self.noise = torch.randn(W.shape, generator=g, dtype=torch.float32).to(W.device)  # (V, d)
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
