"""RMSNorm and log-softmax as Triton kernels with one fixed reduction per row.

A row is read in BLOCK-wide chunks in order; each of the BLOCK lanes accumulates its own
partial result, and one ``tl.sum`` / ``tl.max`` over the lanes ends the reduction. BLOCK depends
only on the row length, so a row reduces the same way whatever the number of rows (stock
reductions may split a row across blocks when there are few rows). Compiled, a program takes one
row; interpreted, ROWS rows side by side (the same per-row arithmetic: a row never reduces with
another), because the interpreter spends milliseconds per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from timlab.kernels.runtime import INTERPRETED, check_launchable, jit_unspecialized, with_reference_backward

MAX_BLOCK = 1024
"""Lanes per row: the row length rounded up to a power of two, at most this."""
ROWS = 16 if INTERPRETED else 1
"""Rows per program."""


def _block(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 16)), MAX_BLOCK)


@jit_unspecialized("R", "N", "stride_x", "stride_y")
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, R, N, stride_x, stride_y, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # (ROWS, 1)
    sq = tl.zeros((ROWS, BLOCK), dtype=tl.float32)  # per-lane sums of squares
    for n0 in range(0, N, BLOCK):
        c = n0 + cols
        ok = (rows[:, None] < R) & (c[None, :] < N)
        h = tl.load(x_rows + c[None, :], mask=ok, other=0.0).to(tl.float32)
        sq += h * h
    inv = tl.math.rsqrt(tl.sum(sq, axis=1) / N + eps)[:, None]  # (ROWS, 1)
    for n0 in range(0, N, BLOCK):
        c = n0 + cols
        ok = (rows[:, None] < R) & (c[None, :] < N)
        h = tl.load(x_rows + c[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
        normed = (h * inv).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF rounds to the input dtype first
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_y + c[None, :]
        tl.store(y, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm with stock ops: normalize in fp32, scale in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()  # (R, N)
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        R = x2.shape[0]
        _rms_norm_kernel[(triton.cdiv(R, ROWS),)](x2, weight, y, R, N, x2.stride(0), y.stride(0), eps,
                                                  ROWS=ROWS, BLOCK=_block(N))
    return y.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm over the last dimension: x (..., N), weight (N,). Differentiable (the
    backward goes through ``rms_norm_reference``)."""
    check_launchable(x, weight)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}")
    return with_reference_backward(
        lambda x, w: _rms_norm(x, w, eps), lambda x, w: rms_norm_reference(x, w, eps), x, weight
    )


@jit_unspecialized("R", "N", "stride_x", "stride_y")
def _log_softmax_kernel(x_ptr, y_ptr, R, N, stride_x, stride_y, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # (ROWS, 1)
    m = tl.full((ROWS, BLOCK), float("-inf"), dtype=tl.float32)  # per-lane running max
    s = tl.zeros((ROWS, BLOCK), dtype=tl.float32)  # per-lane sum of exp(x - m)
    for n0 in range(0, N, BLOCK):
        c = n0 + cols
        ok = (rows[:, None] < R) & (c[None, :] < N)
        x = tl.load(x_rows + c[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with no finite value yet
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=1)[:, None]  # (ROWS, 1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # rows past R (and all -inf rows)
    total = tl.sum(s * tl.exp(m - row_max), axis=1)[:, None]  # (ROWS, 1)
    log_total = tl.log(tl.where(total == 0.0, 1.0, total))
    for n0 in range(0, N, BLOCK):
        c = n0 + cols
        ok = (rows[:, None] < R) & (c[None, :] < N)
        x = tl.load(x_rows + c[None, :], mask=ok, other=0.0).to(tl.float32)
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_y + c[None, :]
        tl.store(y, ((x - row_max) - log_total).to(y_ptr.dtype.element_ty), mask=ok)


def _log_softmax_last(x: torch.Tensor) -> torch.Tensor:
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()  # (R, N)
    y = torch.empty_like(x2)
    if x2.shape[0] and N:
        R = x2.shape[0]
        _log_softmax_kernel[(triton.cdiv(R, ROWS),)](x2, y, R, N, x2.stride(0), y.stride(0), ROWS=ROWS, BLOCK=_block(N))
    return y.reshape(x.shape)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.log_softmax(x, dim)`` in x's dtype (computed in fp32). Differentiable."""
    check_launchable(x)
    if dim % x.ndim != x.ndim - 1:
        return log_softmax(x.movedim(dim, -1), -1).movedim(-1, dim)
    return with_reference_backward(_log_softmax_last, lambda x: torch.log_softmax(x, dim=-1), x)
