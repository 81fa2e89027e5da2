"""Where the mismatch lives: histograms of the log-ratio and |r| broken down by token position and
by trainer probability. Outputs are plain JSON-serializable dicts (lists of floats/ints) for
reports and plots.

Conventions (shared by every function here):
- r = log pi - log mu over valid tokens; inputs (B, T) as in ``timlab.metrics.offpolicy``.
- A bucket with no tokens reports ``count`` 0 and ``mean_abs_diff`` 0.0 (never None/NaN), so the
  lists are always numeric; read the count before trusting a 0.0.
- Buckets are half-open ``[lo, hi)`` except the last, which is closed.

Not from a paper: these are timlab's diagnostics (the TIM literature plots |r| against position
and probability informally; there is no reference definition to match).
"""

from __future__ import annotations

from typing import Sequence

import torch

from timlab.errors import UsageError
from timlab.metrics._inputs import SAFETY_BOUND, check_inputs

DEFAULT_RATIO_EDGES: tuple[float, ...] = (
    -SAFETY_BOUND, -1.0, -1e-1, -1e-2, -1e-3, -1e-4, -1e-5, -1e-6,
    1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, SAFETY_BOUND,
)  # fmt: skip
"""Symmetric log-spaced edges on r; the middle bin [-1e-6, 1e-6) holds the (near-)equal tokens."""

DEFAULT_PROB_EDGES: tuple[float, ...] = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)


def _check_edges(edges: Sequence[float], name: str) -> torch.Tensor:
    e = torch.as_tensor([float(x) for x in edges], dtype=torch.float64)
    if e.numel() < 2 or not torch.isfinite(e).all() or not (e[1:] > e[:-1]).all():
        raise UsageError(f"{name} must be >= 2 finite, strictly increasing values, got {list(edges)}")
    return e


def _bucket_sums(idx: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-bucket count (n,) and sum (n,) of ``values`` over valid entries; idx (B, T) in [0, n)."""
    idx = idx[valid]  # (N,)
    vals = values[valid]  # (N,)
    counts = torch.bincount(idx, minlength=n)[:n]  # (n,)
    sums = torch.zeros(n, dtype=torch.float64, device=vals.device).index_add(0, idx, vals)
    return counts, sums


def _lists(counts: torch.Tensor, sums: torch.Tensor) -> tuple[list, list]:
    """Counts and means as JSON-ready lists."""
    means = sums / counts.clamp(min=1)
    return [int(c) for c in counts.tolist()], [float(m) for m in means.tolist()]


def _bucket_stats(idx: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, n: int) -> tuple[list, list]:
    """Per-bucket count and mean of ``values`` over valid entries; idx (B, T) in [0, n)."""
    return _lists(*_bucket_sums(idx, values, valid, n))


def ratio_histogram(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    bins: Sequence[float] = DEFAULT_RATIO_EDGES,
) -> dict:
    """Histogram of r over valid tokens: ``{"edges": [...], "counts": [...], "num_tokens": N}``.

    ``bins`` are the edges (len(counts) == len(edges) - 1); values outside [edges[0], edges[-1]]
    are counted in the first/last bin, so counts always sum to the number of valid tokens.
    """
    e = _check_edges(bins, "bins")
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        n = e.numel() - 1
        r = p.train - p.rollout  # (B, T)
        idx = (torch.bucketize(r, e.to(r.device), right=True) - 1).clamp(0, n - 1)  # (B, T)
        counts = torch.bincount(idx[p.valid], minlength=n)[:n]
        return {
            "edges": e.tolist(),
            "counts": [int(c) for c in counts.tolist()],
            "num_tokens": int(p.valid.sum()),
        }


def mismatch_by_position(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_buckets: int = 8,
) -> dict:
    """Mean |r| and token count per response-position bucket.

    Position = index of the token among its sequence's valid tokens (0 for the first response
    token, whatever the padding side). Positions 0..T-1 are split into ``num_buckets``
    equal-width buckets; bucket i covers positions ``[edges[i], edges[i+1])``.
    Returns ``{"edges": [...], "mean_abs_diff": [...], "counts": [...]}``.
    """
    if not isinstance(num_buckets, int) or num_buckets < 1:
        raise UsageError(f"num_buckets must be an int >= 1, got {num_buckets!r}")
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        return _position_buckets(*_position_sums(p.train, p.rollout, p.valid), num_buckets)


def _position_sums(train: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token count (T,) and sum of |r| (T,) at each response position (rank among valid tokens)."""
    T = valid.shape[1]
    pos = valid.to(torch.int64).cumsum(-1) - 1  # (B, T) rank among valid tokens
    return _bucket_sums(pos.clamp(min=0), (train - rollout).abs(), valid, T)


def _position_buckets(counts: torch.Tensor, sums: torch.Tensor, num_buckets: int) -> dict:
    """``mismatch_by_position``'s dict from per-position counts and sums (T,)."""
    T = counts.numel()
    idx = (torch.arange(T, device=counts.device) * num_buckets) // max(T, 1)  # (T,) in [0, num_buckets)
    b_counts = torch.zeros(num_buckets, dtype=counts.dtype, device=counts.device).index_add(0, idx, counts)
    b_sums = torch.zeros(num_buckets, dtype=torch.float64, device=sums.device).index_add(0, idx, sums)
    counts_l, means = _lists(b_counts, b_sums)
    edges = [-(-i * T // num_buckets) for i in range(num_buckets + 1)]  # ceil(i T / n)
    return {"edges": edges, "mean_abs_diff": means, "counts": counts_l}


def mismatch_by_prob_bucket(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    edges: Sequence[float] = DEFAULT_PROB_EDGES,
) -> dict:
    """Mean |r| and token count per bucket of the trainer's probability exp(log pi).

    Probabilities outside [edges[0], edges[-1]] fall in the first/last bucket.
    Returns ``{"edges": [...], "mean_abs_diff": [...], "counts": [...]}``.
    """
    e = _check_edges(edges, "edges")
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        n = e.numel() - 1
        prob = torch.exp(p.train.clamp(max=0.0))  # (B, T)
        idx = (torch.bucketize(prob, e.to(prob.device), right=True) - 1).clamp(0, n - 1)  # (B, T)
        counts, means = _bucket_stats(idx, (p.train - p.rollout).abs(), p.valid, n)
        return {"edges": e.tolist(), "mean_abs_diff": means, "counts": counts}


DEFAULT_LENGTH_EDGES: tuple[float, ...] = (1, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256, 1024, 8192, 65536)


def mismatch_by_length(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    edges: Sequence[float] = DEFAULT_LENGTH_EDGES,
) -> dict:
    """Per response-length bucket: sequence count, mean |sum_t r| (the Eq. 8 sum form, which the
    seed paper's T^2 bound says grows with length) and mean per-token |r|.

    Length = number of valid tokens of a sequence; buckets ``[edges[i], edges[i+1])``, the last
    closed. Returns ``{"edges", "counts", "mean_abs_sum_diff", "mean_abs_diff"}``.
    """
    e = _check_edges(edges, "edges")
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        n = e.numel() - 1
        r = torch.where(p.valid, p.train - p.rollout, torch.zeros_like(p.train))  # (B, T)
        lengths = p.valid.sum(-1).to(torch.float64)  # (B,)
        has = lengths > 0
        abs_sum = r.sum(-1).abs()  # (B,)
        abs_mean = r.abs().sum(-1) / lengths.clamp(min=1)  # (B,)
        idx = (torch.bucketize(lengths, e.to(lengths.device), right=True) - 1).clamp(0, n - 1)  # (B,)
        counts, sums = _bucket_stats(idx[:, None], abs_sum[:, None], has[:, None], n)
        _, means = _bucket_stats(idx[:, None], abs_mean[:, None], has[:, None], n)
        return {"edges": e.tolist(), "counts": counts, "mean_abs_sum_diff": sums, "mean_abs_diff": means}


# ------------------------------------------------------------------------------ streamed batches
def breakdown_sums(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mergeable counts and sums of the four breakdowns at their default edges for one (B, T)
    batch; merge batches with ``merge_breakdown_sums``, finish with ``breakdowns_from_sums``.
    For one batch the result equals the four functions above bit for bit."""
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        r = p.train - p.rollout  # (B, T), 0 off-mask
        e_ratio, e_prob, e_len = (torch.as_tensor(e, dtype=torch.float64, device=r.device)
                                  for e in (DEFAULT_RATIO_EDGES, DEFAULT_PROB_EDGES, DEFAULT_LENGTH_EDGES))
        n = e_ratio.numel() - 1
        idx = (torch.bucketize(r, e_ratio, right=True) - 1).clamp(0, n - 1)  # (B, T)
        out = {"ratio_counts": torch.bincount(idx[p.valid], minlength=n)[:n]}
        out["position_counts"], out["position_sums"] = _position_sums(p.train, p.rollout, p.valid)
        n = e_prob.numel() - 1
        idx = (torch.bucketize(torch.exp(p.train.clamp(max=0.0)), e_prob, right=True) - 1).clamp(0, n - 1)  # (B, T)
        out["prob_counts"], out["prob_sums"] = _bucket_sums(idx, r.abs(), p.valid, n)
        n = e_len.numel() - 1
        lengths = p.valid.sum(-1).to(torch.float64)  # (B,)
        has = lengths > 0
        idx = (torch.bucketize(lengths, e_len, right=True) - 1).clamp(0, n - 1)  # (B,)
        out["length_counts"], out["length_abs_sum"] = _bucket_sums(idx[:, None], r.sum(-1).abs()[:, None], has[:, None], n)
        _, out["length_abs_mean"] = _bucket_sums(idx[:, None], (r.abs().sum(-1) / lengths.clamp(min=1))[:, None],
                                                 has[:, None], n)
        return out


def merge_breakdown_sums(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two batches' ``breakdown_sums`` added (per-position ones padded to the longer batch)."""
    out = {}
    for k, x in a.items():
        y = b[k]
        if x.numel() < y.numel():
            x, y = y, x
        out[k] = torch.cat([x[: y.numel()] + y, x[y.numel():]])
    return out


def breakdowns_from_sums(sums: dict[str, torch.Tensor], *, num_position_buckets: int) -> dict[str, dict]:
    """``{"histogram", "by_position", "by_prob", "by_length"}`` from merged ``breakdown_sums``."""
    counts = sums["ratio_counts"]
    by_prob_counts, by_prob_means = _lists(sums["prob_counts"], sums["prob_sums"])
    length_counts, length_sums = _lists(sums["length_counts"], sums["length_abs_sum"])
    _, length_means = _lists(sums["length_counts"], sums["length_abs_mean"])
    return {
        "histogram": {"edges": [float(x) for x in DEFAULT_RATIO_EDGES], "counts": [int(c) for c in counts.tolist()],
                      "num_tokens": int(counts.sum())},
        "by_position": _position_buckets(sums["position_counts"], sums["position_sums"], num_position_buckets),
        "by_prob": {"edges": [float(x) for x in DEFAULT_PROB_EDGES], "mean_abs_diff": by_prob_means,
                    "counts": by_prob_counts},
        "by_length": {"edges": [float(x) for x in DEFAULT_LENGTH_EDGES], "counts": length_counts,
                      "mean_abs_sum_diff": length_sums, "mean_abs_diff": length_means},
    }
