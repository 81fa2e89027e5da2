"""The harm candidates of timlab.metrics.harm and mismatch/tv_mean: hand-computed values, zero at
zero mismatch, streaming equal to one batch, the TV estimator against the exact TV, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from timlab.errors import UsageError
from timlab.metrics import (
    ADVANTAGE_KEYS,
    ENTROPY_KEYS,
    HARM_CANDIDATES,
    advantage_metrics,
    advantage_metrics_from_sums,
    advantage_sums,
    all_metrics,
    decision_token_metrics,
    harm_metrics,
    merge_advantage_sums,
)
from timlab.metrics.gradients import tv_distance

NAN = float("nan")


def k3(x: float) -> float:
    return math.exp(x) - x - 1.0


def _example():
    """Three sequences, log mu = -1 everywhere, r = log pi - log mu on the valid tokens below;
    padding holds NaN (never read). Valid: 3 + 2 + 1 = 6 tokens."""
    r = torch.tensor([[0.2, -0.1, 0.3], [0.1, 0.4, NAN], [-0.2, NAN, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    rollout = torch.full((3, 3), -1.0, dtype=torch.float64)
    return rollout + r, rollout, mask


ADV = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)


def test_advantage_metrics_hand_computed():
    m = advantage_metrics(*_example(), ADV)
    assert list(m) == list(ADVANTAGE_KEYS)
    # sum A r over tokens: 2 (0.2 - 0.1 + 0.3) - (0.1 + 0.4) + 0.5 (-0.2) = 0.8 - 0.5 - 0.1 = 0.2, over 6 tokens
    assert m["mismatch/adv_diff_mean"] == pytest.approx(0.2 / 6, rel=1e-12)
    # a = (2, -1, 0.5), s = sum_t r = (0.4, 0.5, -0.2): centred a (1.5, -1.5, 0), s - 7/30 = (1/6, 4/15, -13/30)
    cov = 1.5 / 6 - 1.5 * 4 / 15  # -0.15
    var_a, var_s = 4.5, (1 / 6) ** 2 + (4 / 15) ** 2 + (13 / 30) ** 2  # 0.28666...
    assert m["mismatch/adv_diff_corr"] == pytest.approx(cov / math.sqrt(var_a * var_s), rel=1e-12)
    assert m["mismatch/adv_diff_corr"] == pytest.approx(-0.1320676, abs=1e-7)


def test_per_token_advantages_equal_per_sequence_when_constant_and_weight_tokens_otherwise():
    train, rollout, mask = _example()
    per_token = ADV[:, None].expand(3, 3).clone()  # (B, T)
    per_token[1, 2] = NAN  # padding: never read
    assert advantage_metrics(train, rollout, mask, per_token) == advantage_metrics(train, rollout, mask, ADV)
    # row 0's tokens get A = (3, 1, 2): sum A r = 0.6 - 0.1 + 0.6 - 0.5 - 0.1 = 0.5; row 0's a is their mean, 2
    per_token[0] = torch.tensor([3.0, 1.0, 2.0])
    m = advantage_metrics(train, rollout, mask, per_token)
    assert m["mismatch/adv_diff_mean"] == pytest.approx(0.5 / 6, rel=1e-12)
    assert m["mismatch/adv_diff_corr"] == pytest.approx(advantage_metrics(train, rollout, mask, ADV)["mismatch/adv_diff_corr"])


def test_decision_token_metrics_hand_computed():
    ent = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 9.9], [0.4, 7.0, 7.0]])  # 9.9 and 7.0 sit on padding
    m = decision_token_metrics(*_example(), ent)
    assert list(m) == list(ENTROPY_KEYS)
    # ceil(0.2 x 6) = 2 decision tokens: entropies 2.0 (r = -0.1) and 1.5 (r = 0.1)
    assert m["mismatch/k3_decision"] == pytest.approx((k3(-0.1) + k3(0.1)) / 2, rel=1e-12)
    assert m["mismatch/k3_rest"] == pytest.approx((k3(0.2) + k3(0.3) + k3(0.4) + k3(-0.2)) / 4, rel=1e-12)
    # the token-weighted mean of the two is k3 per token
    k3_kl = all_metrics(*_example())["rollout_corr/k3_kl"]
    assert (2 * m["mismatch/k3_decision"] + 4 * m["mismatch/k3_rest"]) / 6 == pytest.approx(k3_kl, rel=1e-12)
    # top half: 2.0, 1.5, 0.4 (r = -0.2)
    m = decision_token_metrics(*_example(), ent, top_frac=0.5)
    assert m["mismatch/k3_decision"] == pytest.approx((k3(-0.1) + k3(0.1) + k3(-0.2)) / 3, rel=1e-12)


def test_decision_tokens_ties_go_to_the_earlier_token():
    m = decision_token_metrics(*_example(), torch.ones(3, 3))
    assert m["mismatch/k3_decision"] == pytest.approx((k3(0.2) + k3(-0.1)) / 2, rel=1e-12)  # row 0's first two


def test_tv_mean_hand_computed():
    m = all_metrics(*_example())
    rs = (0.2, -0.1, 0.3, 0.1, 0.4, -0.2)
    assert m["mismatch/tv_mean"] == pytest.approx(0.5 * sum(abs(math.expm1(x)) for x in rs) / 6, rel=1e-12)


def test_tv_mean_estimates_the_full_vocabulary_tv_from_sampled_tokens():
    """Tokens drawn from mu: the mean of 0.5 |pi/mu - 1| converges to the exact per-position TV."""
    g = torch.Generator().manual_seed(0)
    P, V, n = 4, 6, 20_000  # positions, vocabulary, samples per position
    logit_pi = torch.randn(P, V, generator=g, dtype=torch.float64)
    logit_mu = logit_pi + 0.5 * torch.randn(P, V, generator=g, dtype=torch.float64)
    exact = float(tv_distance(logit_pi, logit_mu).mean())
    mu = torch.softmax(logit_mu, -1)
    y = torch.multinomial(mu, n, replacement=True, generator=g)  # (P, n) tokens from mu
    train = torch.log_softmax(logit_pi, -1).gather(1, y)  # (P, n) log pi of the sampled tokens
    rollout = torch.log_softmax(logit_mu, -1).gather(1, y)  # (P, n) log mu
    est = all_metrics(train, rollout, torch.ones(P, n))["mismatch/tv_mean"]
    assert 0.05 < exact < 0.5
    assert est == pytest.approx(exact, rel=0.03)
    # the sampled token's own |pi - mu| is a different number
    assert all_metrics(train, rollout, torch.ones(P, n))["mismatch/probs_diff_mean"] != pytest.approx(exact, rel=0.3)


def test_every_harm_statistic_is_exactly_zero_at_zero_mismatch():
    _, rollout, mask = _example()
    ent = torch.rand(3, 3, generator=torch.Generator().manual_seed(1))
    m = {**all_metrics(rollout, rollout, mask), **harm_metrics(rollout, rollout, mask, advantages=ADV, entropy=ent)}
    assert {k: m[k] for k in HARM_CANDIDATES} == {k: 0.0 for k in HARM_CANDIDATES}


def test_harm_metrics_returns_what_its_inputs_allow():
    ex = _example()
    ent = torch.ones(3, 3)
    assert harm_metrics(*ex) == {}
    assert set(harm_metrics(*ex, advantages=ADV)) == set(ADVANTAGE_KEYS)
    assert set(harm_metrics(*ex, entropy=ent)) == set(ENTROPY_KEYS)
    assert harm_metrics(*ex, advantages=ADV, entropy=ent) == {**advantage_metrics(*ex, ADV),
                                                              **decision_token_metrics(*ex, ent)}


def test_constant_advantages_give_zero_correlation_and_empty_batches_zeros():
    ex = _example()
    assert advantage_metrics(*ex, torch.full((3,), 0.7))["mismatch/adv_diff_corr"] == 0.0
    empty = torch.zeros(2, 3)
    assert advantage_metrics(empty, empty, empty, torch.ones(2)) == {k: 0.0 for k in ADVANTAGE_KEYS}
    assert decision_token_metrics(empty, empty, empty, empty) == {k: 0.0 for k in ENTROPY_KEYS}


def test_streamed_advantage_sums_equal_one_batch():
    g = torch.Generator().manual_seed(3)
    B, T = 40, 7
    rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    train = rollout + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < 0.8).int()
    mask[:, 0] = 1
    adv = torch.randn(B, generator=g, dtype=torch.float64) + 3.0  # a mean far from 0 tests the centred merge
    whole = advantage_metrics(train, rollout, mask, adv)
    parts = [advantage_sums(train[a:b], rollout[a:b], mask[a:b], adv[a:b]) for a, b in ((0, 5), (5, 29), (29, 40))]
    merged = merge_advantage_sums(merge_advantage_sums(parts[0], parts[1]), parts[2])
    streamed = advantage_metrics_from_sums(merged)
    assert streamed == pytest.approx(whole, rel=1e-12, abs=1e-15)
    assert abs(whole["mismatch/adv_diff_corr"]) > 0.0


@pytest.mark.parametrize("adv, needle", [
    (torch.ones(2), "advantages must have shape (3,) or (3, 3)"),
    (torch.tensor([1.0, NAN, 0.0]), "advantages has 1 non-finite value(s) at sequences with a valid token"),
    (torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, NAN], [1.0, NAN, NAN]]) * torch.tensor([[1.0], [1.0], [NAN]]),
     "advantages has 1 non-finite value(s) at valid (mask=1) positions"),
])
def test_bad_advantages_one_line(adv, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        advantage_metrics(*_example(), adv)


def test_bad_entropy_and_top_frac():
    with pytest.raises(UsageError, match="entropy must have shape"):
        decision_token_metrics(*_example(), torch.ones(3))
    for bad in (0.0, 1.0, True, "0.2"):
        with pytest.raises(UsageError, match="top_frac must be a number in"):
            decision_token_metrics(*_example(), torch.ones(3, 3), top_frac=bad)
