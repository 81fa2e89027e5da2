"""``kv_cache``: the rollout's KV cache is stored in ``mismatch.dtype`` while everything else
runs in the trainer's dtype (an inference engine's ``kv_cache_dtype``).

Keys (after RoPE) and values are rounded to the storage dtype as they are written into the
cache, and every attention call, the prefill's included, reads them back from it. ``fp8`` is
float8_e4m3fn and ``fp8_e5m2`` float8_e5m2, saturated at the format's largest finite value.
``bfloat16`` / ``float16`` are plain casts (no change when the trainer already runs in that
dtype). It runs in timlab's model code, so it needs the exact or fast engine.

``mismatch.magnitude`` m sets an fp8 cache's scale to 2^m: a value x is stored as
fp8(x / 2^m) * 2^m, as an engine stores it with per-tensor k/v scales. m = 0 is scale 1.0, vLLM's
default when a checkpoint carries no calibrated scales. A scale too large for the keys and values
(m > 0, as from scales calibrated on another model or data) pushes them toward the format's
subnormal range, where fewer significant bits remain; m < 0 saturates the large ones. A power of
two divides exactly, so the scale itself adds no rounding, and m = 0 stores the same bits as a
cache without a scale. The scale is read at each store, so a schedule or ``mismatch.target_k3``
can move it.
"""

from __future__ import annotations

import torch

from timlab.errors import UsageError
from timlab.injectors.base import Injector, check_dtype, register
from timlab.model.llama import CausalLM

KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""``mismatch.dtype`` -> the cache's storage dtype."""


SCALED = ("fp8", "fp8_e5m2")
"""The cache dtypes a scale (``mismatch.magnitude``) applies to."""


def store_as(t: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``t`` stored in ``dtype`` and read back in ``t``'s dtype: for an fp8 dtype, t / scale rounded
    to nearest (ties to even, saturated at the format's largest finite value), times scale."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        t32 = t.float() if scale == 1.0 else t.float() / scale
        out = t32.clamp(-limit, limit).to(dtype)
        return (out if scale == 1.0 else out.float() * scale).to(t.dtype)
    return t.to(dtype).to(t.dtype)


@register("kv_cache")
class KVCacheDtype(Injector):
    order = 27
    copies_weights = True  # its own attention modules: the trainer's never store a rounded cache
    changes_model_code = True
    magnitude_kind = "continuous"

    def check(self) -> None:
        check_dtype(self.name, self.settings.dtype, tuple(KV_DTYPES))
        if self.settings.magnitude != 0.0 and self.settings.dtype not in SCALED:
            raise UsageError(f"mismatch.magnitude={self.settings.magnitude:g} sets a kv_cache scale, which only an fp8 "
                             f"cache has; mismatch.dtype={self.settings.dtype} (valid with a magnitude: "
                             f"{', '.join(SCALED)})")

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        dtype = KV_DTYPES[self.settings.dtype]

        def store(t: torch.Tensor) -> torch.Tensor:
            return store_as(t, dtype, 2.0 ** self.settings.magnitude)

        for layer in rollout_model.model.layers:
            layer.self_attn.kv_store = store
        return rollout_model
