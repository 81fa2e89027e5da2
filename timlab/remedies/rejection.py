"""Rejection sampling (RS): drop tokens or whole sequences whose mismatch is too large.

verl's ``rollout_rs`` with the same rule names, threshold strings and semantics
(``compute_rollout_rejection_mask`` in verl/trainer/ppo/rollout_corr_helper.py, verl 0.9.1).
``rejection_mask`` returns the response mask with rejected tokens set to 0, plus ``rs/*`` metrics;
the trainer multiplies its loss mask by it (verl replaces ``response_mask``).

A rule is ``<aggregation>_<estimator>``; a comma-separated list of rules is an AND (a token
survives only if every rule keeps it). With r = log pi - log mu clamped to [-20, 20] per token:

    estimator   per-token divergence         threshold
      k1        -r = log(mu / pi)            "lo_hi" ratio bounds: keep log(lo) <= stat <= log(hi);
                                             a single "hi" means lo = 1 / hi
      k2        r^2 / 2                      one upper bound: keep stat <= hi
      k3        exp(r) - 1 - r               one upper bound
    aggregation
      token     the token's own value                        (rejects single tokens)
      seq_sum   sum over the sequence's valid tokens         (rejects whole sequences)
      seq_mean  mean over the sequence's valid tokens
      seq_max   max over the sequence's valid tokens (k2, k3 only: verl has no seq_max_k1)

Note the k1 sign, which is verl's: its statistic is log(mu / pi), so ``token_k1`` with "0.5_2.0"
keeps tokens with 0.5 <= mu / pi <= 2; for the symmetric "1/C_C" bounds this is the same set as
0.5 <= pi / mu <= 2. ``seq_mean_k1`` is the geometric-mean ratio rule (verl's "Geo-RS"), the max
rules are verl's trust-region masking (arXiv 2512.23075) that replaced the token veto.

``thresholds`` holds one entry shared by every rule or one per rule, comma-separated in the
rules' order (duplicate rules are dropped first, as in verl); a float is one shared entry.

Departures from verl (edge cases only): everything is computed in float64; a batch with no valid
token returns the mask unchanged and every metric 0.0 (verl raises); ``rs/seq_masked_frac`` is over
sequences with a valid token (verl divides its overall one by every row, empty ones included).
verl's per-rule std and sequence-level summaries are not reproduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from timlab.errors import UsageError
from timlab.metrics._inputs import SAFETY_BOUND, check_inputs
from timlab.registry import Registry

ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda r: -r,
    "k2": lambda r: 0.5 * r * r,
    "k3": lambda r: torch.expm1(r) - r,
}
"""Per-token divergence estimators of r (clamped), verl's ``token_k*``."""


@dataclass(frozen=True)
class Rule:
    """One RS rule: how per-token divergences are aggregated and compared with its threshold."""

    aggregation: str
    """token, seq_sum, seq_mean or seq_max."""
    estimator: str
    """k1, k2 or k3 (a key of ``ESTIMATORS``)."""

    @property
    def two_sided(self) -> bool:
        """k1 rules take "lo_hi" ratio bounds; the others one upper bound."""
        return self.estimator == "k1"


RS_RULES: Registry[Rule] = Registry("rejection rule")
for _agg in ("token", "seq_sum", "seq_mean", "seq_max"):
    for _est in ESTIMATORS:
        if not (_agg == "seq_max" and _est == "k1"):
            RS_RULES.add(f"{_agg}_{_est}", Rule(_agg, _est))

SUMMARY_KEYS = ("rs/masked_frac", "rs/seq_masked_frac")
"""Overall metrics: share of valid tokens rejected, share of sequences with any token rejected."""

RULE_METRIC_SUFFIXES = ("mean", "max", "min", "masked_frac", "seq_masked_frac")
"""Per-rule metrics ``rs/<rule>_<suffix>``: the statistic's mean over valid tokens (a sequence
rule's value counts once per token, as in verl), its max and min (over sequences for sequence
rules, over tokens for token rules), and the share of tokens / sequences that rule rejects."""


def rule_metric_keys(rule: str) -> tuple[str, ...]:
    return tuple(f"rs/{rule}_{s}" for s in RULE_METRIC_SUFFIXES)


def parse_rules(rules: str) -> list[str]:
    """``"token_k1, seq_max_k3"`` -> the rule names in order, duplicates dropped; unknown -> error."""
    if not isinstance(rules, str) or not rules.strip():
        raise UsageError(f"rejection rules must be a non-empty comma-separated string; valid choices: "
                         f"{', '.join(RS_RULES.names())}")
    out: list[str] = []
    for name in (part.strip() for part in rules.split(",")):
        if not name:
            continue
        RS_RULES.get(name)  # unknown -> one line listing the valid rules
        if name not in out:
            out.append(name)
    return out


def _number(rule: str, text: str, spec: object) -> float:
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not (math.isfinite(x) and x > 0):
        raise UsageError(f"rejection threshold {spec!r} for rule {rule}: {text!r} is not a finite number > 0")
    return x


def parse_thresholds(rules: list[str], thresholds: str | float) -> dict[str, tuple[float | None, float]]:
    """verl's ``rollout_rs_threshold`` for ``rules``: rule -> (lower ratio bound or None, upper).

    One entry for all rules or one per rule; k1 rules take "lo_hi" (or "hi", lo = 1/hi), the
    others a single number. Bounds must be finite and > 0, and lo <= hi.
    """
    if isinstance(thresholds, bool) or not isinstance(thresholds, (str, int, float)):
        raise UsageError(f"rejection thresholds must be a string like '0.5_2.0,0.01' or a number, got {thresholds!r}")
    specs = [str(thresholds)] if not isinstance(thresholds, str) else [p.strip() for p in thresholds.split(",") if p.strip()]
    if not specs:
        raise UsageError("rejection thresholds are empty; give one per rule (comma-separated) or one for all")
    if len(specs) not in (1, len(rules)):
        raise UsageError(f"rejection thresholds {thresholds!r}: {len(specs)} entries for {len(rules)} rules "
                         f"({', '.join(rules)}); give one per rule or one for all")
    if len(specs) == 1:
        specs = specs * len(rules)
    out: dict[str, tuple[float | None, float]] = {}
    for rule, spec in zip(rules, specs):
        if RS_RULES.get(rule).two_sided:
            lo_text, hi_text = spec.split("_", 1) if "_" in spec else (None, spec)
            hi = _number(rule, hi_text, thresholds)
            lo = 1.0 / hi if lo_text is None else _number(rule, lo_text, thresholds)
            if lo > hi:
                raise UsageError(f"rejection threshold {spec!r} for rule {rule}: lower bound {lo:g} > upper {hi:g}")
            out[rule] = (lo, hi)
        else:
            if "_" in spec:
                raise UsageError(f"rejection threshold {spec!r} for rule {rule}: a k2/k3 rule takes one upper bound, "
                                 "not 'lo_hi'")
            out[rule] = (None, _number(rule, spec, thresholds))
    return out


def _aggregate(stat: torch.Tensor, valid: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Per-token stat (B, T) -> per-sequence (B,) for sequence rules (0 for empty rows)."""
    validf = valid.to(stat.dtype)
    if aggregation == "seq_sum":
        return (stat * validf).sum(-1)
    if aggregation == "seq_mean":
        return (stat * validf).sum(-1) / validf.sum(-1).clamp(min=1)
    masked = stat.masked_fill(~valid, float("-inf")).max(-1).values  # seq_max
    return torch.where(valid.any(-1), masked, torch.zeros_like(masked))


def rejection_mask(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    rules: str,
    thresholds: str | float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask (B, T) with rejected tokens zeroed (input dtype), and ``rs/*`` metrics.

    ``rules``: comma-separated names of ``RS_RULES`` (verl's ``rollout_rs``); ``thresholds``:
    verl's ``rollout_rs_threshold`` (see ``parse_thresholds``). Keys: ``SUMMARY_KEYS`` and, for
    each rule, ``rule_metric_keys(rule)``.
    """
    names = parse_rules(rules)
    bounds = parse_thresholds(names, thresholds)
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        valid, validf = p.valid, p.validf  # (B, T)
        r = (p.train - p.rollout).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T), 0 off-mask
        has = valid.any(-1)  # (B,)
        n_tok = validf.sum().clamp(min=1)
        n_seq = has.sum().clamp(min=1)
        keep_all = torch.ones_like(valid)
        stats: dict[str, torch.Tensor] = {}
        for name in names:
            rule = RS_RULES.get(name)
            lo, hi = bounds[name]
            tok_stat = ESTIMATORS[rule.estimator](r)  # (B, T)
            if rule.aggregation == "token":
                stat = tok_stat
                per_token = tok_stat
            else:
                stat = _aggregate(tok_stat, valid, rule.aggregation)  # (B,)
                per_token = stat[:, None].expand_as(r)  # (B, T)
            if rule.two_sided:
                ok = (stat >= math.log(lo)) & (stat <= math.log(hi))
            else:
                ok = stat <= hi
            keep = ok if rule.aggregation == "token" else ok[:, None].expand_as(valid)  # (B, T)
            keep_all = keep_all & keep
            rejected = ~keep & valid
            if rule.aggregation == "token":
                big = stat.masked_fill(~valid, float("-inf")).max()
                small = stat.masked_fill(~valid, float("inf")).min()
            else:
                big = stat.masked_fill(~has, float("-inf")).max()
                small = stat.masked_fill(~has, float("inf")).min()
            stats.update({
                f"rs/{name}_mean": (per_token * validf).sum() / n_tok,
                f"rs/{name}_max": big,
                f"rs/{name}_min": small,
                f"rs/{name}_masked_frac": rejected.sum() / n_tok,
                f"rs/{name}_seq_masked_frac": rejected.any(-1).sum() / n_seq,
            })
        rejected_all = ~keep_all & valid
        stats["rs/masked_frac"] = rejected_all.sum() / n_tok
        stats["rs/seq_masked_frac"] = rejected_all.any(-1).sum() / n_seq
        if not valid.any():
            metrics = {k: 0.0 for k in stats}
        else:
            values = torch.stack([v.to(torch.float64).reshape(()) for v in stats.values()]).tolist()  # one host sync
            metrics = dict(zip(stats, (float(x) for x in values)))
        out = mask * keep_all.to(mask.dtype) if mask.dtype != torch.bool else mask & keep_all
        return out, metrics
