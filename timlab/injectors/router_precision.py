"""``router_precision``: the rollout computes the MoE routers' logits in bf16/fp16
(``mismatch.dtype``: inputs and router weights rounded to it, the GEMM in it) while everything
else stays exact: the routing mismatch of an inference engine whose router runs in low
precision, and nothing else. A router logit rounded differently can change a token's top-k
experts, and then the token's whole MLP output; the realized mismatch is measured like any other
(``mismatch/*``, and router flip rates where routing is recorded). Needs a mixture-of-experts
model (``model_type`` qwen3_moe)."""

from __future__ import annotations

from timlab.errors import UsageError
from timlab.injectors.base import Injector, check_dtype, register
from timlab.model.hf_io import parse_dtype
from timlab.model.llama import CausalLM

ROUTER_DTYPES = ("bfloat16", "float16")


@register("router_precision")
class RouterPrecision(Injector):
    order = 40  # after precision: the routers' dtype holds whatever the rest of the copy is cast to
    copies_weights = True  # the routers' dtype is a setting of the (copied) MoE blocks, not a weight

    def check(self) -> None:
        check_dtype(self.name, self.settings.dtype, ROUTER_DTYPES)

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        blocks = [layer.mlp for layer in rollout_model.model.layers if layer.sparse]
        if not blocks:
            raise UsageError(f"router_precision needs a mixture-of-experts model (model_type qwen3_moe); "
                             f"this one is {model.config.model_type!r} with no sparse layer")
        for block in blocks:
            block.router_dtype = parse_dtype(self.settings.dtype)
        return rollout_model
