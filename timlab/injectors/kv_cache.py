"""``kv_cache``: the rollout's KV cache is stored in ``mismatch.dtype`` while everything else
runs in the trainer's dtype (an inference engine's ``kv_cache_dtype``).

Keys (after RoPE) and values are rounded to the storage dtype as they are written into the
cache, and every attention call, the prefill's included, reads them back from it. ``fp8`` is
float8_e4m3fn and ``fp8_e5m2`` float8_e5m2, both with scale 1.0 and saturated at the format's
largest finite value: vLLM's default when a checkpoint carries no calibrated k/v scales.
``bfloat16`` / ``float16`` are plain casts (no change when the trainer already runs in that
dtype). A part with no magnitude; it runs in timlab's model code, so it needs the exact or fast
engine.
"""

from __future__ import annotations

import functools

import torch

from timlab.injectors.base import Injector, check_dtype, register
from timlab.model.llama import CausalLM

KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""``mismatch.dtype`` -> the cache's storage dtype."""


def store_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` (to nearest, ties to even; saturated at its largest finite
    value, with scale 1.0) and returned in ``t``'s dtype."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        t32 = t.float().clamp(-limit, limit)
        return t32.to(dtype).to(t.dtype)
    return t.to(dtype).to(t.dtype)


@register("kv_cache")
class KVCacheDtype(Injector):
    order = 27
    copies_weights = True  # its own attention modules: the trainer's never store a rounded cache
    changes_model_code = True

    def check(self) -> None:
        check_dtype(self.name, self.settings.dtype, tuple(KV_DTYPES))

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        store = functools.partial(store_as, dtype=KV_DTYPES[self.settings.dtype])
        for layer in rollout_model.model.layers:
            layer.self_attn.kv_store = store
        return rollout_model
