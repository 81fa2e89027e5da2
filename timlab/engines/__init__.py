"""Rollout engines behind one interface, chosen by name: exact, fast, hf, vllm.

``hf`` and ``vllm`` are always registered; they import transformers / vllm only when an engine
is built and say how to install it when missing.
"""

from timlab.engines.base import (
    ENGINES,
    Engine,
    NonFiniteLogitsError,
    Rollout,
    SamplingParams,
    full_batch_decode,
    sample_next,
)
from timlab.engines import native  # noqa: F401  (registers exact, fast)
from timlab.engines import hf  # noqa: F401  (registers hf; transformers is imported lazily)
from timlab.engines import vllm  # noqa: F401  (registers vllm; vllm is imported lazily)

__all__ = ["ENGINES", "Engine", "NonFiniteLogitsError", "Rollout", "SamplingParams", "sample_next", "build_engine",
           "full_batch_decode"]


def build_engine(name: str, model, *, eos_token_id: int, pad_token_id: int | None = None) -> Engine:
    """Build an engine by name; unknown names list the valid choices."""
    return ENGINES.get(name)(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
