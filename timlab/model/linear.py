"""The linear layer of the model's two numeric paths, shared by the dense decoder
(``timlab.model.llama``) and the mixture-of-experts block (``timlab.model.moe``)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from timlab.model.ops import invariant_linear


class MappedInputLinear(nn.Linear):
    """An ``nn.Linear`` (sharing the wrapped layer's parameters) whose input first goes through
    ``input_map`` (same shape out): how a rollout injector simulates quantized activations
    (``timlab.injectors.fp8``). A trainer's model never has one."""

    def __init__(self, layer: nn.Linear, input_map: Callable[[torch.Tensor], torch.Tensor]):
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight = layer.weight
        self.register_parameter("bias", layer.bias)
        self.input_map = input_map

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.input_map(x), self.weight, self.bias)


def mode_linear(mode: str, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """The linear of a numeric path: batch-invariant in ``exact`` mode, stock ``F.linear`` in ``fast``."""
    if type(layer) is MappedInputLinear:
        x = layer.input_map(x)
    if mode == "exact":
        return invariant_linear(x, layer.weight, layer.bias)
    return F.linear(x, layer.weight, layer.bias)
