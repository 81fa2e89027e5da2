"""Rejection sampling and self-normalized IS (timlab.remedies) against hand computation and
against verl 0.9.1's own functions on random float64 inputs (those tests skip without verl)."""

from __future__ import annotations

import math

import pytest
import torch

from timlab.errors import TimlabError
from timlab.remedies import RS_RULES, is_weights, parse_thresholds, rejection_mask, rule_metric_keys

ALL_RULES = RS_RULES.names()


def _random(B=12, T=10, seed=0, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    lq = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # (B, T) log mu
    lp = lq + torch.randn(B, T, generator=g, dtype=torch.float64) * scale  # log pi
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)  # right-padded, every row non-empty
    return lp, lq, mask


def test_rule_names_are_verls():
    assert set(ALL_RULES) == {"token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"}


def test_hand_computed_rules():
    # r = log pi - log mu: row 0 [0.9, -0.5, 0.25], row 1 [-1.2, 0.1, pad]
    lp = torch.tensor([[-0.1, -2.0, -0.5], [-2.2, -0.9, 0.0]], dtype=torch.float64)
    lq = torch.tensor([[-1.0, -1.5, -0.75], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=torch.float64)
    # token_k1 "0.5_2.0": keep 0.5 <= mu/pi <= 2, i.e. |r| <= log 2 = 0.693
    m, met = rejection_mask(lp, lq, mask, rules="token_k1", thresholds="0.5_2.0")
    assert m.tolist() == [[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    assert met["rs/masked_frac"] == pytest.approx(2 / 5) and met["rs/seq_masked_frac"] == 1.0
    assert met["rs/token_k1_max"] == pytest.approx(1.2) and met["rs/token_k1_min"] == pytest.approx(-0.9)
    # seq_sum_k3 0.6: row 0 sum k3 = sum(exp(r)-1-r), row 1 likewise
    k3 = [sum(math.exp(x) - 1 - x for x in row) for row in ([0.9, -0.5, 0.25], [-1.2, 0.1])]
    assert k3[0] > 0.6 > k3[1]
    m, met = rejection_mask(lp, lq, mask, rules="seq_sum_k3", thresholds=0.6)
    assert m.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert met["rs/seq_sum_k3_max"] == pytest.approx(k3[0]) and met["rs/seq_sum_k3_min"] == pytest.approx(k3[1])
    assert met["rs/seq_sum_k3_mean"] == pytest.approx((3 * k3[0] + 2 * k3[1]) / 5)
    # AND of two rules, one threshold each; seq_max_k2 = max r^2/2 = 0.72 (row 1), 0.405 (row 0)
    m, met = rejection_mask(lp, lq, mask.bool(), rules="seq_max_k2,token_k1", thresholds="0.5,0.5_2.0")
    assert m.tolist() == [[False, True, True], [False, False, False]]
    assert met["rs/seq_max_k2_seq_masked_frac"] == 0.5 and met["rs/token_k1_masked_frac"] == pytest.approx(0.4)
    assert set(met) == {"rs/masked_frac", "rs/seq_masked_frac", *rule_metric_keys("seq_max_k2"),
                        *rule_metric_keys("token_k1")}


def test_threshold_semantics_and_errors():
    assert parse_thresholds(["token_k1"], "2.0") == {"token_k1": (0.5, 2.0)}  # a single hi: lo = 1/hi
    assert parse_thresholds(["seq_mean_k1", "seq_sum_k3"], "0.999_1.001,0.01") == {
        "seq_mean_k1": (0.999, 1.001), "seq_sum_k3": (None, 0.01)}
    assert parse_thresholds(["token_k2", "seq_max_k3"], 0.1) == {"token_k2": (None, 0.1), "seq_max_k3": (None, 0.1)}
    lp, lq, mask = _random()
    bad = [("seq_max_k1", "2.0", "valid choices: seq_max_k2"), ("token_k4", "1", "valid choices"),
           ("token_k2", "0.5_2.0", "one upper bound"), ("token_k1", "2.0_0.5", "lower bound 2 > upper 0.5"),
           ("token_k1,token_k2", "1,2,3", "3 entries for 2 rules"), ("token_k3", "-1", "finite number > 0"),
           ("token_k3", "abc", "finite number > 0"), ("", "1", "valid choices"), ("token_k3", "", "empty")]
    for rules, thr, msg in bad:
        with pytest.raises(TimlabError, match=msg) as e:
            rejection_mask(lp, lq, mask, rules=rules, thresholds=thr)
        assert "\n" not in str(e.value)


def test_empty_batch_and_duplicates():
    lp, lq, mask = _random(B=3, T=4)
    m, met = rejection_mask(lp, lq, torch.zeros_like(mask), rules="token_k3,token_k3", thresholds="0.1")
    assert m.sum() == 0 and set(met.values()) == {0.0}
    assert set(met) == {"rs/masked_frac", "rs/seq_masked_frac", *rule_metric_keys("token_k3")}


def test_batch_normalize_by_hand():
    lp, lq, mask = _random(B=5, T=6, seed=3)
    for level in ("token", "sequence", "geometric"):
        w0, m0 = is_weights(lp, lq, mask, level=level, mode="truncate", threshold=2.0)
        w1, m1 = is_weights(lp, lq, mask, level=level, mode="truncate", threshold=2.0, batch_normalize=True)
        if level == "token":
            mean = float((w0 * mask).sum() / mask.sum())
            assert float((w1 * mask).sum() / mask.sum()) == pytest.approx(1.0, rel=1e-12)
        else:
            mean = float(((w0 * mask).sum(-1) / mask.sum(-1)).mean())
        assert m1["is/batch_norm_factor"] == pytest.approx(mean, rel=1e-12) and m0["is/batch_norm_factor"] == 1.0
        assert torch.allclose(w1, w0 / mean, rtol=1e-12, atol=0)
        assert m1["is/ess"] == pytest.approx(m0["is/ess"], rel=1e-12)  # ESS is scale-free
        assert m1["is/ratio_max_before"] == m0["is/ratio_max_before"]  # raw statistics come before


def test_raw_ratio_statistics_and_fractions():
    lp, lq, mask = _random(B=8, T=7, seed=5, scale=0.8)
    valid = mask.bool()
    rho = torch.exp(lp - lq)[valid]
    w, m = is_weights(lp, lq, mask, level="token", mode="truncate", threshold=1.5)
    assert m["is/ratio_min_before"] == pytest.approx(float(rho.min()), rel=1e-12)
    assert m["is/ratio_max_before"] == pytest.approx(float(rho.max()), rel=1e-12)
    assert m["is/ratio_frac_high"] == pytest.approx(float((rho > 1.5).double().mean()))
    assert m["is/ratio_frac_low"] == pytest.approx(float((rho < 1 / 1.5).double().mean()))
    assert m["is/frac_truncated"] == m["is/ratio_frac_high"]
    over = (torch.exp(lp - lq) > 1.5) & valid
    assert m["is/frac_truncated_seqs"] == pytest.approx(float(over.any(-1).double().mean()))
    _, m2 = is_weights(lp, lq, mask, level="token", mode="two_sided", threshold=1.5, threshold_low=0.8)
    out = ((torch.exp(lp - lq) > 1.5) | (torch.exp(lp - lq) < 0.8)) & valid
    assert m2["is/frac_masked_seqs"] == pytest.approx(float(out.any(-1).double().mean()))
    assert m2["is/ratio_frac_low"] == pytest.approx(float((rho < 0.8).double().mean()))


# ---------------------------------------------------------------------------------- against verl
@pytest.fixture(scope="module")
def verl_rc():
    return pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")


RULE_SETS = [
    ("token_k1", "0.5_2.0"), ("token_k2", "0.1"), ("token_k3", "0.05"), ("seq_sum_k1", "0.5_2.0"),
    ("seq_sum_k2", "0.3"), ("seq_sum_k3", "0.3"), ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k2", "0.05"),
    ("seq_mean_k3", "0.04"), ("seq_max_k2", "0.2"), ("seq_max_k3", "0.2"),
    ("token_k1,seq_sum_k3", "0.5_2.0,0.3"), ("seq_mean_k1,seq_max_k3,token_k2", "1.1,0.3,0.2"),
]


@pytest.mark.parametrize("rules,thresholds", RULE_SETS)
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_matches_verl(verl_rc, rules, thresholds, seed):
    lp, lq, mask = _random(seed=seed)
    ours, m = rejection_mask(lp, lq, mask, rules=rules, thresholds=thresholds)
    theirs, v = verl_rc.compute_rollout_rejection_mask(lp - lq, mask, rollout_rs=rules, rollout_rs_threshold=thresholds)
    assert torch.equal(ours, theirs)
    assert 0 < m["rs/masked_frac"] < 1  # the thresholds are chosen so that the rules act
    assert m["rs/masked_frac"] == pytest.approx(v["rollout_rs_masked_fraction"], abs=1e-9)
    assert m["rs/seq_masked_frac"] == pytest.approx(v["rollout_rs_seq_masked_fraction"], abs=1e-9)
    for rule in rules.split(","):
        for ours_key, verl_key in (("mean", "mean"), ("max", "max"), ("min", "min"), ("masked_frac", "masked_fraction"),
                                   ("seq_masked_frac", "seq_masked_fraction")):
            assert m[f"rs/{rule}_{ours_key}"] == pytest.approx(v[f"rollout_rs_{rule}_{verl_key}"], rel=1e-7, abs=1e-9)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", ["1.25", "0.8_1.25"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_match_verl(verl_rc, level, threshold, normalize):
    lp, lq, mask = _random(seed=7, scale=0.3)
    mode, kw = ("truncate", {"threshold": 1.25}) if "_" not in threshold else (
        "two_sided", {"threshold": 1.25, "threshold_low": 0.8})
    ours, m = is_weights(lp, lq, mask, level=level, mode=mode, batch_normalize=normalize, **kw)
    theirs, v = verl_rc.compute_rollout_correction_weights(
        lp - lq, mask, rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize)
    # verl's masked_mean divides by (count + 1e-8): relative differences up to ~5e-9 once normalized
    assert torch.allclose(ours, theirs, rtol=1e-7 if normalize else 1e-12, atol=1e-15)
    assert m["is/frac_truncated"] + m["is/frac_masked"] > 0
    if normalize:
        assert m["is/batch_norm_factor"] == pytest.approx(v["rollout_is_batch_norm_factor"], rel=1e-7)
    if level == "token":
        assert m["is/ratio_frac_high"] == pytest.approx(v["rollout_is_ratio_fraction_high"], abs=1e-9)
        assert m["is/ratio_frac_low"] == pytest.approx(v["rollout_is_ratio_fraction_low"], abs=1e-9)


# ---------------------------------------------------------------------------------- the plug-ins
def test_verl_plugin_correction_metrics(verl_rc):
    from timlab.integrations.verl import correction_metrics

    lp, lq, mask = _random(seed=2)
    batch = {"old_log_probs": lp, "rollout_log_probs": lq, "response_mask": mask}
    cfg = {"rollout_is": "sequence", "rollout_is_threshold": "0.8_1.25", "rollout_is_batch_normalize": True,
           "rollout_rs": "seq_max_k3,token_k1", "rollout_rs_threshold": "0.2,0.5_2.0"}
    m = correction_metrics(batch, cfg)
    _, mask_v, v = verl_rc.compute_rollout_correction_and_rejection_mask(
        lp, lq, mask, rollout_is="sequence", rollout_is_threshold="0.8_1.25", rollout_is_batch_normalize=True,
        rollout_rs="seq_max_k3,token_k1", rollout_rs_threshold="0.2,0.5_2.0")
    assert m["rs/masked_frac"] == pytest.approx(v["rollout_corr/rollout_rs_masked_fraction"], abs=1e-9)
    assert m["is/batch_norm_factor"] == pytest.approx(v["rollout_corr/rollout_is_batch_norm_factor"], rel=1e-7)
    assert 0 < m["is/frac_masked_seqs"] < 1 and m["is/ratio_max_before"] > 1.25
    assert not any(k.startswith("is/") for k in correction_metrics(batch, {"rollout_rs": "token_k2",
                                                                           "rollout_rs_threshold": 0.1}))


def test_trl_plugin_raw_ratios():
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from timlab.integrations.trl import raw_ratio_metrics

    lp, lq, mask = _random(seed=4, scale=0.5)
    args = SimpleNamespace(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.5,
                           vllm_importance_sampling_clip_min=0.9)
    m = raw_ratio_metrics(lp, lq, mask, args)
    rho = torch.exp(lp - lq)[mask.bool()]
    assert m["is/ratio_max_before"] == pytest.approx(float(rho.max())) and m["is/ratio_min_before"] == pytest.approx(float(rho.min()))
    assert m["is/ratio_frac_high"] == pytest.approx(float((rho > 1.5).double().mean()))
    assert m["is/ratio_frac_low"] == pytest.approx(float((rho < 0.9).double().mean()))
    seq = raw_ratio_metrics(lp, lq, mask, SimpleNamespace(vllm_importance_sampling_mode="sequence_mask"))
    assert seq["is/ratio_max_before"] == pytest.approx(float(torch.exp(((lp - lq) * mask).sum(-1)).max()))
