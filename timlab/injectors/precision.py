"""``precision``: the rollout runs a bf16/fp16 (or fp32) copy of the trainer's weights
(``mismatch.dtype``), the mismatch of a low-precision inference engine."""

from __future__ import annotations

from timlab.injectors.base import Injector, check_dtype, register
from timlab.model.hf_io import parse_dtype
from timlab.model.llama import CausalLM

PRECISION_DTYPES = ("bfloat16", "float16", "float32")


@register("precision")
class Precision(Injector):
    order = 30  # after head_perturb has replaced the head, so the new head is cast too
    copies_weights = True

    def check(self) -> None:
        check_dtype(self.name, self.settings.dtype, PRECISION_DTYPES)

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        return rollout_model.to(parse_dtype(self.settings.dtype))
