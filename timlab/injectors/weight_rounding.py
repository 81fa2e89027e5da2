"""``weight_rounding``: the rollout's weights are rounded to bf16/fp16/int8 and computed in the
trainer's dtype (the mismatch of quantized inference weights alone, without low-precision math)."""

from __future__ import annotations

import torch

from timlab.injectors.base import Injector, check_dtype, register
from timlab.model.hf_io import parse_dtype

ROUNDING_DTYPES = ("bfloat16", "float16", "int8")


def round_weight(w: torch.Tensor, dtype: str) -> torch.Tensor:
    """Round a tensor to bf16/fp16, or int8 with per-output-row symmetric scales; same dtype out."""
    if dtype == "int8":
        if w.dim() < 2:
            return w.clone()
        scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0  # (N, 1)
        return (torch.round(w / scale).clamp(-127, 127) * scale).to(w.dtype)
    return w.to(parse_dtype(dtype)).to(w.dtype)


@register("weight_rounding")
class WeightRounding(Injector):
    order = 10
    copies_weights = True

    def check(self) -> None:
        check_dtype(self.name, self.settings.dtype, ROUNDING_DTYPES)

    def map_weight(self, w: torch.Tensor) -> torch.Tensor:
        return round_weight(w, self.settings.dtype)
