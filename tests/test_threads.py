"""The exact path gives the same bits on 1, 2 and 4 torch threads, at real widths.

MKL's threaded fp32 GEMM changes the reduction of small row counts; ``timlab.model.cpu_gemm``
keeps every exact-path GEMM one-threaded and parallelizes over rows and sequences instead.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from timlab.engines import SamplingParams, build_engine
from timlab.model import cpu_gemm
from timlab.model.forward import token_logprobs
from timlab.model.hf_io import load_model
from timlab.model.ops import MIN_ROWS, fixed_length_attention, invariant_linear

THREADS = (1, 2, 4)


@contextlib.contextmanager
def num_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("K", [1024, 3072])
def test_gemms_give_one_thread_bits_on_more_threads(K):
    """Under 2 and 4 threads, ``cpu_gemm.linear`` (split into >= MIN_ROWS-row pieces from 32 rows)
    and a GEMM inside ``one_thread()`` equal the one-thread GEMM for every row count. (Stock
    F.linear on 2 threads differs for rows 5-7 and 9-11 on the machine this was written on.)"""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(72, K, generator=g), torch.randn(512, K, generator=g)
    ref = {m: F.linear(x[:m], w) for m in range(1, 73)}
    for t in THREADS[1:]:
        with num_threads(t):
            for m in range(1, 73):
                assert torch.equal(cpu_gemm.linear(x[:m], w, None, MIN_ROWS), ref[m]), (t, m)
            with cpu_gemm.one_thread():
                for m in range(1, 17):
                    assert torch.equal(F.linear(x[:m], w), ref[m]), (t, m)


@pytest.mark.parametrize("M", [1, 5, 16, 33, 130])
def test_invariant_linear_and_attention_bits_do_not_depend_on_threads(M):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(M, 1024, generator=g), torch.randn(2048, 1024, generator=g), torch.randn(2048, generator=g)
    q = torch.randn(M, 4, 3, 128, generator=g)  # (B, H, M, D): 4 heads over 2 KV heads, 3 queries
    k, v = torch.randn(M, 2, 48, 128, generator=g), torch.randn(M, 2, 48, 128, generator=g)
    allowed = torch.rand(M, 1, 3, 48, generator=g) < 0.7
    allowed[..., 0] = True
    ref = invariant_linear(x, w, b), fixed_length_attention(q, k, v, allowed, 0.088)
    for t in THREADS[1:]:
        with num_threads(t):
            assert torch.equal(invariant_linear(x, w, b), ref[0]), t
            assert torch.equal(fixed_length_attention(q, k, v, allowed, 0.088), ref[1]), t


@pytest.fixture(scope="module")
def real_width_folder(tmp_path_factory):
    """A random Qwen3 folder written by transformers with Qwen3-0.6B's widths (hidden 1024, MLP
    3072, 16 heads / 8 KV heads, head_dim 128); one layer and a 512-token vocabulary keep it fast."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=512, hidden_size=1024, intermediate_size=3072, num_hidden_layers=1,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=256,
        rope_theta=1e6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_width")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_engine_at_real_width_same_bits_on_1_2_4_threads(real_width_folder, dtype):
    """Rollout log-probs equal the trainer's (autograd on) on every thread count, and equal each
    other across thread counts; 32 sequences, so fp32 decode GEMMs are split across threads and
    SiLU runs in row blocks. The fp32 case also runs the backward through those splits. bf16
    GEMMs are never split (``cpu_gemm`` leaves them to oneDNN), so its backward would pass
    through no split, while costing ~25 s a thread count at this width on a CPU without bf16
    instructions (oneDNN's slow bf16 path): the bf16 case checks the forward, with autograd on."""
    model = load_model(real_width_folder).to(getattr(torch, dtype))
    engine = build_engine("exact", model, eos_token_id=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (32,), generator=g)]
    got = {}
    for t in THREADS:
        with num_threads(t):
            r = engine.generate(prompts, max_new_tokens=4, sampling=SamplingParams(), generator=torch.Generator().manual_seed(1))
            logp, _ = token_logprobs(model, r.tokens, r.key_valid, kv_len=r.tokens.shape[1])
            if dtype == "float32":
                logp.sum().backward()  # the trainer's forward keeps working with autograd through the split
        model.zero_grad(set_to_none=True)
        mu, pi = r.logprobs[r.response_mask], logp.detach()[r.response_mask]
        assert torch.equal(mu, pi), (t, float((mu - pi).abs().max()))
        got[t] = (r.tokens, mu)
    for t in THREADS[1:]:
        assert torch.equal(got[t][0], got[1][0]) and torch.equal(got[t][1], got[1][1]), t
