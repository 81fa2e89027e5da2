"""Remedies for training-inference mismatch that act on the loss: importance-sampling weights
(TIS / MIS / IcePop two-sided / veto at token, sequence or geometric level).

Pure torch; imports nothing from timlab but ``timlab.registry``. Precision remedies (FP16, FP32
LM head, exact kernels) live with the engines; the length-decay LR is in ``timlab.schedulers``.
"""

from timlab.remedies.importance import (
    DEFAULT_THRESHOLD,
    DEFAULT_VETO_THRESHOLD,
    IS_LEVELS,
    IS_MODES,
    METRIC_KEYS,
    SAFETY_BOUND,
    is_weights,
)

__all__ = [
    "DEFAULT_THRESHOLD",
    "DEFAULT_VETO_THRESHOLD",
    "IS_LEVELS",
    "IS_MODES",
    "METRIC_KEYS",
    "SAFETY_BOUND",
    "is_weights",
]
