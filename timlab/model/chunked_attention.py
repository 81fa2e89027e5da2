"""The exact CPU attention a few sequences at a time, with its probabilities recomputed in the backward.

Used by ``timlab.model.ops.fixed_length_attention`` for its CPU fp32 calls without a decode
workspace whose scores do not fit one chunk (``CHUNK_ELEMENTS``): the trainer's teacher-forced
forward (``timlab.model.forward.token_logprobs``) at long answers, with or without autograd.
(Smaller calls run op by op: they are in cache already, and recomputing would cost ~5-10% of a
T ~ 30 RL step.) Run op by op over the whole batch, that attention
materializes per key block the (B, H_kv, n, K) fp32 scores, -inf bias and probabilities, keeps
the probabilities for the backward, and the backward makes as many gradients of that size:
about a gigabyte each per block and layer at the RL batch of 1,000-token answers, streamed
through memory a dozen times per layer. Here the same operations run on a chunk of sequences at a
time, so those tensors stay in cache, and the backward recomputes each chunk's probabilities (as
FlashAttention does) instead of keeping them.

The bits are those of the op-by-op computation, by construction (tests/test_ops.py compares them):

- every batched GEMM is that computation's GEMM on a slice of its batch (sequence) dimension, with
  the same shapes and operand layouts: each batch item is a GEMM of its own, whose bits do not
  depend on the other items (the rule ``timlab.model.cpu_gemm`` splits the batch over threads by);
- the mask, the scaling, the softmax and its backward are elementwise or reduce along one row's
  keys, as before (the -inf bias is added to a KV group's query heads by broadcasting instead of
  being copied per head: the same values);
- the backward runs autograd's own formula for each op (``BmmBackward0`` with its transposed
  operands, ``SoftmaxBackward0``, ``AddBackward0``'s scaling, zero rows where padding was sliced
  off) and sums the key blocks' key and value gradients in the order autograd sums them: the last
  block first, each block's gradient zero past its keys, into a buffer of the layout autograd's
  sum has.

Departure from FlashAttention: nothing is fused and no reduction is reordered; the chunking only
decides which sequences are computed together, and the recomputation repeats the forward's GEMM,
mask and softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from timlab.model import cpu_gemm
from timlab.model.attention_mask import additive_mask

CHUNK_ELEMENTS = 1 << 20
"""A chunk holds as many sequences as keep its largest block's scores (all KV heads) under this
many elements (4 MiB in fp32), and at least one sequence."""

Block = tuple[int, int, int]
"""(a, b, K): the queries at columns a..b-1 of the call, run against the first K keys."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
              blocks: list[Block], min_rows: int) -> torch.Tensor:
    """``ops.fixed_length_attention``'s result (B, H, M, D), differentiable in q, k, v when autograd records.

    q: (B, H, M, D) fp32; k, v: (B, H_kv, S, D) contiguous; allowed: (B, 1, M, S) bool; each
    block's queries and probabilities zero-padded to ``min_rows`` rows for the GEMMs.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _RecomputedAttention.apply(q, k, v, allowed, scale, blocks, min_rows)
    return _forward(q, k, v, allowed, scale, blocks, min_rows)


def chunk_rows(q: torch.Tensor, k: torch.Tensor, blocks: list[Block]) -> int:
    """Sequences per chunk (see ``CHUNK_ELEMENTS``)."""
    rep = q.shape[1] // k.shape[1]
    per_seq = k.shape[1] * max(rep * (b - a) * K for a, b, K in blocks)  # largest block's scores
    return max(1, min(q.shape[0], CHUNK_ELEMENTS // max(1, per_seq)))


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (c, H_kv, n, X) with zero rows appended up to ``rows`` (x itself when n >= rows), as ``ops.pad_rows``."""
    n = x.shape[2]
    return x if n >= rows else F.pad(x, (0, 0, 0, rows - n))


def _query_rows(q: torch.Tensor, a: int, b: int, H_kv: int, min_rows: int) -> torch.Tensor:
    """(c, H, M, D) -> the block's queries (c, H_kv, max(n, min_rows), D), n = rep * (b - a)."""
    c, H, _, D = q.shape
    qb = q[:, :, a:b].reshape(c, H_kv, H // H_kv * (b - a), D).contiguous()  # head g*rep + r -> group g, row r*m + i
    return _pad_rows(qb, min_rows)


def _probs(qp: torch.Tensor, kb: torch.Tensor, allowed: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """softmax(bias + scale * (qp @ kb^T)) (c, H_kv, n, K) for the block's ``allowed`` (c, 1, m, K)."""
    c, H_kv, K, m = qp.shape[0], qp.shape[1], kb.shape[2], allowed.shape[2]
    scores = cpu_gemm.matmul(qp, kb.transpose(-1, -2))[:, :, :n]  # (c, H_kv, n, K): padding rows dropped
    bias = additive_mask(allowed, scores.dtype)  # (c, 1, m, K)
    scores = torch.add(bias.unsqueeze(2), scores.reshape(c, H_kv, n // m, m, K), alpha=scale)  # (c, H_kv, rep, m, K)
    return torch.softmax(scores.view(c, H_kv, n, K), dim=-1, dtype=torch.float32)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
             blocks: list[Block], min_rows: int) -> torch.Tensor:
    """The attention (B, H, M, D), chunk by chunk, without autograd."""
    B, H, M, D = q.shape
    H_kv = k.shape[1]
    chunk = chunk_rows(q, k, blocks)
    out = q.new_empty(B, H, M, D)  # the blocks' outputs side by side, as ops' cat
    for s in range(0, B, chunk):
        rows = slice(s, s + chunk)
        qc, kc, vc, ac = q[rows], k[rows], v[rows], allowed[rows]
        c = qc.shape[0]
        for a, b, K in blocks:
            n = H // H_kv * (b - a)
            qp = _query_rows(qc, a, b, H_kv, min_rows)  # (c, H_kv, n', D)
            probs = _probs(qp, kc[:, :, :K], ac[:, :, a:b, :K], n, scale)  # (c, H_kv, n, K)
            o = cpu_gemm.matmul(_pad_rows(probs, min_rows), vc[:, :, :K])  # (c, H_kv, n', D)
            out[rows, :, a:b] = o[:, :, :n].reshape(c, H, b - a, D)
    return out


class _RecomputedAttention(torch.autograd.Function):
    """``_forward`` keeping only its inputs; the backward recomputes each chunk's probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, scale, blocks, min_rows):
        ctx.save_for_backward(q, k, v, allowed)
        ctx.scale, ctx.blocks, ctx.min_rows = scale, blocks, min_rows
        return _forward(q, k, v, allowed, scale, blocks, min_rows)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, allowed = ctx.saved_tensors
        scale, blocks, min_rows = ctx.scale, ctx.blocks, ctx.min_rows
        B, H, M, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        rep = H // H_kv
        chunk = chunk_rows(q, k, blocks)
        grad_q = q.new_empty(B, H, M, D)  # contiguous, as the cat of the blocks' query gradients
        # Autograd starts the key gradient's sum with the last block's, which, when that block sees
        # all S keys, is the transposed view of its GEMM's (D, S) output: the sum keeps that layout.
        grad_k = (k.new_zeros(B, H_kv, D, S).transpose(-1, -2) if blocks[-1][2] == S
                  else k.new_zeros(B, H_kv, S, D))  # (B, H_kv, S, D)
        grad_v = v.new_zeros(B, H_kv, S, D)
        for s in range(0, B, chunk):
            rows = slice(s, s + chunk)
            qc, kc, vc, ac, gc = q[rows], k[rows], v[rows], allowed[rows], grad_out[rows]
            c = qc.shape[0]
            for i, (a, b, K) in enumerate(reversed(blocks)):  # autograd's order: the last block first
                m = b - a
                n = rep * m
                qp = _query_rows(qc, a, b, H_kv, min_rows)  # (c, H_kv, n', D)
                n_pad = qp.shape[2]
                kb, vb = kc[:, :, :K], vc[:, :, :K]  # (c, H_kv, K, D)
                probs = _probs(qp, kb, ac[:, :, a:b, :K], n, scale)  # (c, H_kv, n, K): the forward's bits
                # p @ v, through BmmBackward0 on matmul's (c*H_kv, ., .) views
                g3 = _pad_rows(gc[:, :, a:b].reshape(c, H_kv, n, D).contiguous(), min_rows).view(c * H_kv, n_pad, D)
                p3 = _pad_rows(probs, min_rows).reshape(c * H_kv, n_pad, K)
                v3 = vb.reshape(c * H_kv, K, D)
                grad_probs = cpu_gemm.matmul(g3, v3.transpose(1, 2)).view(c, H_kv, n_pad, K)[:, :, :n]
                grad_vb = cpu_gemm.matmul(p3.transpose(1, 2), g3).view(c, H_kv, K, D)
                # the softmax, then the scale (AddBackward0's alpha)
                grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, torch.float32).mul_(scale)
                gs3 = _pad_rows(grad_scores, min_rows).view(c * H_kv, n_pad, K)
                # q @ k^T
                kt3 = kb.transpose(-1, -2).reshape(c * H_kv, D, K)
                grad_qp = cpu_gemm.matmul(gs3, kt3.transpose(1, 2)).view(c, H_kv, n_pad, D)
                grad_kt = cpu_gemm.matmul(qp.view(c * H_kv, n_pad, D).transpose(1, 2), gs3).view(c, H_kv, D, K)
                grad_q[rows, :, a:b] = grad_qp[:, :, :n].reshape(c, H, m, D)
                for total, grad in ((grad_k[rows], grad_kt.transpose(-1, -2)), (grad_v[rows], grad_vb)):
                    if i == 0:
                        total[:, :, :K] = grad
                    else:  # + this block's gradient, zero past its K keys (x + 0 turns -0 into +0 there too)
                        total[:, :, :K] += grad
                        total[:, :, K:] += 0.0
        return grad_q, grad_k, grad_v, None, None, None, None
