"""The noise-vs-bias length diagnostic (timlab.metrics.scaling) on synthetic log-ratios whose
structure is known: iid noise must read T^0.5, a systematic bias T^1."""

from __future__ import annotations

import math

import pytest
import torch

from timlab.metrics.scaling import (
                                    READINGS,
                                    length_scaling,
                                    length_scaling_from_sums,
                                    length_scaling_sums,
                                    merge_length_scaling_sums,
                                    )


def _data(kind: str, seed: int = 0, B: int = 256, T: int = 64, ragged: bool = True):
    g = torch.Generator().manual_seed(seed)
    lq = -torch.rand(B, T, generator=g, dtype=torch.float64)  # (B, T) log mu
    noise = torch.randn(B, T, generator=g, dtype=torch.float64)
    r = {"noise": 0.05 * noise, "bias": 0.02 + 0.005 * noise, "neg_bias": -0.03 + 0.01 * noise,
         "zero": 0 * noise}[kind]
    lengths = torch.randint(8, T + 1, (B,), generator=g) if ragged else torch.full((B,), T)
    mask = torch.arange(T)[None] < lengths[:, None]  # (B, T)
    return lq + r, lq, mask


@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iid_noise_reads_as_noise(ragged, seed):
    res = length_scaling(*_data("noise", seed, ragged=ragged))
    assert res["reading"] == "noise-like (T^0.5)"
    assert 0.4 < res["sum_exponent"] < 0.6 and res["sum_exponent_lo"] < res["sum_exponent"] < res["sum_exponent_hi"]
    assert 0.44 < res["normalized_exponent"] < 0.56 and res["normalized_exponent_hi"] < 0.6
    assert 0.95 < res["abs_sum_exponent"] < 1.05  # sum |r| grows like T for any stationary mismatch


@pytest.mark.parametrize("kind", ["bias", "neg_bias"])
def test_systematic_bias_reads_as_bias(kind):
    res = length_scaling(*_data(kind))
    assert res["reading"] == "bias-like (T^1)"
    assert 0.95 < res["sum_exponent"] < 1.02 and res["sum_exponent_lo"] > 0.9
    assert 0.95 < res["normalized_exponent"] < 1.02


def test_noise_that_shrinks_along_the_response_still_reads_as_noise():
    """sigma_t ~ t^-0.4: the raw exponents fall (S ~ T^0.1, A ~ T^0.6 for long T), the variance ratio does not."""
    g = torch.Generator().manual_seed(0)
    B, T = 512, 64
    lq = -torch.rand(B, T, generator=g, dtype=torch.float64)
    t = torch.arange(1, T + 1, dtype=torch.float64)
    r = 0.2 * t ** -0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    res = length_scaling(lq + r, lq, torch.ones(B, T))
    assert res["sum_exponent"] < 0.35 and 0.5 < res["abs_sum_exponent"] < 0.8
    assert 0.45 < res["normalized_exponent"] < 0.55 and res["reading"] == "noise-like (T^0.5)"
    # the same shrinking profile as a bias: reads as bias
    res = length_scaling(lq + 0.2 * t ** -0.4, lq, torch.ones(B, T))
    assert res["normalized_exponent"] == pytest.approx(1.0, abs=0.1) and res["reading"] == "bias-like (T^1)"


def test_exact_bias_and_noise_curves_by_hand():
    """r = 0.1 on every token: RMS S(t) = 0.1 t exactly, exponent 1 for both sums."""
    lq = torch.zeros(4, 16, dtype=torch.float64)
    res = length_scaling(lq + 0.1, lq, torch.ones(4, 16))
    assert res["lengths"] == [1, 2, 3, 4, 6, 8, 11, 16]
    assert res["rms_sum"] == pytest.approx([0.1 * t for t in res["lengths"]], rel=1e-12)
    assert res["sum_exponent"] == pytest.approx(1.0, abs=1e-12) and res["abs_sum_exponent"] == pytest.approx(1.0, abs=1e-12)
    # RMS Q = 0.1 sqrt(t): the variance ratio grows like sqrt(t), normalized exponent 0.5 + 0.5
    assert res["rms_sq_sum"] == pytest.approx([0.1 * t ** 0.5 for t in res["lengths"]], rel=1e-12)
    assert res["normalized_exponent"] == pytest.approx(1.0, abs=1e-12)
    # alternating +-0.1: S(t) is 0.1 or 0 -> not a power law; sum |r| = 0.1 t
    alt = torch.tensor([0.1, -0.1] * 8, dtype=torch.float64).expand(4, 16)
    res = length_scaling(lq + alt, lq, torch.ones(4, 16))
    assert res["abs_sum_exponent"] == pytest.approx(1.0, abs=1e-12) and res["sum_exponent"] < 0.3


def test_no_mismatch_too_short_and_empty():
    assert length_scaling(*_data("zero"))["reading"] == READINGS[0]
    lp, lq, mask = _data("noise")
    res = length_scaling(lp[:, :1], lq[:, :1], mask[:, :1])
    assert res["reading"] == READINGS[4] and math.isnan(res["sum_exponent"])
    res = length_scaling(lp[:0], lq[:0], mask[:0])
    assert res["num_seqs"] == 0 and res["reading"] == READINGS[4]


def test_seeded_padding_free_and_streamable():
    lp, lq, mask = _data("noise", ragged=True)
    a, b = length_scaling(lp, lq, mask, seed=3), length_scaling(lp, lq, mask, seed=3)
    assert a == b  # same seed, same interval
    # left-padding the same tokens changes nothing: prefixes are counted over valid tokens
    flip = lambda t: torch.stack([torch.roll(row, int((~m).sum())) for row, m in zip(t, mask)])  # noqa: E731
    c = length_scaling(flip(lp), flip(lq), flip(mask), seed=3)
    assert c["rms_sum"] == pytest.approx(a["rms_sum"], rel=1e-12) and c["sum_exponent"] == pytest.approx(a["sum_exponent"])
    # streamed in two batches (the first one narrower) = one shot
    short = mask.sum(-1) <= 20
    lp, lq, mask = torch.cat([lp[short], lp[~short]]), torch.cat([lq[short], lq[~short]]), torch.cat([mask[short], mask[~short]])
    k = int(short.sum())
    s1 = length_scaling_sums(lp[:k, :20], lq[:k, :20], mask[:k, :20])
    merged = merge_length_scaling_sums(s1, length_scaling_sums(lp[k:], lq[k:], mask[k:]))
    whole = length_scaling_sums(lp, lq, mask)
    assert s1["sum"].shape[1] < whole["sum"].shape[1]
    for key in ("sum", "abs_sum", "sq_sum"):
        assert torch.allclose(merged[key], whole[key], rtol=1e-12, atol=0, equal_nan=True)
    assert length_scaling_from_sums(merged, seed=1) == length_scaling_from_sums(whole, seed=1)


def test_analyze_reports_the_reading():
    from timlab.experiments.diagnostics.analyze import analyze_records, format_analysis

    lp, lq, mask = _data("bias", B=64, T=32)
    rows = [{"trainer_logprobs": a[m].tolist(), "rollout_logprobs": b[m].tolist()} for a, b, m in zip(lp, lq, mask)]
    res = analyze_records(rows)
    assert res["length_scaling"]["reading"] == "bias-like (T^1)"
    assert "length scaling: bias-like (T^1)" in format_analysis(res)


def test_the_printed_line_counts_sequences_and_leaves_out_what_was_not_fitted():
    from timlab.metrics.scaling import format_length_scaling

    one = length_scaling(torch.tensor([[-0.5]]), torch.tensor([[-0.4]]), torch.ones(1, 1, dtype=torch.bool))
    assert format_length_scaling(one) == f"{READINGS[4]} (1 sequence)"
    many = length_scaling(*_data("bias", B=64, T=16, ragged=False), n_boot=50)
    line = format_length_scaling(many)
    assert line.startswith(f"{READINGS[2]}: normalized exponent ") and "grows as T^" in line and "n/a" not in line
    assert line.endswith(f"(64 sequences, lengths 1-{many['lengths'][-1]})") and many["lengths"][-1] == 16
