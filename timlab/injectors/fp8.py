"""``fp8``: the rollout's linear layers in simulated FP8 (W8A8 with e4m3 weights and activations).

As FP8 inference engines serve a model (vLLM's ``fp8`` W8A8 path): every linear of the decoder
layers (q, k, v, o, gate, up, down) has its weight quantized to ``float8_e4m3fn`` with a scale,
and its input activation is quantized dynamically, at every call, the same way; the embedding,
the norms, the biases and the LM head stay in the trainer's dtype. ``mismatch.scale_granularity``:

- ``per_tensor``: one scale per weight matrix and one per activation tensor (the whole call's
  batch, as a dynamic per-tensor scale is computed: so a row's rounding depends on the others);
- ``per_channel``: one scale per output channel of a weight and one per token of an activation.

A scale is amax / 448 (448: the largest finite e4m3 value), so the largest magnitude is
representable; a value is divided by its scale, rounded to e4m3 by torch's cast (to nearest,
ties to even) and multiplied back. Where it departs from an engine: the matmul then runs on the
dequantized values in the trainer's dtype (an engine multiplies the e4m3 values and rescales the
fp32 accumulator), which differs from it only in accumulation rounding. A part with no magnitude.
"""

from __future__ import annotations

import functools

import torch

from timlab.errors import UsageError
from timlab.injectors.base import Injector, WeightMap, register
from timlab.model.linear import MappedInputLinear
from timlab.model.llama import CausalLM

E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value."""

SCALE_GRANULARITIES = ("per_tensor", "per_channel")

MIN_SCALE = 1e-12
"""Floor of a scale, so an all-zero tensor quantizes to zeros instead of 0 / 0."""

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
"""The linears of one decoder layer that FP8 serving quantizes."""


def fp8_quantize_dequantize(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """``x`` through e4m3 and back, same shape and dtype: one scale for the tensor (per_tensor) or
    one per slice along the last dimension (per_channel: a weight's output channel (N, K) -> (N, 1),
    an activation's token (..., K) -> (..., 1))."""
    xf = x.float()
    if granularity == "per_tensor":
        amax = xf.abs().amax()
    else:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


@register("fp8")
class FP8(Injector):
    order = 25  # after head_perturb's new head, before precision's cast
    copies_weights = True
    changes_model_code = True

    def check(self) -> None:
        if self.settings.scale_granularity not in SCALE_GRANULARITIES:
            raise UsageError(f"mismatch.scale_granularity {self.settings.scale_granularity!r} for fp8; "
                             f"valid choices: {', '.join(SCALE_GRANULARITIES)}")

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        act = functools.partial(fp8_quantize_dequantize, granularity=self.settings.scale_granularity)
        owns = []
        for i, layer in enumerate(rollout_model.model.layers):
            for path in LINEARS:
                parent_name, attr = path.split(".")
                parent = getattr(layer, parent_name)
                setattr(parent, attr, MappedInputLinear(getattr(parent, attr), act))
                owns.append(f"model.layers.{i}.{path}.weight")
        self.owns = tuple(owns)  # these weights are set quantized in refresh
        return rollout_model

    @torch.no_grad()
    def refresh(self, rollout_model: CausalLM, model: CausalLM, map_weight: WeightMap) -> None:
        src = dict(model.named_parameters())
        dst = dict(rollout_model.named_parameters())
        for name in self.owns:
            w = map_weight(src[name])
            dst[name].copy_(fp8_quantize_dequantize(w.float(), self.settings.scale_granularity).to(dst[name].dtype))
