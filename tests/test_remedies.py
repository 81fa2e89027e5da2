"""timlab.remedies: IS weights equal hand-computed values for every level x mode, veto, stats."""

from __future__ import annotations

import math

import pytest
import torch

import timlab.metrics
from timlab.registry import UnknownNameError
from timlab.remedies import IS_LEVELS, IS_MODES, METRIC_KEYS, SAFETY_BOUND, is_weights

# r = log pi - log mu; row 0: [0.9, -0.5, 0.25], row 1: [-1.2, 0.1, pad]
LP = [[-0.1, -2.0, -0.5], [-2.2, -0.9, float("-inf")]]
LQ = [[-1.0, -1.5, -0.75], [-1.0, -1.0, float("nan")]]
MASK = [[1, 1, 1], [1, 1, 0]]
R = [[0.9, -0.5, 0.25], [-1.2, 0.1]]


def _example(requires_grad=False):
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=requires_grad)
    return lp, torch.tensor(LQ, dtype=torch.float64), torch.tensor(MASK)


def _rho_by_hand(level):
    """Per valid token rho, as nested lists, straight from the definitions."""
    if level == "token":
        return [[math.exp(x) for x in row] for row in R]
    if level == "sequence":
        return [[math.exp(sum(row))] * len(row) for row in R]
    return [[math.exp(sum(row) / len(row))] * len(row) for row in R]  # geometric


def _weight_by_hand(rho, mode, c, c_low):
    if mode == "none":
        return 1.0
    if mode == "truncate":
        return min(rho, c)
    if mode == "mask":
        return rho if rho <= c else 0.0
    return rho if c_low <= rho <= c else 0.0  # two_sided


def _pad(rows):
    return [rows[0], rows[1] + [0.0]]


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["none", "truncate", "mask", "two_sided"])
def test_weights_match_hand_computation(level, mode):
    c = 1.2  # low enough that every mode acts on this example
    c_low = 1 / c
    w, m = is_weights(*_example(), level=level, mode=mode, threshold=c)
    rho = _rho_by_hand(level)
    expect = [[_weight_by_hand(x, mode, c, c_low) for x in row] for row in rho]
    assert w.shape == (2, 3)
    assert torch.allclose(w, torch.tensor(_pad(expect), dtype=torch.float64), rtol=1e-12, atol=0)
    flat_rho = [x for row in rho for x in row]
    flat_w = [x for row in expect for x in row]
    assert m["is/ratio_mean_before"] == pytest.approx(sum(flat_rho) / 5)
    assert m["is/ratio_max_before"] == pytest.approx(max(flat_rho))
    assert m["is/ratio_mean_after"] == pytest.approx(sum(flat_w) / 5)
    n_over = sum(x > c for x in flat_rho)
    n_out = sum(not (c_low <= x <= c) for x in flat_rho)
    assert m["is/frac_truncated"] == pytest.approx(n_over / 5 if mode == "truncate" else 0.0)
    masked = {"mask": n_over, "two_sided": n_out}.get(mode, 0)
    assert m["is/frac_masked"] == pytest.approx(masked / 5)
    assert m["is/frac_vetoed_seqs"] == 0.0
    mw = sum(flat_w) / 5
    mw2 = sum(x * x for x in flat_w) / 5
    assert m["is/ess"] == pytest.approx(mw * mw / mw2 if mw2 else 0.0)
    assert list(m) == list(METRIC_KEYS)


def test_literal_values_token_truncate_default():
    # C = 2: exp(.9) = 2.4596 -> 2 ; others below C stay
    w, m = is_weights(*_example())
    assert w[0].tolist() == pytest.approx([2.0, math.exp(-0.5), math.exp(0.25)])
    assert w[1].tolist() == pytest.approx([math.exp(-1.2), math.exp(0.1), 0.0])
    assert m["is/frac_truncated"] == pytest.approx(0.2)
    assert m["is/ratio_max_before"] == pytest.approx(2.45960311115695)


def test_two_sided_explicit_low():
    # token rho = [2.46, .607, 1.284, .301, 1.105]; keep [0.5, 1.5]
    w, m = is_weights(*_example(), mode="two_sided", threshold=1.5, threshold_low=0.5)
    assert w.flatten().tolist() == pytest.approx(
        [0.0, math.exp(-0.5), math.exp(0.25), 0.0, math.exp(0.1), 0.0]
    )
    assert m["is/frac_masked"] == pytest.approx(2 / 5)
    # default low = 1 / C: with C = 2, low = .5 -> same as above except 1.5 < 2
    w2, _ = is_weights(*_example(), mode="two_sided", threshold=2.0)
    assert torch.equal(w2, w)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_veto_zeroes_whole_sequence(level):
    # row 1 has a token with rho = exp(-1.2) = 0.301 < 0.35 -> the whole row goes
    w, m = is_weights(*_example(), level=level, mode="none", veto_threshold=0.35)
    assert w[1].tolist() == [0.0, 0.0, 0.0]
    assert w[0].tolist() == [1.0, 1.0, 1.0]
    assert m["is/frac_vetoed_seqs"] == 0.5
    assert m["is/ratio_mean_after"] == pytest.approx(3 / 5)
    w, m = is_weights(*_example(), level=level, veto_threshold=0.3)  # 0.301 survives
    assert m["is/frac_vetoed_seqs"] == 0.0 and (w[1, :2] > 0).all()


def test_veto_ignores_padding():
    lp, lq, mask = _example()
    lp[1, 2], lq[1, 2] = -50.0, 0.0  # would veto if it counted
    w, m = is_weights(lp, lq, mask, veto_threshold=1e-4)
    assert m["is/frac_vetoed_seqs"] == 0.0


def test_weights_are_detached_and_zero_off_mask():
    lp, lq, mask = _example(requires_grad=True)
    w, _ = is_weights(lp * 1.0, lq, mask, level="sequence", mode="truncate")
    assert not w.requires_grad and w.grad_fn is None
    assert w[1, 2] == 0.0
    (lp.sum()).backward()  # the inputs' graph is untouched
    assert lp.grad is not None


def test_output_dtype():
    lp, lq, mask = _example()
    assert is_weights(lp.bfloat16(), lq.bfloat16(), mask)[0].dtype == torch.float32
    assert is_weights(lp.float(), lq.float(), mask)[0].dtype == torch.float32
    assert is_weights(lp, lq, mask)[0].dtype == torch.float64


def test_huge_ratios_clamped_not_inf():
    lp = torch.tensor([[0.0, 0.0]])
    lq = torch.tensor([[-100.0, -100.0]])
    w, m = is_weights(lp, lq, torch.ones(1, 2), level="sequence", mode="none")
    assert m["is/ratio_max_before"] == pytest.approx(math.exp(SAFETY_BOUND))
    w, m = is_weights(lp, lq, torch.ones(1, 2), level="token", mode="mask", threshold=2.0)
    assert w.tolist() == [[0.0, 0.0]] and m["is/ess"] == 0.0
    assert all(math.isfinite(v) for v in m.values())


def test_no_valid_token():
    w, m = is_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), veto_threshold=1e-4)
    assert (w == 0).all()
    assert set(m.values()) == {0.0}


def test_nonfinite_at_valid_position_raises():
    lp, lq, mask = _example()
    lq[0, 0] = float("-inf")
    with pytest.raises(ValueError, match="^rollout_logp has 1 non-finite"):
        is_weights(lp, lq, mask)


def test_registries_and_validation():
    assert IS_LEVELS.names() == ["geometric", "sequence", "token"]
    assert IS_MODES.names() == ["mask", "none", "truncate", "two_sided"]
    args = _example()
    with pytest.raises(UnknownNameError, match="valid choices: geometric, sequence, token"):
        is_weights(*args, level="tokens")
    with pytest.raises(UnknownNameError, match="valid choices: mask, none, truncate, two_sided"):
        is_weights(*args, mode="clip")
    with pytest.raises(ValueError, match="^threshold must"):
        is_weights(*args, threshold=0.0)
    with pytest.raises(ValueError, match="^threshold_low must"):
        is_weights(*args, mode="two_sided", threshold=2.0, threshold_low=3.0)
    with pytest.raises(ValueError, match="^threshold_low must"):
        is_weights(*args, mode="two_sided", threshold_low=-1.0)
    with pytest.raises(ValueError, match="^threshold_low only applies"):
        is_weights(*args, mode="truncate", threshold_low=0.5)
    with pytest.raises(ValueError, match="^veto_threshold must"):
        is_weights(*args, veto_threshold=0.0)
    with pytest.raises(ValueError, match=r"shape mismatch: train_logp \(2, 3\), rollout_logp \(2, 2\)"):
        is_weights(args[0], args[1][:, :2], args[2])


def test_safety_bound_matches_metrics():
    assert SAFETY_BOUND == timlab.metrics.SAFETY_BOUND == 20.0
