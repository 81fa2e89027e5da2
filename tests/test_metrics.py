"""timlab.metrics: hand-computed values for every key, equality classes, edge-case properties."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from timlab.metrics import (
    MISMATCH_KEYS,
    SAFETY_BOUND,
    VERL_KEYS,
    all_metrics,
    mismatch_by_position,
    mismatch_by_prob_bucket,
    mismatch_metrics,
    offpolicy_metrics,
    ratio_histogram,
)

NEG_INF = float("-inf")

# Two sequences, three positions; the second has a padded last position holding -inf / NaN.
# Per-token r = log pi - log mu:   row 0: [0, -0.5, 0.25]   row 1: [0, 1.0, (pad)]
LP = [[-1.0, -2.0, -0.5], [-0.2, -3.0, NEG_INF]]
LQ = [[-1.0, -1.5, -0.75], [-0.2, -4.0, float("nan")]]
MASK = [[1, 1, 1], [1, 1, 0]]


def _example(dtype=torch.float64):
    return torch.tensor(LP, dtype=dtype), torch.tensor(LQ, dtype=dtype), torch.tensor(MASK)


def _valid_rows():
    """Valid (log pi, log mu) per row, as plain floats: the hand computation's input."""
    return [
        [(LP[b][t], LQ[b][t]) for t in range(3) if MASK[b][t]] for b in range(2)
    ]


def test_verl_keys_hand_computed():
    m = offpolicy_metrics(*_example())
    assert list(m) == list(VERL_KEYS)
    # row means: log pi: -3.5/3, -1.6 ; log mu: -3.25/3, -2.1
    assert m["training_log_ppl"] == pytest.approx((3.5 / 3 + 1.6) / 2)
    assert m["training_ppl"] == pytest.approx((math.exp(3.5 / 3) + math.exp(1.6)) / 2)
    assert m["rollout_log_ppl"] == pytest.approx((3.25 / 3 + 2.1) / 2)
    assert m["rollout_ppl"] == pytest.approx((math.exp(3.25 / 3) + math.exp(2.1)) / 2)
    # token r = [0, -0.5, 0.25, 0, 1.0]
    assert m["kl"] == pytest.approx(-(0 - 0.5 + 0.25 + 0 + 1.0) / 5)  # -0.15
    k3 = sum(math.exp(r) - r - 1 for r in (0, -0.5, 0.25, 0, 1.0)) / 5
    assert m["k3_kl"] == pytest.approx(k3)
    # per-sequence log_ppl_diff = mean log mu - mean log pi = [0.25/3, -0.5]
    assert m["log_ppl_diff"] == pytest.approx((0.25 / 3 - 0.5) / 2)
    assert m["log_ppl_abs_diff"] == pytest.approx((0.25 / 3 + 0.5) / 2)
    assert m["log_ppl_diff_max"] == pytest.approx(0.25 / 3)
    assert m["log_ppl_diff_min"] == pytest.approx(-0.5)
    assert m["ppl_ratio"] == pytest.approx((math.exp(0.25 / 3) + math.exp(-0.5)) / 2)
    chi2_tok = sum(math.exp(2 * r) for r in (0, -0.5, 0.25, 0, 1.0)) / 5 - 1
    assert m["chi2_token"] == pytest.approx(chi2_tok)
    assert m["chi2_seq"] == pytest.approx((math.exp(2 * -0.25) + math.exp(2 * 1.0)) / 2 - 1)
    # a couple of literal numbers as an anchor against formula typos in this test itself
    assert m["kl"] == pytest.approx(-0.15)
    assert m["log_ppl_diff_min"] == -0.5


def test_extra_keys_hand_computed():
    m = mismatch_metrics(*_example(), num_micro_batches=2)
    assert list(m) == list(MISMATCH_KEYS)
    r = [0.0, -0.5, 0.25, 0.0, 1.0]
    a = [abs(x) for x in r]
    assert m["abs_diff_mean"] == pytest.approx(0.35)
    assert m["max_abs_diff"] == 1.0
    # sorted |r| = [0, 0, .25, .5, 1]; position 0.99 * 4 = 3.96 -> .5 + .96 * .5
    assert m["abs_diff_p99"] == pytest.approx(0.98)
    assert m["diff_mean"] == pytest.approx(0.15)
    pd = [abs(math.exp(p) - math.exp(q)) for row in _valid_rows() for p, q in row]
    mean_pd = sum(pd) / 5
    assert m["probs_diff_mean"] == pytest.approx(mean_pd)
    assert m["probs_diff_max"] == pytest.approx(max(pd))
    assert m["probs_diff_std"] == pytest.approx(math.sqrt(sum((x - mean_pd) ** 2 for x in pd) / 4))
    assert m["frac_bitwise_equal"] == pytest.approx(2 / 5)
    assert m["frac_tokens_different"] == pytest.approx(3 / 5)
    assert m["log_ppl_abs_diff_sum"] == pytest.approx((0.25 + 1.0) / 2)  # |sum r| per row: .25, 1
    k3 = [math.exp(x) - x - 1 for x in r]
    assert m["k3_seq"] == pytest.approx(sum(k3) / 2)  # two rows with valid tokens
    assert m["k3_seq"] == pytest.approx(offpolicy_metrics(*_example())["k3_kl"] * 5 / 2)  # k3 x mean length
    assert m["num_tokens"] == 5.0
    w = [math.exp(x) for x in r]
    mw = sum(w) / 5
    assert m["ess"] == pytest.approx(mw * mw / (sum(x * x for x in w) / 5))
    chunk0, chunk1 = sum(w[:3]) / 3, sum(w[3:]) / 2
    assert m["ratio_var_across_micro_batches"] == pytest.approx(((chunk0 - chunk1) / 2) ** 2)
    assert mismatch_metrics(*_example())["ratio_var_across_micro_batches"] == 0.0
    assert sum(a) / 5 == pytest.approx(m["abs_diff_mean"])


def test_all_metrics_namespaces_both_sets():
    m = all_metrics(*_example(), num_micro_batches=2)
    expected = [f"rollout_corr/{k}" for k in VERL_KEYS] + [f"mismatch/{k}" for k in MISMATCH_KEYS]
    assert list(m) == expected
    assert all(type(v) is float for v in m.values())
    off = offpolicy_metrics(*_example())
    extra = mismatch_metrics(*_example(), num_micro_batches=2)
    assert all(m[f"rollout_corr/{k}"] == v for k, v in off.items())
    assert all(m[f"mismatch/{k}"] == v for k, v in extra.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bitwise_equal_inputs_give_zero_mismatch(dtype):
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 7, generator=g).to(dtype) * 5  # (B, T)
    mask = torch.rand(4, 7, generator=g) > 0.3
    m = all_metrics(lp, lp.clone(), mask, num_micro_batches=2)
    assert m["rollout_corr/kl"] == 0.0
    assert m["rollout_corr/k3_kl"] == 0.0
    assert m["rollout_corr/chi2_token"] == 0.0
    assert m["rollout_corr/chi2_seq"] == 0.0
    assert m["rollout_corr/log_ppl_abs_diff"] == 0.0
    assert m["rollout_corr/ppl_ratio"] == 1.0
    assert m["rollout_corr/training_ppl"] == m["rollout_corr/rollout_ppl"]
    assert m["mismatch/frac_bitwise_equal"] == 1.0
    assert m["mismatch/max_abs_diff"] == 0.0
    assert m["mismatch/frac_tokens_different"] == 0.0
    assert m["mismatch/probs_diff_max"] == 0.0
    assert m["mismatch/ess"] == 1.0
    assert m["mismatch/ratio_var_across_micro_batches"] == 0.0


def test_bitwise_equal_is_exact_not_approximate():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float32)
    lq = torch.nextafter(lp, torch.zeros_like(lp))  # one ulp away
    m = mismatch_metrics(lp, lq, torch.ones(1, 2))
    assert m["frac_bitwise_equal"] == 0.0
    assert 0.0 < m["max_abs_diff"] < 1e-6
    assert m["frac_tokens_different"] == 0.0  # below TorchTitan's 1e-6 tolerance


def test_mask_values_and_dtypes_are_equivalent():
    lp, lq, mask = _example()
    base = all_metrics(lp, lq, mask)
    assert all_metrics(lp, lq, mask.bool()) == base
    assert all_metrics(lp, lq, mask.float()) == base
    # garbage at masked-out positions changes nothing
    lp2, lq2 = lp.clone(), lq.clone()
    lp2[1, 2], lq2[1, 2] = 123.0, -1e30
    assert all_metrics(lp2, lq2, mask) == base


def test_empty_rows_are_excluded_from_sequence_means():
    lp, lq, mask = _example()
    pad = torch.full((1, 3), NEG_INF, dtype=torch.float64)
    lp3, lq3 = torch.cat([lp, pad]), torch.cat([lq, pad])  # (3, 3), last row all padding
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    got = all_metrics(lp3, lq3, mask3)
    base = all_metrics(lp, lq, mask)
    assert got.keys() == base.keys()
    for k in base:
        assert got[k] == pytest.approx(base[k], rel=1e-12, abs=1e-15), k


def test_no_valid_token_returns_zeros():
    lp = torch.full((2, 4), NEG_INF)
    m = all_metrics(lp, lp, torch.zeros(2, 4))
    assert set(m.values()) == {0.0}
    assert offpolicy_metrics(lp, lp, torch.zeros(2, 4)) == {k: 0.0 for k in VERL_KEYS}


def test_shape_mismatch_names_shapes():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"train_logp \(2, 3\), rollout_logp \(2, 4\), mask \(2, 3\)"):
        offpolicy_metrics(lp, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"2-D"):
        mismatch_metrics(torch.zeros(3), torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="num_micro_batches"):
        all_metrics(lp, lp, torch.ones(2, 3), num_micro_batches=0)


@pytest.mark.parametrize("which", ["train_logp", "rollout_logp"])
@pytest.mark.parametrize("bad", [NEG_INF, float("inf"), float("nan")])
def test_nonfinite_at_valid_position_names_the_input(which, bad):
    lp, lq, mask = _example()
    (lp if which == "train_logp" else lq)[0, 1] = bad
    for fn in (offpolicy_metrics, mismatch_metrics, all_metrics, ratio_histogram):
        with pytest.raises(ValueError, match=f"^{which} has 1 non-finite"):
            fn(lp, lq, mask)


def test_huge_ratios_are_clamped():
    lp = torch.tensor([[0.0, -1e4], [-1e4, 0.0]], dtype=torch.float64)
    lq = torch.tensor([[-1e4, 0.0], [-1e4, -1e4]], dtype=torch.float64)
    m = all_metrics(lp, lq, torch.ones(2, 2))
    assert all(math.isfinite(v) for v in m.values())
    # token ratios clamp at exp(+-20): chi2_token = mean(exp(2 * clamp(r))) - 1
    e = [math.exp(2 * SAFETY_BOUND), math.exp(-2 * SAFETY_BOUND), 1.0, math.exp(2 * SAFETY_BOUND)]
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(e) / 4 - 1)
    assert m["mismatch/max_abs_diff"] == 1e4  # |r| itself is not clamped
    # k3 on the clamped r: exp(rc) - rc - 1 for rc = 20, -20, 0, 20
    assert m["rollout_corr/k3_kl"] == pytest.approx(
        (2 * (math.exp(20) - 21) + (math.exp(-20) + 19) + 0) / 4
    )


def test_length_one_sequences():
    lp = torch.tensor([[-0.5], [-2.0]])
    lq = torch.tensor([[-0.7], [-2.0]])
    m = all_metrics(lp, lq, torch.ones(2, 1))
    assert m["rollout_corr/log_ppl_diff_max"] == 0.0
    assert m["rollout_corr/log_ppl_diff_min"] == pytest.approx(-0.2, abs=1e-6)
    assert m["mismatch/abs_diff_p99"] == pytest.approx(0.2 * 0.99, abs=1e-6)  # between 0 and .2
    assert m["mismatch/probs_diff_std"] == pytest.approx(
        abs(math.exp(-0.5) - math.exp(-0.7)) / math.sqrt(2), rel=1e-5
    )
    one = all_metrics(lp[:1], lq[:1], torch.ones(1, 1))
    assert one["mismatch/probs_diff_std"] == 0.0  # a single token: std defined as 0
    assert one["mismatch/abs_diff_p99"] == pytest.approx(0.2, abs=1e-6)


# --- properties on edge cases -------------------------------------------------------------

_logp = st.one_of(
    st.floats(min_value=-60.0, max_value=0.0),
    st.floats(min_value=-1e30, max_value=-1e3),  # huge ratios against the other side
    st.just(0.0),
)


@st.composite
def _batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 5))
    lp = draw(st.lists(_logp, min_size=B * T, max_size=B * T))
    lq = draw(st.lists(_logp, min_size=B * T, max_size=B * T))
    m = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
    to = lambda xs, dt: torch.tensor(xs, dtype=dt).reshape(B, T)  # noqa: E731
    mask = to(m, torch.bool)
    lp_t, lq_t = to(lp, torch.float32), to(lq, torch.float32)
    # padding holds -inf, as real batches often do
    lp_t = torch.where(mask, lp_t, torch.tensor(NEG_INF))
    return lp_t, lq_t, mask


@settings(max_examples=60, deadline=None)
@given(_batches(), st.integers(1, 5))
def test_property_outputs_finite(batch, k):
    lp, lq, mask = batch
    m = all_metrics(lp, lq, mask, num_micro_batches=k)
    assert all(math.isfinite(v) for v in m.values()), m
    n = int(mask.sum())
    assert m["mismatch/num_tokens"] == n
    if n:
        assert 0.0 < m["mismatch/ess"] <= 1.0 + 1e-12
        assert 0.0 <= m["mismatch/frac_bitwise_equal"] <= 1.0
        assert m["rollout_corr/k3_kl"] >= 0.0
        lo, mid, hi = (m[f"rollout_corr/log_ppl_diff{s}"] for s in ("_min", "", "_max"))
        assert lo <= mid <= hi
        assert m["mismatch/abs_diff_p99"] <= m["mismatch/max_abs_diff"]
    for fn in (ratio_histogram, mismatch_by_position, mismatch_by_prob_bucket):
        out = fn(lp, lq, mask)
        json.dumps(out, allow_nan=False)
        assert sum(out["counts"]) == n


@settings(max_examples=40, deadline=None)
@given(_batches(), st.integers(0, 3), st.integers(0, 4))
def test_property_neg_inf_at_valid_position_raises(batch, b, t):
    lp, lq, mask = batch
    b, t = b % lp.shape[0], t % lp.shape[1]
    mask = mask.clone()
    mask[b, t] = True
    lq = lq.clone()
    lq[b, t] = NEG_INF
    with pytest.raises(ValueError, match="rollout_logp"):
        all_metrics(lp.nan_to_num(neginf=-1.0), lq, mask)


# --- distribution helpers -----------------------------------------------------------------


def test_ratio_histogram_counts():
    h = ratio_histogram(*_example())
    edges, counts = h["edges"], h["counts"]
    assert len(counts) == len(edges) - 1 and h["num_tokens"] == 5
    # r = 0, 0 -> [-1e-6, 1e-6); -0.5 -> [-1, -0.1); 0.25 -> [0.1, 1); 1.0 -> [1, 20]
    expect = {edges.index(-1e-6): 2, edges.index(-1.0): 1, edges.index(0.1): 1, edges.index(1.0): 1}
    assert counts == [expect.get(i, 0) for i in range(len(counts))]
    h2 = ratio_histogram(*_example(), bins=[-0.1, 0.0, 0.1])  # out-of-range go to the end bins
    assert h2 == {"edges": [-0.1, 0.0, 0.1], "counts": [1, 4], "num_tokens": 5}
    with pytest.raises(ValueError, match="bins"):
        ratio_histogram(*_example(), bins=[1.0, 0.0])
    json.dumps(h, allow_nan=False)


def test_mismatch_by_position():
    # left-padded row 1: positions count valid tokens, so its first token is position 0
    lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [9.9, -1.0, -1.0, -1.0]])
    lq = torch.tensor([[-1.1, -1.0, -1.3, -1.0], [0.0, -1.2, -1.0, -1.4]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    out = mismatch_by_position(lp, lq, mask, num_buckets=2)
    assert out["edges"] == [0, 2, 4]
    assert out["counts"] == [4, 3]
    # bucket 0: |r| = .1, 0, .2, 0 ; bucket 1: .3, 0, .4
    assert out["mean_abs_diff"] == pytest.approx([0.075, 0.7 / 3], rel=1e-5)
    more = mismatch_by_position(lp, lq, mask, num_buckets=8)  # more buckets than positions
    assert more["counts"] == [2, 0, 2, 0, 2, 0, 1, 0]
    assert more["mean_abs_diff"][1] == 0.0 and more["mean_abs_diff"][7] == 0.0
    with pytest.raises(ValueError, match="num_buckets"):
        mismatch_by_position(lp, lq, mask, num_buckets=0)


def test_mismatch_by_prob_bucket():
    lp = torch.tensor([[math.log(0.0005), math.log(0.05), math.log(0.95), 0.0]], dtype=torch.float64)
    lq = lp + torch.tensor([[0.5, -0.1, 0.02, 0.0]], dtype=torch.float64)
    out = mismatch_by_prob_bucket(lp, lq, torch.ones(1, 4))
    assert out["edges"] == [0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0]
    assert out["counts"] == [1, 0, 1, 0, 0, 2]  # p = 1.0 falls in the closed last bucket
    assert out["mean_abs_diff"] == pytest.approx([0.5, 0.0, 0.1, 0.0, 0.0, 0.01])


def test_pure_layer_imports_nothing_else_from_timlab():
    code = (
        "import sys, timlab.metrics, timlab.remedies, timlab.schedulers; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('timlab'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    allowed = ("timlab.metrics", "timlab.remedies", "timlab.schedulers")
    extra = [m for m in out.split() if m not in ("timlab", "timlab.registry", "timlab.errors") and not m.startswith(allowed)]
    assert extra == []


def test_mismatch_by_length_hand_computed():
    from timlab.metrics import mismatch_by_length

    train = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    roll = torch.tensor([[0.1, 0.1, 0.0, 0.0], [0.1, -0.1, 0.2, 0.2], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = mismatch_by_length(train, roll, mask, edges=(1, 3, 5))
    assert out["counts"] == [1, 1]  # the empty row is left out
    assert out["mean_abs_sum_diff"] == pytest.approx([0.2, 0.4])  # |-0.2|, |-(0.1-0.1+0.2+0.2)|
    assert out["mean_abs_diff"] == pytest.approx([0.1, 0.15])


def test_sums_merged_over_batches_give_the_one_batch_metrics():
    # metric_sums / breakdown_sums of row blocks, merged in order, give all_metrics and the four
    # breakdowns of the whole batch: exactly for one block, to the last bits for several
    from timlab.metrics import (
        breakdown_sums,
        breakdowns_from_sums,
        merge_breakdown_sums,
        merge_metric_sums,
        metric_sums,
        metrics_from_sums,
        mismatch_by_length,
    )

    g = torch.Generator().manual_seed(0)
    train = -torch.rand(11, 9, generator=g, dtype=torch.float64) * 3  # (B, T)
    roll = train + torch.randn(11, 9, generator=g, dtype=torch.float64) * 1e-2
    roll[:, :2] = train[:, :2]  # some bitwise-equal tokens
    mask = (torch.rand(11, 9, generator=g) > 0.3).int()
    mask[4] = 0  # a row with no valid token
    whole = {"histogram": ratio_histogram(train, roll, mask), "by_position": mismatch_by_position(train, roll, mask),
             "by_prob": mismatch_by_prob_bucket(train, roll, mask), "by_length": mismatch_by_length(train, roll, mask)}
    for k in (1, 4):
        assert metrics_from_sums(metric_sums(train, roll, mask), num_micro_batches=k) == all_metrics(
            train, roll, mask, num_micro_batches=k)
    assert breakdowns_from_sums(breakdown_sums(train, roll, mask), num_position_buckets=8) == whole
    blocks = [(0, 3), (3, 4), (4, 5), (5, 11)]  # a block may hold no valid token
    parts = [(train[a:b], roll[a:b], mask[a:b]) for a, b in blocks]
    ms, bs = metric_sums(*parts[0]), breakdown_sums(*parts[0])
    for p in parts[1:]:
        ms, bs = merge_metric_sums(ms, metric_sums(*p)), merge_breakdown_sums(bs, breakdown_sums(*p))
    for k in (1, 4):
        got, want = metrics_from_sums(ms, num_micro_batches=k), all_metrics(train, roll, mask, num_micro_batches=k)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    got = breakdowns_from_sums(bs, num_position_buckets=8)
    for key, w in whole.items():
        assert got[key]["counts"] == w["counts"]
        for field in ("mean_abs_diff", "mean_abs_sum_diff"):
            if field in w:
                assert got[key][field] == pytest.approx(w[field], rel=1e-12)


def test_routing_metrics_hand_computed():
    """Two sparse layers, 1 x 4 positions, top-2; the last position is masked out. Layer 0 flips at
    position 1 ({0,1} vs {0,2}); position 2 lists the same set in another order (no flip); layer 3
    flips at positions 1 and 2, and at the masked position 3 (not counted)."""
    from timlab.metrics import router_flips, routing_metrics

    a = torch.tensor([[[[0, 1], [0, 1], [2, 3], [4, 5]]], [[[1, 2], [1, 2], [1, 2], [1, 2]]]])  # (L=2, B=1, T=4, k=2)
    b = torch.tensor([[[[0, 1], [0, 2], [3, 2], [4, 5]]], [[[1, 2], [1, 3], [0, 2], [0, 1]]]])
    assert router_flips(a, b).tolist() == [[[False, True, False, False]], [[False, True, True, True]]]
    mask = torch.tensor([[True, True, True, False]])
    abs_diff = torch.tensor([[0.1, 0.5, 0.3, 9.0]])
    m = routing_metrics(a, b, mask, abs_diff, layers=[0, 3])
    assert m["router_flip_frac_by_layer"] == {0: pytest.approx(1 / 3), 3: pytest.approx(2 / 3)}
    assert m["mismatch/router_flip_frac"] == pytest.approx(0.5)
    assert m["mismatch/router_flip_frac_any_layer"] == pytest.approx(2 / 3)
    assert m["mismatch/abs_diff_mean_router_flipped"] == pytest.approx(0.4)
    assert m["mismatch/abs_diff_mean_router_unflipped"] == pytest.approx(0.1)
    assert (m["router_flipped_tokens"], m["router_unflipped_tokens"]) == (2, 1)
    with pytest.raises(ValueError, match="differ in shape"):
        router_flips(a, b[:, :, :3])


@pytest.mark.parametrize("G,B,T", [(1, 1, 1), (7, 1, 3), (5, 4, 33), (3, 16, 257), (2, 64, 1100)])
def test_group_metric_sums_equal_each_group_bit_for_bit(G, B, T):
    # timlab analyze's per-step table computes G steps at once; each must be its own batch's numbers
    from timlab.metrics import group_metric_sums, metric_sums, metrics_from_group_sums

    g = torch.Generator().manual_seed(G * 1000 + B * 10 + T)
    train = -torch.rand(G, B, T, generator=g, dtype=torch.float64) * 3
    roll = torch.where(torch.rand(G, B, T, generator=g) < 0.6, train, train + 0.05 * torch.randn(G, B, T, generator=g,
                                                                                                    dtype=torch.float64))
    mask = torch.rand(G, B, T, generator=g) < 0.8
    mask[..., 0] = True
    sums = group_metric_sums(train, roll, mask)
    per_group = [metric_sums(train[k], roll[k], mask[k]) for k in range(G)]
    for key, v in sums.items():
        if key == "abs_values":
            assert torch.equal(v, torch.cat([s[key] for s in per_group]))
        else:
            assert torch.equal(v, torch.stack([s[key] for s in per_group])), key
    counts = torch.stack([s["num_tokens"] for s in per_group]).to(torch.int64)
    groups = torch.arange(G).repeat_interleave(counts)
    flip = torch.randperm(groups.numel(), generator=g)  # any order of the values
    sums["abs_values"], groups = sums["abs_values"][flip], groups[flip]
    assert metrics_from_group_sums(sums, groups) == [all_metrics(train[k], roll[k], mask[k]) for k in range(G)]
