"""The two shape rules the exact path relies on, checked on this machine's kernels.

If a future torch or BLAS breaks them, these tests fail before the zero-mismatch guard does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from timlab.model.ops import ATTN_MIN_ROWS, MIN_ROWS, fixed_length_attention, invariant_linear, pad_rows


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
    """Why the padding exists: without it, 1-3 rows take another kernel (fp32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g)
    w = torch.randn(512, 128, generator=g)
    full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in (1, 2, 3))


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


def test_pad_rows():
    x = torch.ones(3, 2)
    p = pad_rows(x, 5)
    assert p.shape == (5, 2) and p[3:].abs().sum() == 0
    assert pad_rows(torch.ones(6, 2), 5).shape == (6, 2)
    assert MIN_ROWS >= ATTN_MIN_ROWS >= 4
