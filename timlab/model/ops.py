"""Batch-invariant building blocks for the exact path.

The zero-mismatch setting needs a KV-cached decode step and the trainer's teacher-forced forward
to produce the same bits for the same token. On CPU, stock kernels get there when two shape
rules hold (measured in tests/test_ops.py; REFERENCE.md section 1):

1. Every matmul runs on a 2-D input with at least ``MIN_ROWS`` rows. The fp32 GEMM gives each
   output row the same bits whatever the row count once that count is past the small-M kernels
   (M = 1-3 take a different path). Decode steps have few rows, so they are padded.
2. Attention is ``softmax(mask(q @ k^T)) @ v`` over a KV buffer of one fixed length ``S`` in both
   the decode step and the trainer's forward, so every reduction over keys has the same length
   and the same order. Future and padded keys are masked with -inf and contribute exact zeros.

Everything else (RMSNorm, RoPE, SwiGLU, log-softmax) reduces along the last dimension only,
row by row, and is invariant as it stands. This differs from VeXact's GPU engine, which
replaces the kernels themselves; on GPUs these shape rules are not enough (see docs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 16
"""Matmuls in the exact path never run on fewer rows than this (decode rows are zero-padded)."""


def pad_rows(x: torch.Tensor, min_rows: int = MIN_ROWS, dim: int = 0) -> torch.Tensor:
    """Zero-pad ``x`` along ``dim`` up to ``min_rows`` rows (no copy when already long enough)."""
    n = x.shape[dim]
    if n >= min_rows:
        return x
    shape = list(x.shape)
    shape[dim] = min_rows - n
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` whose per-row result does not depend on how many rows are computed together.

    ``x`` is (..., K); it is flattened to (M, K) and padded to at least MIN_ROWS rows.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    m = x2.shape[0]
    y = F.linear(pad_rows(x2), weight, bias)  # (max(M, MIN_ROWS), N)
    return y[:m].reshape(*lead, weight.shape[0])


def fixed_length_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked softmax attention over a fixed-length key buffer.

    q: (B, H, M, D) queries; k, v: (B, H, S, D) the whole buffer (unwritten slots may hold
    anything finite); allowed: (B, 1, M, S) bool, True where query m may attend to key s.
    Returns (B, H, M, D). The query rows are padded to MIN_ROWS so a single decode query takes
    the same GEMM path as the trainer's many rows. Softmax runs in fp32 like HF's eager kernel.
    """
    m = q.shape[2]
    q = pad_rows(q, dim=2)  # (B, H, M', D)
    allowed = pad_rows(allowed, dim=2)  # padded query rows see nothing ...
    allowed[..., m:, 0] = True  # ... but one key, so their softmax stays finite
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, M', S)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)  # (B, H, M', S)
    out = torch.matmul(probs, v)  # (B, H, M', D)
    return out[:, :, :m]
