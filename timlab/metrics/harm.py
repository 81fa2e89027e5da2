"""Candidate statistics of a mismatch's *harm*, beyond its size (pure torch; nothing else of timlab).

The size of a mismatch (k3 per token, ``rollout_corr/k3_kl``; per response, ``mismatch/k3_seq``)
does not say what it costs: in timlab's own studies, mismatches of different kinds with the same
k3 cost very different amounts of accuracy (docs/FINDINGS.md). The statistics here look at *where*
the mismatch falls, using what a trainer already holds besides the two log-probs:

- ``advantage_metrics``: the mismatch weighted by the advantage A, the first-order bias of the
  policy gradient when samples come from mu instead of pi (E_mu[A grad log pi] =
  E_pi[(mu / pi) A grad log pi] ~ E_pi[(1 - r) A grad log pi], so the error is carried by r A):
  ``mismatch/adv_diff_mean`` = mean over valid tokens of A * r, and ``mismatch/adv_diff_corr``, the
  Pearson correlation over sequences between A and the sequence's log-ratio sum_t r. A mismatch
  that favours the tokens of good (or bad) answers biases the update; one uncorrelated with A
  mostly adds noise.
- ``decision_token_metrics``: k3 on the "decision" tokens (the ``DECISION_FRAC`` share of valid
  tokens with the highest trainer entropy) and on the rest, ``mismatch/k3_decision`` and
  ``mismatch/k3_rest``. Wang et al. 2025 ("Beyond the 80/20 Rule", arXiv 2506.01939) find that the
  top-20% entropy "forking" tokens carry RL's learning signal; a mismatch there may matter more.
- The probability mass moved, ``mismatch/tv_mean``, needs only the log-probs and lives with them in
  ``timlab.metrics.offpolicy`` (``all_metrics``).

``harm_metrics`` returns whichever of these its inputs allow. ``advantage_sums`` /
``merge_advantage_sums`` / ``advantage_metrics_from_sums`` compute the advantage-weighted ones over
batches streamed one at a time (``timlab analyze``).

Inputs are (B, T) as everywhere in ``timlab.metrics`` (``train_logp`` = log pi, ``rollout_logp`` =
log mu, ``mask``), r = log pi - log mu; float64, masked, one host sync per call. Advantages are (B,)
(one per sequence, GRPO / RLOO) or (B, T) (per token, verl's ``advantages``); a sequence's A for the
correlation is then the mean of its valid tokens' advantages. Not from a paper: which of these
predicts the harm is an open question; docs/metrics.md ("harm") has the formulas.
"""

from __future__ import annotations

import math

import torch

from timlab.errors import UsageError
from timlab.metrics._inputs import SAFETY_BOUND, Prepared, check_inputs
from timlab.metrics.offpolicy import _to_floats

DECISION_FRAC = 0.2
"""Share of a batch's valid tokens, those with the highest trainer entropy, that count as decision
tokens (the top 20% of Wang et al. 2025)."""

ADVANTAGE_KEYS = ("mismatch/adv_diff_mean", "mismatch/adv_diff_corr")
"""Keys of ``advantage_metrics``."""

ENTROPY_KEYS = ("mismatch/k3_decision", "mismatch/k3_rest")
"""Keys of ``decision_token_metrics``."""

HARM_CANDIDATES = ("rollout_corr/k3_kl", "mismatch/k3_seq", "mismatch/tv_mean", *ADVANTAGE_KEYS, *ENTROPY_KEYS)
"""Every candidate statistic of a mismatch's harm that a trainer logs each step (the first three
come from ``all_metrics``)."""


def _check_companion(x: torch.Tensor, p: Prepared, name: str, *, per_sequence: bool) -> torch.Tensor:
    """``x`` as float64 (B, T) with 0 off-mask; (B,) is broadcast over tokens when ``per_sequence``.
    Non-finite values at valid positions raise (they would make every statistic NaN)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    B, T = p.valid.shape
    one_per_row = per_sequence and tuple(x.shape) == (B,)
    if not one_per_row and tuple(x.shape) != (B, T):
        shapes = f"({B},) or ({B}, {T})" if per_sequence else f"({B}, {T})"
        raise UsageError(f"{name} must have shape {shapes} like the log-probs, got {tuple(x.shape)}")
    x = x.detach().to(device=p.valid.device, dtype=torch.float64)
    used = p.valid.any(-1) if one_per_row else p.valid  # (B,) rows with a valid token, or (B, T)
    bad = int((~torch.isfinite(x) & used).sum())
    if bad:
        where = "sequences with a valid token" if one_per_row else "valid (mask=1) positions"
        raise UsageError(f"{name} has {bad} non-finite value(s) at {where}")
    if one_per_row:
        x = x[:, None].expand(B, T)  # (B, T)
    return torch.where(p.valid, x, torch.zeros((), dtype=torch.float64, device=x.device))


# ------------------------------------------------------------------------------ advantage-weighted
def _advantage_sums(p: Prepared, adv: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mergeable statistics: token sums for the mean of A r, and the count, means and centred
    second moments over sequences (with a valid token) of a_b = mean_t A and s_b = sum_t r."""
    r = p.train - p.rollout  # (B, T), 0 off-mask
    n_b = p.validf.sum(-1)  # (B,) valid tokens per sequence
    has = n_b > 0  # (B,)
    a = (adv.sum(-1) / n_b.clamp(min=1))[has]  # (S,) per-sequence advantage
    s = r.sum(-1)[has]  # (S,) per-sequence log-ratio
    n = max(a.numel(), 1)
    sum_a, sum_s = a.sum(), s.sum()
    da, ds = a - sum_a / n, s - sum_s / n  # (S,) centred
    return {
        "adv_diff": (adv * r).sum(),
        "num_tokens": p.validf.sum(),
        "num_seqs": torch.tensor(float(a.numel()), dtype=torch.float64, device=r.device),
        "sum_a": sum_a,
        "sum_s": sum_s,
        "m2_a": da.dot(da),
        "m2_s": ds.dot(ds),
        "c_as": da.dot(ds),
    }


def advantage_sums(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                   advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mergeable statistics of ``advantage_metrics`` for one (B, T) batch; merge batches with
    ``merge_advantage_sums``, finish with ``advantage_metrics_from_sums``."""
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        return _advantage_sums(p, _check_companion(advantages, p, "advantages", per_sequence=True))


def merge_advantage_sums(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two batches' ``advantage_sums`` together: sums added, centred moments by Chan et al.'s
    pairwise update (exact in exact arithmetic, stable in floating point)."""
    na, nb = a["num_seqs"], b["num_seqs"]
    n = na + nb
    w = na * nb / n.clamp(min=1)
    d_a = b["sum_a"] / nb.clamp(min=1) - a["sum_a"] / na.clamp(min=1)  # difference of the two means
    d_s = b["sum_s"] / nb.clamp(min=1) - a["sum_s"] / na.clamp(min=1)
    out = {k: a[k] + b[k] for k in ("adv_diff", "num_tokens", "num_seqs", "sum_a", "sum_s")}
    out["m2_a"] = a["m2_a"] + b["m2_a"] + d_a * d_a * w
    out["m2_s"] = a["m2_s"] + b["m2_s"] + d_s * d_s * w
    out["c_as"] = a["c_as"] + b["c_as"] + d_a * d_s * w
    return out


def _advantage_values(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    denom = (s["m2_a"] * s["m2_s"]).sqrt()
    zero = torch.zeros((), dtype=torch.float64, device=denom.device)
    corr = torch.where(denom > 0, s["c_as"] / torch.where(denom > 0, denom, zero + 1), zero).clamp(-1.0, 1.0)
    return {"mismatch/adv_diff_mean": s["adv_diff"] / s["num_tokens"].clamp(min=1), "mismatch/adv_diff_corr": corr}


def advantage_metrics_from_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """``advantage_metrics`` from (merged) ``advantage_sums``."""
    with torch.no_grad():
        return _to_floats(_advantage_values(sums))


def advantage_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                      advantages: torch.Tensor) -> dict[str, float]:
    """The advantage-weighted mismatch (keys ``ADVANTAGE_KEYS``); ``advantages`` (B,) or (B, T).

    - ``mismatch/adv_diff_mean`` = sum over valid tokens of A * r / number of valid tokens
      (0 exactly at zero mismatch; its sign says whether pi favours the good answers' tokens more
      than mu did, > 0, or less).
    - ``mismatch/adv_diff_corr`` = Pearson correlation, over sequences with a valid token, of
      a_b (the sequence's advantage; the mean over its valid tokens for (B, T) advantages) and
      s_b = sum_t r; 0 when either has no variance (zero mismatch, or every A equal).
    """
    return advantage_metrics_from_sums(advantage_sums(train_logp, rollout_logp, mask, advantages))


# ------------------------------------------------------------------------------ decision tokens
def decision_token_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                           entropy: torch.Tensor, *, top_frac: float = DECISION_FRAC) -> dict[str, float]:
    """k3 on the high-entropy ("decision") tokens and on the rest (keys ``ENTROPY_KEYS``).

    ``entropy`` (B, T) is the trainer's next-token entropy at each response token. The decision
    tokens are the ceil(``top_frac`` x N) valid tokens of highest entropy among the batch's N (ties
    go to the earlier token in row-major order, so the split is deterministic); each key is the
    mean over its tokens of exp(r) - r - 1 (r clamped to +-20, as ``rollout_corr/k3_kl``), 0 for an
    empty set. Their token-weighted mean is ``rollout_corr/k3_kl``.
    """
    if isinstance(top_frac, bool) or not isinstance(top_frac, (int, float)) or not 0.0 < top_frac < 1.0:
        raise UsageError(f"top_frac must be a number in (0, 1), got {top_frac!r}")
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        return _to_floats(_decision_values(p, _check_companion(entropy, p, "entropy", per_sequence=False), top_frac))


def _decision_values(p: Prepared, entropy: torch.Tensor, top_frac: float) -> dict[str, torch.Tensor]:
    ent = entropy[p.valid]  # (N,) row-major
    rc = (p.train - p.rollout)[p.valid].clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (N,)
    N = rc.numel()
    k = math.ceil(top_frac * N)
    rc = rc[torch.argsort(ent, descending=True, stable=True)]  # (N,) decision tokens first
    k3 = torch.exp(rc) - rc - 1.0  # (N,)
    return {"mismatch/k3_decision": k3[:k].sum() / max(k, 1), "mismatch/k3_rest": k3[k:].sum() / max(N - k, 1)}


def harm_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                 advantages: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> dict[str, float]:
    """``advantage_metrics`` when ``advantages`` are given and ``decision_token_metrics`` when
    ``entropy`` is (an empty dict with neither); see those for the definitions."""
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)  # once for both (the trainer calls this every step)
        out: dict[str, torch.Tensor] = {}
        if advantages is not None:
            out.update(_advantage_values(_advantage_sums(p, _check_companion(advantages, p, "advantages",
                                                                             per_sequence=True))))
        if entropy is not None:
            out.update(_decision_values(p, _check_companion(entropy, p, "entropy", per_sequence=False), DECISION_FRAC))
        return _to_floats(out) if out else {}
