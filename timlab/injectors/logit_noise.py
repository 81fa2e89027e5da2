"""``logit_noise``: fresh N(0, magnitude^2) noise on every logit of every decode step, a random
(unbiased in the logits) mismatch, drawn from the injector's own seeded generator."""

from __future__ import annotations

import torch

from timlab.injectors.base import Injector, register


@register("logit_noise")
class LogitNoise(Injector):
    order = 50
    magnitude_kind = "continuous"
    processes_logits = True
    scoped = True
    step_scoped = True

    def process_logits(self, logits: torch.Tensor, col: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.settings.magnitude <= 0:
            return logits
        noise = torch.randn(logits.shape, generator=generator, dtype=torch.float32)  # (B, V)
        return logits + self.settings.magnitude * noise.to(logits.device)
