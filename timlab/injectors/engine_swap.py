"""``engine``: the rollout runs on another engine (``mismatch.engine``: fast or hf kernels, or
vllm, instead of exact); exact is allowed and gives zero mismatch."""

from __future__ import annotations

from timlab.errors import UsageError
from timlab.injectors.base import Injector, register

SWAP_ENGINES = ("fast", "hf", "vllm", "exact")
"""Engines the ``engine`` injector may roll out with."""


@register("engine")
class EngineSwap(Injector):
    order = 0

    def check(self) -> None:
        if self.settings.engine not in SWAP_ENGINES:
            raise UsageError(f"mismatch.engine {self.settings.engine!r}; valid choices: {', '.join(SWAP_ENGINES)}")

    def rollout_engine(self, default: str) -> str:
        return self.settings.engine
