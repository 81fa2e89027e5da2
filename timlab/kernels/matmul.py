"""``F.linear`` as a Triton matmul whose rows do not depend on the batch.

One tile configuration for every shape and no split-K: output element (m, n) is the sum over K
in BLOCK_K chunks taken in order 0, BLOCK_K, 2 BLOCK_K, ..., accumulated in fp32, whatever M is
and whatever rows share its tile. cuBLAS, in contrast, picks its kernel (tile shape, split-K)
from M, N and K, so a decode step's few rows and the trainer's thousands get other bits. This is
the fixed-configuration approach of thinking-machines-lab/batch_invariant_ops, without its
persistent-kernel scheduling. The bias is added in fp32 before the one rounding to the output
dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from timlab.kernels.runtime import INTERPRETED, check_launchable, dot_acc, jit_unspecialized

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
"""The one tile configuration (rows, output columns, reduction chunk)."""
NUM_WARPS, NUM_STAGES = 4, 3
"""Launch settings on a GPU; they schedule the work and do not change the arithmetic."""

ROW_ARGS = ("M", "stride_xm", "stride_xk", "stride_ym", "stride_yn")
"""The integer arguments that change between calls on one weight (the trainer's thousands of rows,
a decode step's few): never specialized on, so every call on a weight runs one compiled kernel.
N, K and the weight's strides are the layer's own, the same in every call on it, so Triton may
specialize on their alignment (aligned, vectorized loads of the weight) without splitting a
layer's calls between kernels (measured on an H200: bench/RESULTS.md, "The invariant linear at
decode shapes")."""


@jit_unspecialized(*ROW_ARGS)
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) rows of x and y
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) rows of w = columns of y
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # (BM, 1)
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_wn  # (1, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # (BM, BK)
        b = tl.load(w_rows + kk[:, None] * stride_wk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)  # (BK, BN)
        acc = dot_acc(a, b, acc, INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _linear_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _linear_kernel[grid](
        x, weight, weight if bias is None else bias, y, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        INTERPRETED=INTERPRETED, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return y


class _Linear(torch.autograd.Function):
    """Forward by the kernel; backward by stock matmuls (the gradients need not be invariant)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_2d(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad: (M, N)
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None  # (M, K)
        gw = grad.t() @ x if ctx.needs_input_grad[1] else None  # (N, K)
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # (N,)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x (..., K), weight (N, K), bias (N,) -> (..., N), in x's dtype.

    Each output row has the same bits whatever the number of rows and whatever the other rows
    hold. Differentiable; the backward uses stock matmuls.
    """
    check_launchable(x, weight, bias)
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"linear: x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
                        f"{None if bias is None else bias.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, weight, bias)):
        y = _Linear.apply(x2, weight, bias)
    else:
        y = _linear_2d(x2, weight, bias)
    return y.reshape(*lead, weight.shape[0])  # (..., N)
