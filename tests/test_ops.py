"""The two shape rules the exact path relies on, checked on this machine's kernels.

If a future torch or BLAS breaks them, these tests fail before the zero-mismatch guard does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from timlab.model.forward import attention_mask
from timlab.model.ops import (ATTN_MIN_ROWS, MIN_ROWS, attention_keys, attention_quantum, fixed_length_attention,
                              invariant_linear, pad_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K, N", [(64, 192), (128, 512), (384, 128)])
def test_linear_rows_do_not_depend_on_row_count(dtype, K, N):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    full = invariant_linear(x, w, b)
    for m in (1, 2, 3, 5, 7, 16, 17, 33, 100, 299):
        assert torch.equal(invariant_linear(x[:m], w, b), full[:m]), m
    with torch.enable_grad():  # the trainer computes with autograd on
        xg = x.clone().requires_grad_(True)
        assert torch.equal(invariant_linear(xg, w, b).detach(), full)


def test_stock_linear_is_not_invariant_for_small_row_counts():
    """Why the padding exists: without it, 1-3 rows take another kernel (fp32). Checked in a child
    process with MKL as torch ships it (``TIMLAB_KEEP_CPU_ENV=1``): on an Intel CPU ``timlab.model``
    asks MKL for its strict mode, under which even 1-3 rows keep their bits."""
    import os
    import subprocess
    import sys

    code = ("import torch, torch.nn.functional as F\n"
            "g = torch.Generator().manual_seed(0)\n"
            "x, w = torch.randn(64, 128, generator=g), torch.randn(512, 128, generator=g)\n"
            "full = F.linear(x, w)\n"
            "print(sum(not torch.equal(F.linear(x[:m], w), full[:m]) for m in (1, 2, 3)))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}
    env.update(TIMLAB_KEEP_CPU_ENV="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout) >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, H_kv, D", [(4, 2, 16), (4, 4, 32), (8, 1, 8)])
def test_one_query_equals_its_row_in_the_full_forward(dtype, H, H_kv, D):
    g = torch.Generator().manual_seed(1)
    B, S = 3, 48
    q = torch.randn(B, H, S, D, generator=g).to(dtype)
    k = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    v = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    allowed = causal.expand(B, 1, S, S).clone()
    allowed[0, :, :, :5] = False  # left padding of sequence 0 ...
    allowed[0, :, torch.arange(S), torch.arange(S)] = True  # ... every query still sees itself
    full = fixed_length_attention(q, k, v, allowed, D**-0.5)  # (B, H, S, D)
    for t in (0, 1, 6, 20, 47):
        one = fixed_length_attention(q[:, :, t : t + 1], k, v, allowed[:, :, t : t + 1], D**-0.5)
        assert torch.equal(one, full[:, :, t : t + 1]), t


def _qkv_mask(B, H, H_kv, S, D, L, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    v = torch.randn(B, H_kv, S, D, generator=g).to(dtype)
    key_valid = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):
        key_valid[b, : int(torch.randint(0, max(1, L // 2), (1,), generator=g))] = False  # left padding
    return q, k, v, key_valid


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, H_kv, D, S, L", [
    (4, 2, 16, 48, 33), (4, 2, 16, 48, 48), (4, 4, 12, 16, 9), (8, 1, 32, 96, 71), (2, 2, 64, 256, 250),
    (16, 8, 128, 208, 150), (4, 1, 16, 512, 400), (4, 2, 16, 64, 1),
])
def test_key_blocks_decode_equals_trainer(threads, dtype, H, H_kv, D, S, L):
    """With ``start``, a query runs against attention_keys(col, S) keys whatever the call: a prefill
    plus one decode call per column gives the trainer's bits (one call over all L columns)."""
    q, k, v, key_valid = _qkv_mask(3, H, H_kv, S, D, L, dtype, seed=S + L)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer = fixed_length_attention(q, k, v, attention_mask(key_valid, 0, L, S), D**-0.5, start=0, cache={})
        P = max(1, L // 3)
        prefill = fixed_length_attention(q[:, :, :P], k, v, attention_mask(key_valid, 0, P, S), D**-0.5, start=0)
        assert torch.equal(prefill, trainer[:, :, :P])
        for c in sorted({P, P + 1, (P + L) // 2, L - 1} & set(range(P, L))):
            one = fixed_length_attention(q[:, :, c : c + 1], k, v, attention_mask(key_valid, c, 1, S), D**-0.5, start=c)
            assert torch.equal(one, trainer[:, :, c : c + 1]), c
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, H_kv, D, S, L", [(4, 2, 16, 96, 90), (8, 2, 32, 64, 60), (4, 4, 16, 256, 200)])
def test_decode_workspace_keeps_the_bits(dtype, H, H_kv, D, S, L):
    """A decode loop's workspace (reused zero-padded buffers) gives every decode call the bits of
    the call without it, hence the trainer's; one buffer per shape serves every later call and its
    padding rows stay zero."""
    q, k, v, key_valid = _qkv_mask(3, H, H_kv, S, D, L, dtype, seed=S + L + 1)
    trainer = fixed_length_attention(q, k, v, attention_mask(key_valid, 0, L, S), D**-0.5, start=0, cache={})
    workspace: dict = {}
    for c in range(L // 3, L):
        allowed = attention_mask(key_valid, c, 1, S)
        one = fixed_length_attention(q[:, :, c : c + 1], k, v, allowed, D**-0.5, start=c, workspace=workspace)
        assert torch.equal(one, trainer[:, :, c : c + 1]), c
    n = H // H_kv  # rows of a decode call's GEMMs: the query heads of one KV head
    blocks = {attention_keys(c, S) for c in range(L // 3, L)}
    assert sorted(key[5] for key in workspace if key[0] == "probs") == sorted(blocks)  # one per key count
    assert [key[5] for key in workspace if key[0] == "query"] == [D]  # one for the queries
    for key, buf in workspace.items():
        assert buf.shape == (3, H_kv, ATTN_MIN_ROWS, key[5]) and buf.dtype == dtype
        assert buf[:, :, n:].abs().sum() == 0


def test_workspace_is_left_alone_where_there_is_no_padding():
    """Blocks of ATTN_MIN_ROWS rows or more (prefill, the trainer) need no padding: nothing is kept."""
    q, k, v, key_valid = _qkv_mask(2, 8, 1, 48, 16, 40, torch.float32, seed=3)  # 8 query heads per KV head
    workspace: dict = {}
    out = fixed_length_attention(q[:, :, 20:21], k, v, attention_mask(key_valid, 20, 1, 48), 0.25, start=20,
                                 workspace=workspace)
    assert workspace == {}
    assert torch.equal(out, fixed_length_attention(q[:, :, 20:21], k, v, attention_mask(key_valid, 20, 1, 48), 0.25,
                                                   start=20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, H_kv, D, S, L", [(4, 2, 16, 48, 33), (8, 2, 12, 96, 90), (4, 4, 64, 512, 300)])
def test_key_blocks_are_the_same_attention(dtype, H, H_kv, D, S, L):
    """The key-block path computes the all-keys attention (close, not bitwise: a GEMM's bits may
    depend on its key count), and without ``start`` the bits of scale-then-masked_fill."""
    q, k, v, key_valid = _qkv_mask(2, H, H_kv, S, D, L, dtype, seed=7)
    allowed = attention_mask(key_valid, 0, L, S)
    full = fixed_length_attention(q, k, v, allowed, D**-0.5)
    blocks = fixed_length_attention(q, k, v, allowed, D**-0.5, start=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(blocks.float(), full.float(), atol=tol, rtol=tol)
    rep = H // H_kv  # the formulation before the additive mask: scores * scale, then masked_fill
    scores = torch.matmul(q.reshape(2, H_kv, rep * L, D), k.transpose(-1, -2)) * D**-0.5
    mask = allowed.unsqueeze(2).expand(2, 1, rep, L, S).reshape(2, 1, rep * L, S)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1, dtype=torch.float32).to(dtype)
    assert torch.equal(full, torch.matmul(probs, v).reshape(2, H, L, D))


def test_attention_keys():
    assert [attention_keys(c, 48) for c in (0, 15, 16, 31, 32, 47)] == [16, 16, 32, 32, 48, 48]
    assert attention_keys(40, 40) == 40  # never past the buffer
    assert attention_quantum(64) == 16 and attention_quantum(80) == 32 and attention_quantum(512) == 128
    assert all(-(-S // attention_quantum(S)) <= 4 for S in range(16, 2049, 16))


def test_pad_rows():
    x = torch.ones(3, 2)
    p = pad_rows(x, 5)
    assert p.shape == (5, 2) and p[3:].abs().sum() == 0
    assert pad_rows(torch.ones(6, 2), 5).shape == (6, 2)
    assert MIN_ROWS >= ATTN_MIN_ROWS >= 4
