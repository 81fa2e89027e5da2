"""The exactness harness's fixed subset: the exact engine's rollout log-probs equal the trainer's
forward (three ways) bit for bit, on cases that together cover every axis of the search space of
``timlab.experiments.diagnostics.exactness`` (``bench/exactness_fuzz.py`` runs the randomized search).

The table is explicit rather than drawn, so editing the search space cannot silently change what
the suite checks; ``test_the_table_covers_every_axis`` keeps it complete. The three real widths
run with a small vocabulary and one or two layers (the per-layer shapes are the real ones; a real
vocabulary's folder is too big for the suite: the harness runs those).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytest.importorskip("transformers")

from timlab.engines.device_loop import DeviceLoop  # noqa: E402
from timlab.experiments.diagnostics import exactness as ex  # noqa: E402
from timlab.model.llama import ARCHITECTURES  # noqa: E402
from timlab.model import ops  # noqa: E402


def _prompts(seed: int, rows: int, lo: int, hi: int, vocab: int, samples: int = 1, prefix: int = 0) -> tuple:
    rng = random.Random(seed)
    head = [rng.randrange(3, vocab) for _ in range(prefix)]
    distinct = [tuple(head + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))])
                for _ in range(max(1, rows // samples))]
    return tuple(p for p in distinct for _ in range(samples))[:rows]


def _arch(model_type, hidden, heads, kv, head_dim, *, layers=2, vocab=64, inter=None, **kw) -> ex.Arch:
    return ex.Arch(model_type=model_type, hidden=hidden, intermediate=inter or 2 * hidden, layers=layers, heads=heads,
                   kv_heads=kv, head_dim=head_dim, vocab=vocab, **kw)


def _real(name: str, layers: int = 1) -> ex.Arch:
    spec = dict(ex.REAL_WIDTHS[name], vocab=256)
    return ex.Arch(layers=layers, width=name, eos_rate=0.1, **spec)


A = {  # the architectures of the table (each folder is written once per session)
    "llama": _arch("llama", 64, 4, 2, 16, eos_rate=0.1),
    "qwen2": _arch("qwen2", 96, 6, 2, 16, inter=234, eos_rate=0.03),  # odd intermediate: SiLU's scalar tail
    "qwen3": _arch("qwen3", 96, 4, 2, 24, vocab=58, head_scale=30.0, eos_rate=0.05),
    "gqa1": _arch("llama", 48, 3, 3, 8, layers=3, tie=True, eos_rate=0.2),
    "gqa3": _arch("qwen3", 72, 3, 1, 32, layers=1, inter=156, eos_rate=0.1),
    "gqa4": _arch("qwen2", 128, 8, 2, 128, layers=1, vocab=512, head_scale=1.0, eos_rate=0.01),
    "wide_head": _arch("qwen3", 78, 2, 1, 16, layers=4, vocab=256, inter=234, head_scale=1.0, eos_rate=0.2),
    # Qwen3-MoE: experts of odd width, renormalized top-k; every other layer sparse, top-1
    "moe": _arch("qwen3_moe", 64, 4, 2, 16, eos_rate=0.1, experts=8, top_k=2, expert_intermediate=24, norm_topk=True),
    "moe_step2": _arch("qwen3_moe", 96, 6, 2, 16, layers=3, vocab=100, eos_rate=0.05, experts=16, top_k=1,
                       expert_intermediate=48, sparse_step=2),
    "qwen3-0.6b": _real("qwen3-0.6b"),
    "qwen2.5-0.5b": _real("qwen2.5-0.5b"),
    "llama-3.2-1b": _real("llama-3.2-1b"),
}


def _case(i, arch, dtype, threads=1, rows=8, lens=(1, 20), N=24, compact=0.75, T=1.0, k=0, p=1.0, samples=1,
          prefix=0) -> ex.Case:
    a = A[arch]
    return ex.Case(seed=-1, index=i, arch=a, dtype=dtype, threads=threads,
                   prompts=_prompts(i, rows, *lens, a.vocab, samples, prefix), max_new_tokens=N, compact_below=compact,
                   temperature=T, top_k=k, top_p=p, sample_seed=1000 + i)


CASES = [
    # every architecture in every dtype, ragged rows that stop at many steps, default compaction
    _case(0, "llama", "float32"), _case(1, "llama", "bfloat16"), _case(2, "llama", "float16"),
    _case(3, "qwen2", "float32"), _case(4, "qwen2", "bfloat16"), _case(5, "qwen2", "float16"),
    _case(6, "qwen3", "float32", rows=33, samples=3), _case(7, "qwen3", "bfloat16", rows=33, samples=3),
    _case(8, "qwen3", "float16", rows=33, samples=3),
    # threads
    _case(9, "llama", "float32", threads=2, rows=20), _case(10, "qwen2", "float32", threads=4, rows=20),
    _case(11, "qwen3", "bfloat16", threads=2, rows=12), _case(12, "llama", "float16", threads=4, rows=7),
    # compaction off and at odd levels
    _case(13, "qwen3", "bfloat16", compact=0.0, rows=20), _case(14, "qwen2", "float16", compact=0.33, rows=20),
    _case(15, "llama", "float32", compact=0.97, rows=20), _case(16, "wide_head", "float32", compact=0.0, rows=33),
    # batch sizes 1 and 64, long prompts, shared prefixes, repeated prompts
    _case(17, "gqa1", "float32", rows=1, lens=(60, 60)), _case(18, "gqa1", "bfloat16", rows=64, lens=(1, 60), N=8),
    _case(19, "qwen3", "float32", rows=16, prefix=20, lens=(1, 10)), _case(20, "qwen2", "bfloat16", rows=16, samples=8),
    _case(21, "llama", "float16", rows=24, samples=4, prefix=8),
    # up to 128 new tokens
    _case(22, "gqa3", "float32", rows=4, N=128), _case(23, "gqa3", "bfloat16", rows=4, N=128),
    _case(24, "gqa1", "float16", rows=2, N=96),
    # sampling settings: greedy, temperature, top-k, top-p, all at once
    _case(25, "qwen3", "float32", T=0.0), _case(26, "qwen3", "bfloat16", T=1.3), _case(27, "llama", "float16", T=0.6),
    _case(28, "qwen2", "float32", k=5), _case(29, "qwen2", "bfloat16", k=1), _case(30, "qwen3", "float16", p=0.8),
    _case(31, "llama", "bfloat16", p=0.5), _case(32, "gqa4", "float32", T=0.7, k=20, p=0.95),
    # GQA ratios 1-4 and head dims 8-128
    _case(33, "gqa1", "float32", rows=12), _case(34, "gqa3", "float16", rows=12), _case(35, "gqa4", "bfloat16", rows=6),
    _case(36, "wide_head", "bfloat16", rows=12, threads=2),
    # the per-layer shapes of real models (small vocabulary)
    _case(37, "qwen3-0.6b", "float32", rows=3, N=8), _case(38, "qwen2.5-0.5b", "bfloat16", rows=3, N=8),
    _case(39, "llama-3.2-1b", "float16", rows=2, N=6),
    # mixture of experts: every dtype, threads, compaction, shared prefill
    _case(40, "moe", "float32", rows=20), _case(41, "moe", "bfloat16", rows=33, samples=3),
    _case(42, "moe", "float16", threads=2, rows=12), _case(43, "moe_step2", "bfloat16", compact=0.0, rows=16),
    _case(44, "moe_step2", "float32", threads=4, rows=24, prefix=8, T=0.7, k=20),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("exactness-folders")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.index}-{c.arch.model_type}-{c.arch.width}-{c.dtype}")
def test_exact_rollout_equals_trainer_bitwise(case, cache):
    res = ex.run_case(case, cache)
    assert res.tokens > 0
    assert res.ok, (case.summary(), res.bad, res.max_abs_diff)


@pytest.mark.parametrize("case", CASES[::5], ids=lambda c: f"{c.index}-{c.arch.model_type}-{c.arch.width}-{c.dtype}")
def test_device_loop_rollout_equals_trainer_bitwise(case, cache):
    """The same check with the engine's device-side decode loop (``timlab.engines.device_loop``)."""
    res = ex.run_case(case, cache, loop=DeviceLoop(sync_every=3, buckets=(4, 16, 32)))
    assert res.tokens > 0
    assert res.ok, (case.summary(), res.bad, res.max_abs_diff)


def test_the_table_covers_every_axis():
    cov = ex.coverage(CASES)
    assert set(cov["model_type"]) == set(ARCHITECTURES)
    assert set(cov["dtype"]) == set(ex.DTYPES)
    assert set(cov["threads"]) == set(ex.THREADS)
    assert set(cov["width"]) == {"tiny", *ex.REAL_WIDTHS}
    assert set(cov["compaction"]) == {"off", "default", "random"}
    assert {"greedy", "T", "top_k", "top_p", "T+top_k+top_p"} <= set(cov["sampling"])
    assert set(cov["gqa_ratio"]) >= {1, 2, 3, 4}
    assert set(cov["rows"]) == {"1", "2-16", "17-64"} and max(len(c.prompts) for c in CASES) == 64
    assert cov["shared_prefill"].get(True) and max(c.max_new_tokens for c in CASES) == 128
    assert {c.arch.head_dim for c in CASES} >= {8, 16, 128}


def test_rows_stop_at_many_steps(cache):
    """The EOS row makes the batch ragged: the lengths of one case spread over the budget."""
    case = CASES[0]
    res = ex.run_case(dataclasses.replace(case, max_new_tokens=48, prompts=_prompts(0, 24, 1, 20, case.arch.vocab)), cache)
    assert len(set(res.lengths)) >= 12 and min(res.lengths) <= 4 and max(res.lengths) == 48, res.lengths


def test_draw_case_is_seeded():
    assert ex.draw_case(3, 7) == ex.draw_case(3, 7)
    assert ex.draw_case(3, 7) != ex.draw_case(3, 8)
    cases = [ex.draw_case(0, i) for i in range(300)]
    cov = ex.coverage(cases)
    assert set(cov["dtype"]) == set(ex.DTYPES) and set(cov["model_type"]) == set(ARCHITECTURES)
    assert len(cov["width"]) >= 2  # some real widths among 300 draws
    assert 40 <= cov["model_type"]["qwen3_moe"] <= 110  # MOE_FRAC of the tiny ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_bits_do_not_depend_on_the_row_count(dtype):
    """F.silu's scalar tail rounds differently from its vectorized body in fp32; ops.silu never uses it."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(70, 234, generator=g)).to(dtype)  # 234 columns: not a whole number of vectors
    full = ops.silu(x)
    for rows in (1, 2, 3, 7, 16, 33, 69):
        assert torch.equal(ops.silu(x[:rows]), full[:rows])
    if dtype == torch.float32:  # the vectorized exp: within an ulp of the stock result
        torch.testing.assert_close(full, torch.nn.functional.silu(x), rtol=2e-7, atol=1e-7)
    else:  # rounding to bf16/fp16 hides the scalar/vector difference: the stock bits
        assert torch.equal(full, torch.nn.functional.silu(x))


def test_stock_silu_has_the_tail_that_ops_silu_avoids():
    """The measurement behind ops.silu: on this build F.silu's bits depend on the tensor's length."""
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(4096, generator=g)
    full = torch.nn.functional.silu(x)
    differ = sum(not torch.equal(torch.nn.functional.silu(x[:n]), full[:n]) for n in range(1, 300))
    if differ == 0:
        pytest.skip("this build's scalar and vectorized SiLU agree: nothing for ops.silu to avoid")
    assert differ > 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_bits_do_not_depend_on_the_key_layout(dtype):
    """A teacher-forced k, v is a view of (B, S, H_kv, D); the decode cache is contiguous. Same bits."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, S, D = 5, 4, 2, 48, 24
    q = (2 * torch.randn(B, S, H, D, generator=g)).to(dtype).transpose(1, 2)
    k = (2 * torch.randn(B, S, Hkv, D, generator=g)).to(dtype).transpose(1, 2)  # (B, H_kv, S, D), not contiguous
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    allowed = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    a = ops.fixed_length_attention(q, k, v, allowed, D**-0.5, start=0)
    b = ops.fixed_length_attention(q, k.contiguous(), v.contiguous(), allowed, D**-0.5, start=0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("n_out", [1, 8, 15])
def test_narrow_linear_bits_do_not_depend_on_row_alignment(n_out):
    """Fewer than 16 output columns (a MoE router over 8 experts): MKL's fp32 kernel gives a row other
    bits at another 16-byte alignment; invariant_linear pads the columns, so no row's bits move."""
    g = torch.Generator().manual_seed(n_out)
    w, x = torch.randn(n_out, 234, generator=g), torch.randn(64, 234, generator=g)  # 234 * 4 bytes: rows alternate
    ref = ops.invariant_linear(x, w)
    for offset in range(8):
        buf = torch.zeros(64 * 234 + 8)
        moved = buf[offset : offset + 64 * 234].view(64, 234)
        moved.copy_(x)
        assert torch.equal(ops.invariant_linear(moved, w), ref)
    assert all(torch.equal(ops.invariant_linear(x[i : i + 1], w), ref[i : i + 1]) for i in range(64))
    torch.testing.assert_close(ref, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
