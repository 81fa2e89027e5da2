"""Training-inference mismatch metrics (pure torch; imports nothing else from timlab).

Inputs everywhere are (B, T) tensors: ``train_logp`` = log pi (trainer), ``rollout_logp`` = log mu
(rollout engine), ``mask`` 1/True on response tokens.

- ``offpolicy_metrics``: verl's ``compute_offpolicy_metrics`` keys, same definitions.
- ``mismatch_metrics``: timlab extras (|r| stats, probs diff, bitwise equality, ESS, ...).
- ``all_metrics``: both, as ``rollout_corr/*`` and ``mismatch/*``; this is what trainers log.
- ``harm_metrics``, ``advantage_metrics``, ``decision_token_metrics``: candidate statistics of a
  mismatch's harm, from the advantages and the trainer's token entropies (``timlab.metrics.harm``);
  ``HARM_CANDIDATES`` names every candidate a trainer logs.
- ``routing_metrics``, ``router_flips``: MoE routing mismatch (top-k expert sets that differ).
- ``ratio_histogram``, ``mismatch_by_position``, ``mismatch_by_prob_bucket``: JSON-ready
  breakdowns for reports.
- ``length_scaling``: noise vs bias, the growth exponents of sum_t r and sum_t |r| with the
  response length (bootstrap intervals, a one-line reading); ``length_scaling_sums`` /
  ``merge_length_scaling_sums`` / ``length_scaling_from_sums`` stream it.
- ``metric_sums`` / ``merge_metric_sums`` / ``metrics_from_sums`` and ``breakdown_sums`` /
  ``merge_breakdown_sums`` / ``breakdowns_from_sums``: the same, batch by batch (streamed files);
  ``group_metric_sums`` / ``metrics_from_group_sums``: many groups of rows at once (per step).

Departures from verl are listed in ``timlab.metrics.offpolicy``'s docstring.
"""

from timlab.metrics._inputs import PPL_LOG_BOUND, SAFETY_BOUND
from timlab.metrics.distribution import (
    DEFAULT_PROB_EDGES,
    DEFAULT_RATIO_EDGES,
    breakdown_sums,
    breakdowns_from_sums,
    merge_breakdown_sums,
    mismatch_by_length,
    mismatch_by_position,
    mismatch_by_prob_bucket,
    ratio_histogram,
)
from timlab.metrics.scaling import (
    format_length_scaling,
    length_scaling,
    length_scaling_from_sums,
    length_scaling_sums,
    merge_length_scaling_sums,
)
from timlab.metrics.offpolicy import (
    DIFFERENT_TOKEN_TOL,
    MISMATCH_KEYS,
    VERL_KEYS,
    all_metrics,
    group_metric_sums,
    merge_metric_sums,
    metric_sums,
    metrics_from_group_sums,
    metrics_from_sums,
    mismatch_metrics,
    offpolicy_metrics,
)
from timlab.metrics.harm import (
    ADVANTAGE_KEYS,
    DECISION_FRAC,
    ENTROPY_KEYS,
    HARM_CANDIDATES,
    advantage_metrics,
    advantage_metrics_from_sums,
    advantage_sums,
    decision_token_metrics,
    harm_metrics,
    merge_advantage_sums,
)
from timlab.metrics.routing import router_flips, routing_metrics

__all__ = [
    "ADVANTAGE_KEYS",
    "DECISION_FRAC",
    "ENTROPY_KEYS",
    "HARM_CANDIDATES",
    "advantage_metrics",
    "advantage_metrics_from_sums",
    "advantage_sums",
    "decision_token_metrics",
    "harm_metrics",
    "merge_advantage_sums",
    "length_scaling",
    "length_scaling_sums",
    "merge_length_scaling_sums",
    "length_scaling_from_sums",
    "format_length_scaling",
    "router_flips",
    "routing_metrics",
    "mismatch_by_length",
    "SAFETY_BOUND",
    "PPL_LOG_BOUND",
    "DIFFERENT_TOKEN_TOL",
    "VERL_KEYS",
    "MISMATCH_KEYS",
    "DEFAULT_RATIO_EDGES",
    "DEFAULT_PROB_EDGES",
    "offpolicy_metrics",
    "mismatch_metrics",
    "all_metrics",
    "ratio_histogram",
    "mismatch_by_position",
    "mismatch_by_prob_bucket",
    "metric_sums",
    "merge_metric_sums",
    "metrics_from_sums",
    "group_metric_sums",
    "metrics_from_group_sums",
    "breakdown_sums",
    "merge_breakdown_sums",
    "breakdowns_from_sums",
]
