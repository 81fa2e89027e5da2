"""Scalar training-inference mismatch metrics: verl's off-policy set plus timlab's extras.

``offpolicy_metrics`` reproduces verl's ``compute_offpolicy_metrics``
(verl/trainer/ppo/rollout_corr_helper.py) key for key; ``mismatch_metrics`` adds the numbers other
stacks and the Beyond-Precision paper report (TRL, TorchTitan, slime, verl's probs-diff);
``all_metrics`` namespaces both (``rollout_corr/*``, ``mismatch/*``) and is what trainers log.
``metric_sums`` / ``merge_metric_sums`` / ``metrics_from_sums`` compute the same over batches
streamed one at a time (``timlab analyze`` on files larger than memory); ``group_metric_sums`` /
``metrics_from_group_sums`` compute it for many groups of rows at once (analyze's per-step table).

Notation: r = log pi - log mu per valid token (trainer minus rollout), w = exp(clamp(r, +-20)).

Where this departs from verl (all departures only touch cases where verl returns inf/NaN or
counts padding rows):
- Sequences with no valid token are left out of every per-sequence mean (verl's masked_mean
  gives them a mean log-prob of 0 and averages them in). If the whole batch has no valid token,
  every metric is 0.0 (``mismatch/num_tokens`` == 0 says why); verl asserts instead.
- ``k3_kl`` is computed on r clamped to [-SAFETY_BOUND, SAFETY_BOUND] (exp(rc) - rc - 1, which
  stays >= 0 like the true K3); verl does not clamp. Identical for |r| <= 20.
- Perplexity exponents (training/rollout ppl, ppl_ratio) are clamped at PPL_LOG_BOUND = 600 so
  float64 stays finite, also summed over sequences for the mean; verl would return inf there.
- Everything is computed in float64 under no_grad and returned as Python floats with one host
  sync (verl computes in the input dtype and calls .item() per key).
- A non-finite log-prob at a valid position raises ValueError (see ``_inputs``).

The Beyond-Precision paper (Eq. 7-8) defines log-ppl as a *sum* over tokens; verl uses per-token
means. Both are reported: ``rollout_corr/log_ppl_abs_diff`` (means) and
``mismatch/log_ppl_abs_diff_sum`` (sums; grows with length by construction).
"""

from __future__ import annotations

import torch

from timlab.errors import UsageError
from timlab.metrics._inputs import PPL_LOG_BOUND, SAFETY_BOUND, Prepared, check_inputs

VERL_KEYS = (
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "kl",
    "k3_kl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
)
"""Keys of ``offpolicy_metrics``: verl's names, unprefixed (``all_metrics`` adds ``rollout_corr/``)."""

MISMATCH_KEYS = (
    "abs_diff_mean",
    "exp_abs_diff_mean",
    "abs_diff_p99",
    "diff_mean",
    "probs_diff_mean",
    "probs_diff_max",
    "probs_diff_std",
    "tv_mean",
    "frac_bitwise_equal",
    "max_abs_diff",
    "log_ppl_abs_diff_sum",
    "k3_seq",
    "num_tokens",
    "frac_tokens_different",
    "ess",
    "ratio_var_across_micro_batches",
)
"""Keys of ``mismatch_metrics`` (``all_metrics`` adds ``mismatch/``)."""

DIFFERENT_TOKEN_TOL = 1e-6
"""|r| above this counts a token as different (TorchTitan's ``ratio_tokens_different``)."""


def _sums(p: Prepared) -> dict[str, torch.Tensor]:
    """Every metric's statistics over the rows of ``p``, in a form that ``merge_metric_sums``
    combines across batches: sums, counts, max/min, and the per-row and per-token values the
    micro-batch variance and the 99th percentile need.

    ``p`` holds (B, T) tensors, or (G, B, T): G groups of B rows each, reduced group by group
    (every statistic gets a leading G; ``abs_values`` stays flat, group-major). A group's values
    are those of its own (B, T) batch bit for bit: the same reductions over the same B x T
    contiguous values (``timlab analyze`` computes every step at once this way)."""
    rows, cells = -1, (-2, -1)  # reduce a row over its tokens; a batch over its rows and tokens
    lead = p.validf.shape[:-2]  # () or (G,)
    n_b = p.validf.sum(rows)  # (..., B) valid tokens per sequence
    has = n_b > 0  # (..., B)
    zero = torch.zeros((), dtype=torch.float64, device=n_b.device)

    def seq_sum(x: torch.Tensor) -> torch.Tensor:  # sum of per-sequence values x (..., B) over sequences with a token
        return torch.where(has, x, zero).sum(rows)

    def cell_max(x: torch.Tensor) -> torch.Tensor:  # max over rows and tokens; 0 for an empty batch
        return x.amax(cells) if x.numel() else zero.expand(lead)

    mean_lp = p.train.sum(rows) / n_b.clamp(min=1)  # (..., B) mean_t log pi
    mean_lq = p.rollout.sum(rows) / n_b.clamp(min=1)  # (..., B) mean_t log mu
    r = p.train - p.rollout  # (..., B, T), 0 off-mask
    rc = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    a = r.abs()
    w = torch.exp(rc) * p.validf  # (..., B, T) token ratios, 0 off-mask
    log_ppl_diff = mean_lq - mean_lp  # (..., B) = log(training_ppl_b / rollout_ppl_b)
    seq_r_sum = r.sum(rows)  # (..., B)
    probs_diff = (
        torch.exp(p.train.clamp(max=PPL_LOG_BOUND)) - torch.exp(p.rollout.clamp(max=PPL_LOG_BOUND))
    ).abs() * p.validf  # (..., B, T)
    n_tok = p.validf.sum(cells)  # (...)
    probs_mean = probs_diff.sum(cells) / n_tok.clamp(min=1)  # (...)
    inf = torch.full((*lead, 1), float("inf"), dtype=torch.float64, device=n_b.device)  # (..., 1)
    return {
        "num_seqs": has.sum(rows),
        "num_tokens": n_tok,
        "training_ppl": seq_sum(torch.exp((-mean_lp).clamp(max=PPL_LOG_BOUND))),
        "training_log_ppl": seq_sum(-mean_lp),
        "rollout_ppl": seq_sum(torch.exp((-mean_lq).clamp(max=PPL_LOG_BOUND))),
        "rollout_log_ppl": seq_sum(-mean_lq),
        "kl": (-r).sum(cells),
        "k3_kl": ((torch.exp(rc) - rc - 1.0) * p.validf).sum(cells),
        "log_ppl_diff": seq_sum(log_ppl_diff),
        "log_ppl_abs_diff": seq_sum(log_ppl_diff.abs()),
        "log_ppl_diff_max": torch.cat([torch.where(has, log_ppl_diff, -inf), -inf], -1).amax(rows),  # -inf: no sequence
        "log_ppl_diff_min": torch.cat([torch.where(has, log_ppl_diff, inf), inf], -1).amin(rows),
        "ppl_ratio": seq_sum(torch.exp(log_ppl_diff.clamp(max=PPL_LOG_BOUND))),
        "chi2_token": (torch.exp(2.0 * rc) * p.validf).sum(cells),
        "chi2_seq": seq_sum(torch.exp(2.0 * seq_r_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND))),
        "abs_diff": a.sum(cells),
        "exp_abs_diff": (torch.exp(a.clamp(max=SAFETY_BOUND)) * p.validf).sum(cells),
        "abs_values": a[p.valid],  # (N,) for the percentile
        "diff": r.sum(cells),
        "probs_diff": probs_diff.sum(cells),
        "probs_diff_m2": (((probs_diff - probs_mean[..., None, None]) ** 2) * p.validf).sum(cells),  # about this batch's mean
        "probs_diff_max": cell_max(probs_diff),
        "tv": (torch.expm1(rc).abs() * p.validf).sum(cells),  # sum of |pi/mu - 1| over sampled tokens
        "bitwise_equal": ((p.train == p.rollout) & p.valid).sum(cells),
        "max_abs_diff": cell_max(a),  # a >= 0 and 0 off-mask, so no masking needed
        "log_ppl_abs_diff_sum": seq_sum(seq_r_sum.abs()),
        "tokens_different": ((a > DIFFERENT_TOKEN_TOL) & p.valid).sum(cells),
        "w": w.sum(cells),
        "w2": (w * w).sum(cells),
        "row_w": w.sum(rows),  # (..., B) for the micro-batch variance
        "row_tokens": n_b,  # (..., B)
    }


_MERGE_MAX = ("log_ppl_diff_max", "probs_diff_max", "max_abs_diff")
_MERGE_MIN = ("log_ppl_diff_min",)
_MERGE_CAT = ("abs_values", "row_w", "row_tokens")


def merge_metric_sums(a: dict, b: dict) -> dict:
    """The statistics of two batches' rows together (b's rows after a's); ``metric_sums`` says
    what they are. Sums are added, so merged values can differ from one batch's in the last bits."""
    out = {}
    for k, x in a.items():
        y = b[k]
        if k in _MERGE_MAX:
            out[k] = torch.maximum(x, y)
        elif k in _MERGE_MIN:
            out[k] = torch.minimum(x, y)
        elif k in _MERGE_CAT:  # kept as a list of pieces, joined once by metrics_from_sums
            out[k] = (x if isinstance(x, list) else [x]) + (y if isinstance(y, list) else [y])
        elif k == "probs_diff_m2":  # Chan et al.'s pairwise update of the sum of squared deviations
            na, nb = a["num_tokens"], b["num_tokens"]
            delta = b["probs_diff"] / nb.clamp(min=1) - a["probs_diff"] / na.clamp(min=1)
            out[k] = x + y + delta * delta * na * nb / (na + nb).clamp(min=1)
        else:
            out[k] = x + y
    return out


def metric_sums(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mergeable statistics of ``all_metrics`` for one (B, T) batch: merge batches with
    ``merge_metric_sums``, turn the result into metrics with ``metrics_from_sums``. For one batch,
    ``metrics_from_sums(metric_sums(...))`` is ``all_metrics(...)`` bit for bit. Holds 8 bytes per
    valid token (|r|, for the exact 99th percentile) and 16 per row; the rest are scalars."""
    with torch.no_grad():
        return _sums(check_inputs(train_logp, rollout_logp, mask))


def group_metric_sums(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``metric_sums`` of G batches of equal shape at once: inputs (G, B, T). Every statistic gets
    a leading G and equals ``metric_sums`` of that group's (B, T) batch bit for bit, except
    ``abs_values``: one flat (N,) tensor, group-major (group g's pieces are ``num_tokens[g]``
    long). ``metrics_from_group_sums`` turns them into metrics; ``merge_metric_sums`` merges two
    groups' statistics element-wise (leave out the concatenated keys, ``_MERGE_CAT``)."""
    if train_logp.dim() != 3:
        raise UsageError(f"train_logp must be 3-D (G, B, T), got shape {tuple(train_logp.shape)}")
    G, B, T = train_logp.shape
    flat = [x.reshape(G * B, T) for x in (train_logp, rollout_logp, mask)]
    with torch.no_grad():
        return _sums(Prepared(*(t.reshape(G, B, T) for t in check_inputs(*flat))))


def _quantile(vals: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolated q-quantile (numpy's default) of vals (N,), N >= 1.

    Uses two kthvalue calls instead of torch.quantile, which refuses inputs over 2**24 elements.
    """
    n = vals.numel()
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    v_lo = torch.kthvalue(vals, lo + 1).values
    v_hi = torch.kthvalue(vals, hi + 1).values
    return v_lo + (pos - lo) * (v_hi - v_lo)


def _group_quantile(vals: torch.Tensor, group: torch.Tensor, num_groups: int, q: float) -> torch.Tensor:
    """(G,) ``_quantile`` of each group's values, bit for bit: ``vals`` (N,) float64, ``group``
    (N,) int64 in [0, G). A group without values gets 0."""
    order = torch.argsort(vals, stable=True)
    order = order[torch.argsort(group[order], stable=True)]  # group-major, ascending within a group
    v = vals[order]  # (N,)
    counts = torch.bincount(group, minlength=num_groups)  # (G,)
    start = counts.cumsum(0) - counts  # (G,) first value of each group in v
    pos = q * (counts - 1).clamp(min=0).to(torch.float64)  # (G,) the same float64 product as q * (n - 1)
    lo = pos.floor().to(torch.int64)  # int(pos): pos >= 0
    hi = torch.minimum(lo + 1, (counts - 1).clamp(min=0))
    top = max(v.numel() - 1, 0)
    v_lo = v[(start + lo).clamp(max=top)] if v.numel() else torch.zeros(num_groups, dtype=torch.float64)
    v_hi = v[(start + hi).clamp(max=top)] if v.numel() else v_lo
    out = v_lo + (pos - lo.to(torch.float64)) * (v_hi - v_lo)
    return torch.where(counts > 0, out, torch.zeros((), dtype=torch.float64))


def _micro_batch_ratio_var(row_w: torch.Tensor, row_tokens: torch.Tensor, num_micro_batches: int) -> torch.Tensor:
    """Population variance, across contiguous row chunks, of each chunk's mean token ratio.

    ``row_w`` (B,) is each row's sum of w over valid tokens, ``row_tokens`` (B,) its valid tokens.
    Rows are split like ``torch.tensor_split(B, num_micro_batches)``; chunks with no valid token
    are left out; one (non-empty) chunk gives 0.
    """
    B = row_w.shape[0]
    k = num_micro_batches
    sizes = [B // k + 1] * (B % k) + [B // k] * (k - B % k)
    sizes_t = torch.tensor(sizes, device=row_w.device)  # (k,)
    ids = torch.repeat_interleave(torch.arange(k, device=row_w.device), sizes_t)  # (B,) chunk of each row
    zeros = torch.zeros(k, dtype=torch.float64, device=row_w.device)
    chunk_sum = zeros.index_add(0, ids, row_w)  # (k,)
    chunk_n = zeros.index_add(0, ids, row_tokens)  # (k,)
    nonempty = (chunk_n > 0).to(torch.float64)  # (k,)
    n_chunks = nonempty.sum().clamp(min=1)
    chunk_mean = chunk_sum / chunk_n.clamp(min=1)  # (k,)
    grand = (chunk_mean * nonempty).sum() / n_chunks
    return (((chunk_mean - grand) ** 2) * nonempty).sum() / n_chunks


def _verl_values(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    n_seq = s["num_seqs"].clamp(min=1).to(torch.float64)
    n_tok = s["num_tokens"].clamp(min=1)
    values = {k: s[k] / n_seq for k in ("training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl",
                                         "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio")}
    values.update({
        "kl": s["kl"] / n_tok,
        "k3_kl": s["k3_kl"] / n_tok,
        "log_ppl_diff_max": s["log_ppl_diff_max"],
        "log_ppl_diff_min": s["log_ppl_diff_min"],
        "chi2_token": s["chi2_token"] / n_tok - 1.0,
        "chi2_seq": s["chi2_seq"] / n_seq - 1.0,
    })
    return {k: values[k] for k in VERL_KEYS}


def _extra_values(s: dict[str, torch.Tensor], num_micro_batches: int, *, p99: torch.Tensor | None = None,
                  ratio_var: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """timlab's extras from the statistics; ``p99`` and ``ratio_var`` given: used as they are
    (``metrics_from_group_sums`` computes them group by group)."""
    n_seq = s["num_seqs"].clamp(min=1).to(torch.float64)
    n_tok = s["num_tokens"].clamp(min=1)
    w_mean = s["w"] / n_tok
    w2_mean = s["w2"] / n_tok
    return {
        "abs_diff_mean": s["abs_diff"] / n_tok,
        "exp_abs_diff_mean": s["exp_abs_diff"] / n_tok,
        "abs_diff_p99": _quantile(s["abs_values"], 0.99) if p99 is None else p99,
        "diff_mean": s["diff"] / n_tok,
        "probs_diff_mean": s["probs_diff"] / n_tok,
        "probs_diff_max": s["probs_diff_max"],
        "probs_diff_std": (s["probs_diff_m2"] / (s["num_tokens"] - 1).clamp(min=1)).sqrt(),
        "tv_mean": 0.5 * s["tv"] / n_tok,
        "frac_bitwise_equal": s["bitwise_equal"] / n_tok,
        "max_abs_diff": s["max_abs_diff"],
        "log_ppl_abs_diff_sum": s["log_ppl_abs_diff_sum"] / n_seq,
        "k3_seq": s["k3_kl"] / n_seq,  # sequences without a token add 0 to the sum and are not counted
        "num_tokens": s["num_tokens"],
        "frac_tokens_different": s["tokens_different"] / n_tok,
        "ess": w_mean * w_mean / w2_mean,
        "ratio_var_across_micro_batches": (_micro_batch_ratio_var(s["row_w"], s["row_tokens"], num_micro_batches)
                                           if ratio_var is None else ratio_var),
    }


def _to_floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """All scalars to Python floats with a single device->host transfer."""
    stacked = torch.stack([v.to(torch.float64).reshape(()) for v in values.values()])  # (K,)
    return dict(zip(values.keys(), (float(x) for x in stacked.tolist())))


def _check_micro_batches(num_micro_batches: int) -> None:
    if not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool) or num_micro_batches < 1:
        raise UsageError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}")


def offpolicy_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's off-policy diagnostics (keys in ``VERL_KEYS``), inputs (B, T).

    - ``training_ppl`` = mean_b exp(-mean_t log pi); ``training_log_ppl`` = mean_b(-mean_t log pi);
      ``rollout_ppl`` / ``rollout_log_ppl`` likewise with log mu.
    - ``kl`` = masked_mean(log mu - log pi); ``k3_kl`` = masked_mean(exp(r) - r - 1).
    - ``log_ppl_diff`` = mean_b(mean_t log mu - mean_t log pi); ``log_ppl_abs_diff`` = mean_b |.|;
      ``log_ppl_diff_max`` / ``_min`` over b; ``ppl_ratio`` = mean_b exp(log_ppl_diff_b).
    - ``chi2_token`` = masked_mean(exp(2 r)) - 1; ``chi2_seq`` = mean_b exp(2 sum_t r) - 1.
    """
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        if not p.valid.any():
            return {k: 0.0 for k in VERL_KEYS}
        return _to_floats(_verl_values(_sums(p)))


def mismatch_metrics(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_micro_batches: int = 1,
) -> dict[str, float]:
    """timlab's extra mismatch numbers (keys in ``MISMATCH_KEYS``), inputs (B, T).

    - ``abs_diff_mean`` / ``max_abs_diff`` / ``abs_diff_p99``: mean, max, 99th percentile (linear
      interpolation) of |r| over valid tokens.
    - ``exp_abs_diff_mean``: mean exp(|r|) (|r| clamped at 20), the quantity NeMo-RL's model
      onboarding checks against 1.05 (``token_mult_prob_error``).
    - ``diff_mean``: mean r (TorchTitan ``logprob_diff/mean``).
    - ``probs_diff_mean`` / ``_max`` / ``_std``: |exp(log pi) - exp(log mu)| (verl's
      ``training/rollout_probs_diff_*``; std is Bessel-corrected like torch.std, 0 for one token).
    - ``tv_mean``: 0.5 x mean |exp(r) - 1| (r clamped to +-20), the probability mass moved: an
      unbiased estimate, from the sampled tokens alone, of the mean over positions of the
      full-vocabulary total variation TV(pi, mu) = 0.5 sum_y |pi(y) - mu(y)| = 0.5 E_mu|pi/mu - 1|
      when the tokens were drawn from mu (temperature 1, no top-k / top-p; otherwise a TV under the
      sampler's weighting). ``probs_diff_mean`` is the sampled token's own |pi - mu| instead.
    - ``frac_bitwise_equal``: share of valid tokens whose two log-probs are the same value.
    - ``log_ppl_abs_diff_sum``: mean_b |sum_t log pi - sum_t log mu| (Beyond-Precision Eq. 8).
    - ``num_tokens``: number of valid tokens.
    - ``frac_tokens_different``: share with |r| > 1e-6 (TorchTitan ``ratio_tokens_different``).
    - ``ess``: 1 / mean((w / mean w)^2) over valid tokens, in (0, 1].
    - ``ratio_var_across_micro_batches``: rows split into ``num_micro_batches`` contiguous
      chunks; population variance of the chunk means of w (0.0 for one chunk).
    """
    _check_micro_batches(num_micro_batches)
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        if not p.valid.any():
            return {k: 0.0 for k in MISMATCH_KEYS}
        return _to_floats(_extra_values(_sums(p), num_micro_batches))


def all_metrics(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_micro_batches: int = 1,
) -> dict[str, float]:
    """Both sets, namespaced: ``rollout_corr/<VERL_KEYS>`` and ``mismatch/<MISMATCH_KEYS>``."""
    _check_micro_batches(num_micro_batches)
    with torch.no_grad():
        return metrics_from_sums(_sums(check_inputs(train_logp, rollout_logp, mask)), num_micro_batches=num_micro_batches)


def metrics_from_sums(sums: dict, *, num_micro_batches: int = 1) -> dict[str, float]:
    """``all_metrics`` from the (merged) statistics of ``metric_sums``; the micro-batches split
    the merged rows in order."""
    _check_micro_batches(num_micro_batches)
    with torch.no_grad():
        sums = {k: torch.cat(v) if isinstance(v, list) else v for k, v in sums.items()}
        if not sums["num_tokens"]:
            values = {f"rollout_corr/{k}": 0.0 for k in VERL_KEYS}
            values.update({f"mismatch/{k}": 0.0 for k in MISMATCH_KEYS})
            return values
        tensors = {f"rollout_corr/{k}": v for k, v in _verl_values(sums).items()}
        tensors.update({f"mismatch/{k}": v for k, v in _extra_values(sums, num_micro_batches).items()})
        return _to_floats(tensors)


def metrics_from_group_sums(sums: dict, abs_group: torch.Tensor) -> list[dict[str, float]]:
    """``metrics_from_sums`` (one micro-batch) of G groups at once, one dict per group, each equal
    to ``metrics_from_sums`` of that group's own statistics bit for bit. ``sums``: every key of
    ``metric_sums`` but the concatenated ones, each with a leading G (``group_metric_sums``, or
    several merged with ``merge_metric_sums``), plus ``abs_values`` (N,) in any order with
    ``abs_group`` (N,) int64 naming each value's group. One micro-batch holds every row, so
    ``mismatch/ratio_var_across_micro_batches`` is 0 (the variance of a single chunk mean)."""
    with torch.no_grad():
        G = sums["num_tokens"].shape[0]
        if not G:
            return []
        p99 = _group_quantile(sums["abs_values"], abs_group, G, 0.99)
        zero = torch.zeros(G, dtype=torch.float64)
        tensors = {f"rollout_corr/{k}": v for k, v in _verl_values(sums).items()}
        tensors.update({f"mismatch/{k}": v for k, v in _extra_values(sums, 1, p99=p99, ratio_var=zero).items()})
        has = sums["num_tokens"] > 0  # (G,) a group without a valid token gets 0.0 everywhere, as metrics_from_sums
        stacked = torch.stack([torch.where(has, v.to(torch.float64), zero) for v in tensors.values()])  # (K, G)
        keys = list(tensors)
        return [dict(zip(keys, col)) for col in stacked.T.tolist()]
