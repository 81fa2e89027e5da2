"""Rollout engines: the exact engine is bitwise equal to the trainer, the fast one only close.

The central claim of timlab's zero-mismatch setting: for every sampled token the exact engine's
KV-cached log-prob is the *same float* as the trainer's teacher-forced log-prob computed with
autograd enabled (``torch.equal``, not allclose), whatever the batch size, the padding, the
dtype, the architecture (a mixture-of-experts one included) or when each sequence hits EOS.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timlab.engines import ENGINES, SamplingParams, build_engine
from timlab.engines.native import _DecodeState
from timlab.model.forward import full_step, token_logprobs
from timlab.model.llama import CausalLM, ModelConfig, random_init_

EOS, PAD, V = 2, 0, 24
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
DTYPES = (torch.float32, torch.bfloat16)
BATCH_SIZES = (1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 33)


def tiny_model(arch: str = "llama", dtype=torch.float32, *, seed: int = 0, eos_prob: float | None = 0.08) -> CausalLM:
    """A 2-layer random model with non-trivial weights (std 0.3), GQA, untied head (qwen3_moe: both
    MLPs sparse, 8 experts of width 16, top-2).

    With ``eos_prob`` the LM head's EOS row is shifted along the mean final hidden state so the
    average EOS probability is about that value: sequences end at different steps.
    """
    cfg = ModelConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, model_type=arch,
        attention_bias=arch == "llama", eos_token_id=EOS, pad_token_id=PAD, max_position_embeddings=256,
        **(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16) if arch == "qwen3_moe" else {}),
    )
    g = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        random_init_(model, g)
        if eos_prob is not None:
            _make_eos_likely(model, eos_prob, g)
    model.refresh_rope()
    return model.to(dtype)


def _make_eos_likely(model: CausalLM, target: float, g: torch.Generator) -> None:
    """Bisect a shift of the EOS row along the mean final hidden state to hit ``target`` mean p(EOS)."""
    tokens = torch.randint(4, V, (16, 32), generator=g)  # (B, S)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    h = model.hidden_states(tokens, full_step(valid)).reshape(-1, model.config.hidden_size)  # (N, hidden)
    u = h.mean(0) / h.mean(0).norm()
    base = model.lm_head.weight[EOS].clone()
    lo, hi = -20.0, 20.0
    for _ in range(40):
        beta = (lo + hi) / 2
        model.lm_head.weight[EOS] = base + beta * u
        p_eos = torch.softmax(model.logits_from_hidden(h), -1)[:, EOS].mean()
        lo, hi = (beta, hi) if p_eos < target else (lo, beta)


def ragged_prompts(n: int, *, offset: int = 0) -> list[list[int]]:
    """n prompts of lengths 1..6 over the ordinary tokens 4..V-1."""
    return [[4 + (7 * (i + offset) + 3 * j) % (V - 4) for j in range(1 + (i + offset) % 6)] for i in range(n)]


def trainer_logprobs(model: CausalLM, r) -> torch.Tensor:
    """The trainer's forward, autograd enabled, as in the RL step."""
    with torch.enable_grad():
        logp, _ = token_logprobs(model, r.tokens, r.key_valid, mode="exact")
    assert logp.requires_grad
    return logp.detach()


# ------------------------------------------------------------------------------ bitwise equality
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_exact_engine_bitwise_equals_trainer(arch, dtype):
    model = tiny_model(arch, dtype)
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    all_lengths = []
    for B in BATCH_SIZES:
        r = engine.generate(ragged_prompts(B), max_new_tokens=12, generator=torch.Generator().manual_seed(B))
        logp = trainer_logprobs(model, r)
        m = r.response_mask
        assert torch.equal(logp[m], r.logprobs[m]), f"B={B}: max |r| {float((logp - r.logprobs)[m].abs().max())}"
        assert torch.equal(r.logprobs[~m], torch.zeros_like(r.logprobs[~m]))
        assert torch.equal(r.lengths, m.sum(-1))
        all_lengths += r.lengths.tolist()
        # the mask ends at EOS exactly: EOS is the last masked token of every finished row
        for b in range(B):
            resp = r.tokens[b][m[b]]
            assert (resp[:-1] != EOS).all()
            assert bool(resp[-1] == EOS) == bool(r.finished[b])
    # early EOS happened: sequences stopped at many different steps, some ran to the limit
    assert len(set(all_lengths)) >= 5, all_lengths
    assert 12 in all_lengths and min(all_lengths) < 12


_MODELS: dict = {}


def _cached_model(arch, dtype):
    if (arch, dtype) not in _MODELS:
        _MODELS[arch, dtype] = tiny_model(arch, dtype)
    return _MODELS[arch, dtype]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=20),
    arch=st.sampled_from(ARCHS),
    dtype=st.sampled_from(DTYPES),
    max_new_tokens=st.integers(1, 10),
    seed=st.integers(0, 2**31 - 1),
)
def test_exact_engine_bitwise_property(lengths, arch, dtype, max_new_tokens, seed):
    """Any batch of prompt lengths, any budget: exact rollout log-probs == trainer log-probs."""
    model = _cached_model(arch, dtype)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]  # 3 = <unk> included
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(prompts, max_new_tokens=max_new_tokens, generator=g)
    logp = trainer_logprobs(model, r)
    assert torch.equal(logp[r.response_mask], r.logprobs[r.response_mask])


@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_batch_composition_invariance(dtype):
    """Greedy: a prompt's tokens and log-probs are the same alone or inside a bigger ragged batch."""
    model = tiny_model("llama", dtype)
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    greedy = SamplingParams(temperature=0)
    prompts = ragged_prompts(17)
    big = engine.generate(prompts, max_new_tokens=12, sampling=greedy)
    assert len(set(big.lengths.tolist())) > 1  # rows finish at different steps
    for i in (0, 5, 16):  # widths differ from the batch's, so padding and P differ too
        alone = engine.generate([prompts[i]], max_new_tokens=12, sampling=greedy)
        a, b = alone.response_mask[0], big.response_mask[i]
        assert torch.equal(alone.tokens[0][a], big.tokens[i][b])
        assert torch.equal(alone.logprobs[0][a], big.logprobs[i][b])


@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_shared_prefill_changes_no_bit(dtype, monkeypatch):
    """Groups of samples share one prefill per distinct prompt: the same rollout, bit for bit,
    as prefilling every row, and still equal to the trainer."""
    monkeypatch.setattr("timlab.engines.native.MIN_SKIP_MACS", 0)  # share even for this tiny model
    model = tiny_model("qwen3", dtype)
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = [p for p in ragged_prompts(5) for _ in range(4)]  # 5 groups of 4 samples

    def run():
        return engine.generate(prompts, max_new_tokens=12, generator=torch.Generator().manual_seed(3))

    shared = run()
    engine.share_prefill = False
    alone = run()
    for f in ("tokens", "logprobs", "sampling_logprobs", "response_mask", "lengths"):
        assert torch.equal(getattr(shared, f), getattr(alone, f)), f
    m = shared.response_mask
    assert torch.equal(trainer_logprobs(model, shared)[m], shared.logprobs[m])


@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_decode_workspace_changes_no_bit(dtype, monkeypatch):
    """The decode calls reuse the exact attention's padded buffers (``Step.workspace``): the same
    rollout, bit for bit, as padding per call, and still equal to the trainer, with rows leaving
    the decode batch on the way (a new batch, a new workspace)."""
    model = tiny_model("llama", dtype)
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = ragged_prompts(12)
    step, steps = _DecodeState.step, []

    def recorded(self, col, exact):
        steps.append(step(self, col, exact))
        return steps[-1]

    def run():
        return engine.generate(prompts, max_new_tokens=40, generator=torch.Generator().manual_seed(5))

    monkeypatch.setattr(_DecodeState, "step", recorded)
    reused = run()
    assert len(steps) == int(reused.lengths.max()) - 1 and all(s.workspace for s in steps)
    assert len({id(s.workspace) for s in steps}) > 1  # compaction started a new one
    monkeypatch.setattr(_DecodeState, "step", lambda self, col, exact: replace(step(self, col, exact), workspace=None))
    fresh = run()
    for f in ("tokens", "logprobs", "sampling_logprobs", "response_mask", "lengths"):
        assert torch.equal(getattr(reused, f), getattr(fresh, f)), f
    m = reused.response_mask
    assert torch.equal(trainer_logprobs(model, reused)[m], reused.logprobs[m])


def test_seed_reproducibility():
    model = tiny_model()
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = ragged_prompts(8)

    def run(seed):
        return engine.generate(prompts, max_new_tokens=12, generator=torch.Generator().manual_seed(seed))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)


def test_fast_engine_close_but_not_bitwise():
    model = tiny_model("llama", torch.float32)
    engine = build_engine("fast", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(ragged_prompts(16), max_new_tokens=12, generator=torch.Generator().manual_seed(0))
    logp = trainer_logprobs(model, r)
    m = r.response_mask
    diff = (logp - r.logprobs)[m].abs()
    assert not torch.equal(logp[m], r.logprobs[m])
    assert 0 < float(diff.max()) < 1e-4


# ------------------------------------------------------------------------------ sampling
def _logits_before(model: CausalLM, r) -> torch.Tensor:
    """logits (B, S, V) whose column c-1 produced token c (exact path = what the engine used)."""
    with torch.no_grad():
        return model(r.tokens, full_step(r.key_valid))


def test_untruncated_sampling_logprobs_equal_model_logprobs():
    model = tiny_model()
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(ragged_prompts(8), max_new_tokens=12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(r.sampling_logprobs, r.logprobs)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (4, 0.7)])
def test_truncation_raises_sampling_logprobs_and_keeps_tokens_in_top_k(top_k, top_p):
    model = tiny_model()
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    r = engine.generate(ragged_prompts(16), max_new_tokens=12, sampling=params,
                        generator=torch.Generator().manual_seed(3))
    m = r.response_mask
    # renormalizing over a subset can only raise the probability of a kept token
    assert (r.sampling_logprobs[m] >= r.logprobs[m]).all()
    assert (r.sampling_logprobs[m] > r.logprobs[m]).any()
    logits = _logits_before(model, r)  # (B, S, V)
    b, c = m.nonzero(as_tuple=True)
    prev = logits[b, c - 1]  # (N, V)
    chosen = r.tokens[b, c]  # (N,)
    if top_k:
        topk = prev.topk(top_k, dim=-1).indices  # (N, k)
        assert (topk == chosen[:, None]).any(-1).all()
    # sampling log-probs are the log-prob under the truncated, renormalized distribution: <= 0
    assert (r.sampling_logprobs[m] <= 0).all()


def test_temperature_sampling_logprobs():
    model = tiny_model()
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(ragged_prompts(8), max_new_tokens=12, sampling=SamplingParams(temperature=0.5),
                        generator=torch.Generator().manual_seed(0))
    m = r.response_mask
    logits = _logits_before(model, r)
    b, c = m.nonzero(as_tuple=True)
    expected = torch.log_softmax(logits[b, c - 1] / 0.5, -1).gather(-1, r.tokens[b, c][:, None]).squeeze(-1)
    torch.testing.assert_close(r.sampling_logprobs[b, c], expected, rtol=0, atol=1e-5)
    model_lp = torch.log_softmax(logits[b, c - 1], -1).gather(-1, r.tokens[b, c][:, None]).squeeze(-1)
    assert torch.equal(r.logprobs[b, c], model_lp)  # log mu stays the temperature-1 distribution


def test_greedy_picks_argmax():
    model = tiny_model()
    engine = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD)
    r = engine.generate(ragged_prompts(8), max_new_tokens=12, sampling=SamplingParams(temperature=0))
    m = r.response_mask
    logits = _logits_before(model, r)
    b, c = m.nonzero(as_tuple=True)
    assert torch.equal(r.tokens[b, c], logits[b, c - 1].argmax(-1))
    assert torch.equal(r.sampling_logprobs, torch.zeros_like(r.sampling_logprobs))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.1}, "temperature must be 0 (greedy) or in [0.001, 1000]"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be >= 0"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_registry_lists_engines():
    assert {"exact", "fast", "hf"} <= set(ENGINES.names())
    with pytest.raises(KeyError) as e:
        build_engine("nope", tiny_model(), eos_token_id=EOS)
    assert "valid choices:" in str(e.value) and "exact, fast, hf" in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_scoring_only_realized_columns_is_still_bitwise(dtype):
    """The trainer scores L = prompt width + longest response columns, padding keys to S."""
    from timlab.model.forward import token_logprobs
    from timlab.model.llama import CausalLM, ModelConfig

    cfg = ModelConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    m = CausalLM(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        m.lm_head.weight[2] += 1.5  # EOS likely: sequences end at different steps
    m = m.to(dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(13)]
    from timlab.engines import build_engine

    r = build_engine("exact", m, eos_token_id=2, pad_token_id=0).generate(prompts, max_new_tokens=40, generator=torch.Generator().manual_seed(1))
    S = r.tokens.shape[1]
    L = r.prompt_width + int(r.lengths.max())
    assert L < S and len(set(r.lengths.tolist())) > 2
    with torch.enable_grad():
        lp, _ = token_logprobs(m, r.tokens[:, :L], r.key_valid[:, :L], kv_len=S)
    mk = r.response_mask[:, :L]
    assert torch.equal(lp.detach()[mk], r.logprobs[:, :L][mk])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_trainer_skipping_unneeded_positions_is_still_bitwise(arch, dtype, monkeypatch):
    """With ``score_mask`` the trainer computes only the positions the response log-probs depend
    on (no left padding, nothing after a row's EOS): the same bits there as the full forward and
    as the rollout, finite values elsewhere, and gradients that agree with the full forward's."""
    monkeypatch.setattr("timlab.model.forward.MIN_SKIP_MACS", 0)  # skip even for this tiny model
    model = tiny_model(arch, dtype)
    r = build_engine("exact", model, eos_token_id=EOS, pad_token_id=PAD).generate(
        ragged_prompts(19), max_new_tokens=16, generator=torch.Generator().manual_seed(2))
    assert len(set(r.lengths.tolist())) > 2
    S, mk = r.tokens.shape[1], r.response_mask
    grads = []
    for score_mask in (None, mk):
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            lp, ent = token_logprobs(model, r.tokens, r.key_valid, kv_len=S, with_entropy=True, score_mask=score_mask)
            (lp * mk).sum().backward()
        assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
        assert torch.equal(lp.detach()[mk], r.logprobs[mk])
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-3 if dtype == torch.float32 else 5e-2, atol=1e-5)


# ------------------------------------------------------------------------------ processors reading the tokens
def no_repeat(seen: list[int]):
    """A processor that reads the tokens so far (``reads_tokens``) and bans each row's last token;
    ``seen`` gets the row count of each call."""

    def proc(logits, col, tokens):
        assert tokens.shape == (logits.shape[0], int(col[0]))  # (n, col): the held rows, up to the column
        seen.append(tokens.shape[0])
        return logits.scatter(-1, tokens[:, -1:], float("-inf"))

    proc.reads_tokens = True
    return proc


def repeats(r) -> int:
    """Response tokens equal to the token before them (the previous column)."""
    m = r.response_mask[:, 1:]
    return int(((r.tokens[:, 1:] == r.tokens[:, :-1]) & m).sum())


@pytest.mark.parametrize("name, compact", [("exact", 0.0), ("exact", 0.9), ("fast", 0.9)])
def test_processor_reading_tokens_sees_each_rows_own_tokens(name, compact):
    """A ``reads_tokens`` processor gets the (n, col) tokens of exactly the rows it processes, also
    after finished rows were dropped from the decode batch (row i of the tokens is row i of the
    logits): banning each row's previous token leaves no repeat, where the plain rollout has many."""
    model = tiny_model(eos_prob=0.04)
    engine = build_engine(name, model, eos_token_id=EOS, pad_token_id=PAD)
    engine.compact_below = compact
    prompts = ragged_prompts(16)
    plain = engine.generate(prompts, max_new_tokens=40, generator=torch.Generator().manual_seed(0))
    seen: list[int] = []
    r = engine.generate(prompts, max_new_tokens=40, generator=torch.Generator().manual_seed(0),
                        logits_processor=no_repeat(seen))
    assert repeats(plain) >= 10 and repeats(r) == 0
    assert seen[0] == 16 and (min(seen) < 16) == (compact > 0)  # compaction happened where it is on
