"""The additive attention mask of a bool one: one home for the CPU attention paths that need it.

``timlab.model.ops`` (the exact attention's per-block bias), ``timlab.model.chunked_attention`` (the
same bias, chunk by chunk) and ``timlab.model.llama`` (the fast mode's SDPA mask, built once per
forward) all add this mask to their scores; it sits below all three so none imports another for it.
"""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (bool, any shape) -> the same shape in ``dtype``: 0 where allowed, -inf elsewhere,
    on ``allowed``'s device (what SDPA makes of a bool mask, and what ``masked_fill`` of the scores gave)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
