"""Remedies for training-inference mismatch that act on the loss: importance-sampling weights
(TIS / MIS / IcePop two-sided / veto at token, sequence or geometric level, optionally
self-normalized), rejection sampling (verl's ``rollout_rs`` rules: token / seq_sum / seq_mean /
seq_max x k1 / k2 / k3), and router replay for mixture-of-experts models (``replay_experts``: the
trainer reuses the rollout's experts).

Pure torch; imports nothing from timlab but ``timlab.registry``, ``timlab.errors`` and the
metrics' input checker. Precision remedies (FP16, FP32 LM head, exact kernels) live with the
engines; the length-decay LR is in ``timlab.schedulers``; bypass mode and the REINFORCE loss, which
change the loss rather than weight it, are in ``timlab.trainer.losses``.
"""

from timlab.remedies.importance import (
    DEFAULT_THRESHOLD,
    DEFAULT_VETO_THRESHOLD,
    IS_LEVELS,
    IS_MODES,
    METRIC_KEYS,
    RAW_RATIO_KEYS,
    SAFETY_BOUND,
    is_weights,
)
from timlab.remedies.rejection import (
    RS_RULES,
    SUMMARY_KEYS as RS_SUMMARY_KEYS,
    parse_rules,
    parse_thresholds,
    rejection_mask,
    rule_metric_keys,
)
from timlab.remedies.router_replay import replay_experts

__all__ = [
    "DEFAULT_THRESHOLD",
    "DEFAULT_VETO_THRESHOLD",
    "IS_LEVELS",
    "IS_MODES",
    "METRIC_KEYS",
    "RAW_RATIO_KEYS",
    "RS_RULES",
    "RS_SUMMARY_KEYS",
    "SAFETY_BOUND",
    "is_weights",
    "parse_rules",
    "parse_thresholds",
    "rejection_mask",
    "rule_metric_keys",
    "replay_experts",
]
