"""``head_perturb``: the rollout's output head is W + magnitude * |W|/|R| * R, with R a fixed
Gaussian drawn once from ``mismatch.seed``: a persistent, biased mismatch of known size."""

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

    def __init__(self, settings):
        super().__init__(settings)
        self.noise: torch.Tensor | None = None
        """R (V, d), fixed for the whole run; drawn in transform_model, when the model is known."""

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        W = model.lm_head.weight
        g = torch.Generator().manual_seed(self.settings.seed + 99)
        self.noise = torch.randn(W.shape, generator=g, dtype=torch.float32).to(W.device)  # (V, d)
        head = nn.Linear(W.shape[1], W.shape[0], bias=False, device=W.device, dtype=W.dtype)
        head.requires_grad_(False)
        rollout_model.lm_head = head  # its own head (the rest may be shared with the trainer)
        return rollout_model

    @torch.no_grad()
    def refresh(self, rollout_model: CausalLM, model: CausalLM, map_weight: WeightMap) -> None:
        W = map_weight(model.lm_head.weight.float())
        R = self.noise
        delta = self.settings.magnitude * (W.norm() / R.norm()) * R
        rollout_model.lm_head.weight.copy_((W + delta).to(rollout_model.lm_head.weight.dtype))
