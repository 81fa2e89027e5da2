"""``temperature``: the rollout's logits are divided by 1 + magnitude, a biased mismatch (a
flatter sampling distribution than the trainer's)."""

from __future__ import annotations

import torch

from timlab.injectors.base import Injector, register


@register("temperature")
class Temperature(Injector):
    order = 40  # before logit_noise: the noise is added to the tempered logits
    magnitude_kind = "continuous"
    processes_logits = True
    scoped = True
    step_scoped = True

    def process_logits(self, logits: torch.Tensor, col: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return logits / (1.0 + self.settings.magnitude)
