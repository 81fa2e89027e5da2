"""Attention over the fixed-length KV buffer as a Triton kernel: one fixed key-block order.

Same contract as ``timlab.model.ops.fixed_length_attention``. The rep = H / H_kv query heads
that share a KV head are stacked as rows (row r = head offset r // M, query r % M), as on CPU,
so a decode step reads each KV head once. One program per (sequence, KV head, block of BLOCK_M
rows); it walks the S keys in blocks of BLOCK_N, always from 0 to S, with an online softmax in
fp32 (FlashAttention's rescaling). A query's result depends only on its own row, the buffer and
the mask, so the decode step's single query and the trainer's many queries get the same bits.
Masked keys add exact zeros, and a block that is fully masked for a query leaves its state
unchanged. Departures from the torch reference (values within rounding): the scores stay in
fp32 (the reference rounds q @ k^T to the input dtype), and the probabilities are rounded to
v's dtype before they are normalized, as FlashAttention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from timlab.kernels.runtime import INTERPRETED, check_launchable, dot_acc, jit_unspecialized, with_reference_backward

BLOCK_M, BLOCK_N = 32, 64
"""Stacked query rows per program and keys per step of the walk over the buffer."""
NUM_WARPS, NUM_STAGES = 4, 2


@jit_unspecialized("H_KV", "REP", "M", "S", "D", "sq_b", "sq_h", "sq_m", "sq_d", "sk_b", "sk_h", "sk_s", "sk_d",
                   "sv_b", "sv_h", "sv_s", "sv_d", "sa_b", "sa_m", "sa_s", "so_b", "so_h", "so_m", "so_d")
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, o_ptr, scale, H_KV, REP, M, S, D,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
    sa_b, sa_m, sa_s, so_b, so_h, so_m, so_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr,
):
    bg = tl.program_id(0)
    b, g = (bg // H_KV).to(tl.int64), bg % H_KV  # sequence, KV head
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) stacked rows
    h = (g * REP + r // M)[:, None]  # (BM, 1) query head of each row
    m = (r % M)[:, None]  # (BM, 1) query of each row
    row_ok = (r < REP * M)[:, None]
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + m * sq_m + rd[None, :] * sq_d,
                mask=row_ok & (rd[None, :] < D), other=0.0)  # (BM, BD)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)  # running sum of exp(score - m_i) v
    for s0 in range(0, S, BLOCK_N):  # the one key order: 0 .. S, block by block
        cols = s0 + rn
        col_ok = cols < S
        kt = tl.load(k_ptr + b * sk_b + g * sk_h + cols[None, :] * sk_s + rd[:, None] * sk_d,
                     mask=col_ok[None, :] & (rd[:, None] < D), other=0.0)  # (BD, BN)
        scores = dot_acc(q, kt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), INTERPRETED) * scale
        allowed = tl.load(a_ptr + b * sa_b + m * sa_m + cols[None, :] * sa_s,
                          mask=row_ok & col_ok[None, :], other=0)  # (BM, BN)
        scores = tl.where(allowed != 0, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no allowed key yet: keep zeros
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])  # (BM, BN); masked keys give exact zeros
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + b * sv_b + g * sv_h + cols[:, None] * sv_s + rd[None, :] * sv_d,
                    mask=col_ok[:, None] & (rd[None, :] < D), other=0.0)  # (BN, BD)
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], INTERPRETED)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0 only on rows past M
    tl.store(o_ptr + b * so_b + h * so_h + m * so_m + rd[None, :] * so_d,
             out.to(o_ptr.dtype.element_ty), mask=row_ok & (rd[None, :] < D))


def attention_reference(q, k, v, allowed, scale: float) -> torch.Tensor:
    """The same attention with stock ops (the backward, and the tests' reference)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, S, D)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, M, S)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype) @ v  # (B, H, M, D)


def _attention(q, k, v, allowed, scale: float) -> torch.Tensor:
    B, H, M, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    out = torch.empty(B, H, M, D, dtype=q.dtype, device=q.device)
    if B * H * M == 0:
        return out
    a = allowed.expand(B, 1, M, S).view(torch.uint8)  # (B, 1, M, S), a bool's byte
    rep = H // H_kv
    grid = (B * H_kv, triton.cdiv(rep * M, BLOCK_M))
    _attention_kernel[grid](
        q, k, v, a, out, scale, H_kv, rep, M, S, D,
        *q.stride(), *k.stride(), *v.stride(), a.stride(0), a.stride(2), a.stride(3), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)),
        INTERPRETED=INTERPRETED, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def fixed_length_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked softmax attention over a fixed-length key buffer.

    q: (B, H, M, D); k, v: (B, H_kv, S, D), H a multiple of H_kv; allowed: (B, 1, M, S) bool,
    True where query m may attend to key s (every query needs at least one). Returns
    (B, H, M, D) in q's dtype. Differentiable (the backward goes through ``attention_reference``).
    """
    check_launchable(q, k, v, allowed)
    if q.shape[1] % k.shape[1] or allowed.dtype != torch.bool:
        raise ValueError(f"fixed_length_attention: {q.shape[1]} query heads for {k.shape[1]} KV heads, "
                         f"mask of dtype {allowed.dtype} (needs a multiple, and bool)")
    return with_reference_backward(
        lambda q, k, v, a: _attention(q, k, v, a, scale),
        lambda q, k, v, a: attention_reference(q, k, v, a, scale),
        q, k, v, allowed,
    )
