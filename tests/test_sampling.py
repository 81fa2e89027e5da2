"""The sampler (inverse-CDF draw) and the decode loop's once-per-rollout bookkeeping.

- ``draw_tokens`` draws each token with its probability (chi-square bound over 200k draws),
  never a zero-probability token (inside the vocabulary or trailing it, whatever cumsum rounding
  does), and the same tokens for the same generator state;
- ``sample_next`` keeps temperature, top-k and top-p as they were, and with temperature 1 and no
  truncation its sampling log-probs are the model's;
- the decode loop with positions, RoPE and masks built once per rollout (``_DecodeState``) and
  one host read per step gives the same tokens and log-probs, bit for bit, as the previous loop
  that rebuilt them every step, for the exact and the fast engine, with and without compaction.
"""

from __future__ import annotations

import pytest
import torch

from test_engines import EOS, PAD, V, tiny_model, trainer_logprobs
from timlab.engines import SamplingParams, build_engine
from timlab.engines.base import _U_MAX, NonFiniteLogitsError, draw_tokens, sample_next, truncate
from timlab.engines.native import ExactEngine, FastEngine


# ----------------------------------------------------------------------------- draw_tokens
def test_draw_frequencies_match_probs_and_zero_probs_never_drawn():
    p = torch.tensor([0.05, 0.0, 0.3, 0.0, 0.15, 0.4, 0.1, 0.0, 0.0])  # zeros inside and trailing
    n = 200_000
    g = torch.Generator().manual_seed(0)
    tok = draw_tokens(p.expand(n, -1), g)
    counts = torch.bincount(tok, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    expected = n * p.double()
    nz = p > 0
    chi2 = float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: P(chi2 > 20.5) < 0.0004
    assert (counts[nz] / n - p[nz].double()).abs().max() < 0.005


def test_draw_unnormalized_rows_and_tiny_probabilities():
    # rows of different total mass; a row whose only mass sits on the last nonzero token after
    # many tiny ones (cumsum rounding: 1 + 1e-9 == 1 in fp32), then zeros.
    p = torch.zeros(4, 40)
    p[0, 3] = 7.0  # one token, unnormalized
    p[1, :10] = 2.0  # uniform over 10, total 20
    p[2, :30] = 1e-9
    p[2, 30] = 1.0
    p[3, 0], p[3, 39] = 1e-30, 1e-30  # tiny total
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([draw_tokens(p, g) for _ in range(5000)])  # (5000, 4)
    assert (draws[:, 0] == 3).all()
    assert ((draws[:, 1] >= 0) & (draws[:, 1] < 10)).all()
    assert (torch.bincount(draws[:, 1], minlength=10) > 350).all()  # ~500 each
    assert ((draws[:, 2] <= 30)).all() and (draws[:, 2] == 30).float().mean() > 0.99
    assert ((draws[:, 3] == 0) | (draws[:, 3] == 39)).all()
    assert (p.gather(1, draws.T) > 0).all()


def test_draw_scaled_uniform_stays_below_the_total():
    """The guard behind 'never a zero-probability token': u * total < total in fp32."""
    g = torch.Generator().manual_seed(2)
    total = torch.exp(torch.empty(1_000_000).uniform_(-60, 60, generator=g))  # fp32, 1e-26 .. 1e26
    total = torch.cat([total, torch.tensor([1.0, 0.99999994, 1.0000001, 0.5, 2.0])])
    u = torch.full_like(total, _U_MAX)
    assert (u * total < total).all()
    v = torch.empty(1_000_000).uniform_(0.0, _U_MAX, generator=g)
    assert float(v.max()) <= _U_MAX and float(v.min()) >= 0.0


def test_draw_is_deterministic_and_row_local():
    p = torch.softmax(torch.randn(64, 50, generator=torch.Generator().manual_seed(3)), -1)
    a = draw_tokens(p, torch.Generator().manual_seed(7))
    b = draw_tokens(p, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    # row b's token depends on row b and the b-th number only: the first 10 rows of a larger
    # batch draw the same tokens as those 10 rows alone
    c = draw_tokens(p[:10], torch.Generator().manual_seed(7))
    assert torch.equal(a[:10], c)


def test_draw_nan_row_stays_in_range():
    p = torch.tensor([[0.5, 0.5, 0.0], [float("nan")] * 3])
    tok = draw_tokens(p, torch.Generator().manual_seed(0))
    assert tok[0] in (0, 1) and 0 <= int(tok[1]) < 3


# ----------------------------------------------------------------------------- sample_next
def test_sample_next_temperature_one_no_truncation_reuses_model_logprobs():
    logits = torch.randn(32, V, generator=torch.Generator().manual_seed(0))
    tok, lp, lps = sample_next(logits, SamplingParams(), torch.Generator().manual_seed(0))
    assert torch.equal(lp, lps)
    assert torch.equal(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(top_k=3),
                                    SamplingParams(top_p=0.5), SamplingParams(temperature=1.3, top_k=5, top_p=0.8)])
def test_sample_next_respects_truncation_and_temperature(params):
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1))
    z = logits / params.temperature
    logp_s = torch.log_softmax(truncate(z, params), -1)
    g = torch.Generator().manual_seed(0)
    n, counts = 3000, torch.zeros(8, V)
    for _ in range(n):
        tok, lp, lps = sample_next(logits, params, g)
        assert torch.isfinite(logp_s.gather(-1, tok[:, None])).all()  # never a truncated token
        assert torch.equal(lps, logp_s.gather(-1, tok[:, None]).squeeze(-1))
        assert torch.equal(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))
        counts[torch.arange(8), tok] += 1
    assert (counts / n - logp_s.exp()).abs().max() < 0.04  # 3000 draws: sd <= 0.0092


def test_sample_next_checks_finite_unless_told_not_to():
    logits = torch.zeros(2, V)
    logits[1, 3] = float("nan")
    with pytest.raises(NonFiniteLogitsError):
        sample_next(logits, SamplingParams(), torch.Generator())
    sample_next(logits, SamplingParams(), torch.Generator(), check_finite=False)


def test_rollout_with_nonfinite_logits_raises():
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("nan")
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(NonFiniteLogitsError):
        engine.generate([[5, 6, 7]] * 4, max_new_tokens=4)


# ----------------------------------------------------------------------------- decode loop
def _old_generate(self, prompts, tokens, key_valid, P, *, max_new_tokens, sampling, generator, logits_processor):
    """The decode loop as it was before the once-per-rollout bookkeeping (boolean-indexed writes,
    two host reads per step), with per-step positions and masks (``_step``)."""
    B, S = tokens.shape
    dev = tokens.device
    logp = torch.zeros(B, S, dtype=torch.float32, device=dev)
    logp_s = torch.zeros(B, S, dtype=torch.float32, device=dev)
    mask = torch.zeros(B, S, dtype=torch.bool, device=dev)
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    rows = torch.arange(B, device=dev)
    logits, state = self._prefill(tokens, key_valid, P)
    cache = state.cache
    for i in range(max_new_tokens):
        col = P + i
        tok, lp, lps = sample_next(logits, sampling, generator)
        live = ~finished[rows]
        tok = torch.where(live, tok, torch.full_like(tok, self.pad_token_id))
        tokens[rows, col] = tok
        r = rows[live]
        logp[r, col] = lp[live]
        logp_s[r, col] = lps[live]
        mask[r, col] = True
        finished[r[tok[live] == self.eos_token_id]] = True
        if bool(finished.all()) or i == max_new_tokens - 1:
            break
        keep = ~finished[rows]
        if self.compact_below > 0 and int(keep.sum()) <= self.compact_below * len(rows):
            cache = type(cache)([k[keep] for k in cache.keys], [v[keep] for v in cache.values])
            rows = rows[keep]
        held, valid = tokens[rows], key_valid[rows]
        h = self.model.hidden_states(held[:, col : col + 1], self._step(valid, col, 1), cache, self.mode)
        logits = self.model.logits_from_hidden(h[:, -1], self.mode)
    return self._rollout(tokens, key_valid, P, response_mask=mask, logprobs=logp, sampling_logprobs=logp_s,
                         finished=finished)


@pytest.mark.parametrize("cls", [ExactEngine, FastEngine])
@pytest.mark.parametrize("compact_below", [0.0, 0.75])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9),
                                      SamplingParams(temperature=0)])
def test_once_per_rollout_decode_equals_per_step_decode(cls, compact_below, sampling):
    model = tiny_model(eos_prob=0.15)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 9, (13,), generator=g)]  # ragged: left padding
    engine = cls(model, eos_token_id=EOS, pad_token_id=PAD)
    engine.compact_below = compact_below
    new = engine.generate(prompts, max_new_tokens=20, sampling=sampling, generator=torch.Generator().manual_seed(5))
    old_engine = cls(model, eos_token_id=EOS, pad_token_id=PAD)
    old_engine.compact_below = compact_below
    old_engine._generate = _old_generate.__get__(old_engine)
    old = old_engine.generate(prompts, max_new_tokens=20, sampling=sampling, generator=torch.Generator().manual_seed(5))
    assert new.finished.any() and not new.finished.all() or sampling.temperature == 0
    for name in ("tokens", "key_valid", "response_mask", "logprobs", "sampling_logprobs", "lengths", "finished"):
        assert torch.equal(getattr(new, name), getattr(old, name)), name
    if cls is ExactEngine:  # and still the trainer's bits
        logp = trainer_logprobs(model, new)
        assert torch.equal(logp[new.response_mask], new.logprobs[new.response_mask])


def test_decode_without_the_whole_mask_is_the_same(monkeypatch):
    import timlab.engines.native as native

    model = tiny_model()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 5
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    a = engine.generate(prompts, max_new_tokens=12, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(native, "MAX_MASK_ELEMENTS", 0)  # per-step mask rows
    b = engine.generate(prompts, max_new_tokens=12, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
