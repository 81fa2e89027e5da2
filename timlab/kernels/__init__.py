"""Batch-invariant Triton kernels: the exact path's forward on a GPU.

On CUDA, stock kernels do not keep the CPU shape rules of ``timlab.model.ops``: cuBLAS picks
another kernel (tile shape, split-K) for the trainer's thousands of rows than for a decode step's
few, and reductions split rows differently by batch size. These kernels fix one configuration
and one reduction order per output element, so a row gets the same bits whatever rows it is
computed with (the approach of VeXact and thinking-machines-lab/batch_invariant_ops):

- ``linear(x, weight, bias=None)``: ``F.linear``, one tile configuration, no split-K;
- ``rms_norm(x, weight, eps)``: HF's RMSNorm, one reduction per row;
- ``log_softmax(x, dim=-1)``: one reduction per row;
- ``fixed_length_attention(q, k, v, allowed, scale)``: as ``timlab.model.ops``', one key-block order.

They need Triton (``pip install 'timlab[gpu]'``), imported on first use, so ``import timlab``
does not. They run compiled on CUDA tensors and, with ``TRITON_INTERPRET=1`` set before first
use, in Triton's interpreter on CPU tensors (how the tests check them without a GPU). The
backward passes go through stock torch ops: only forward values need to match.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from timlab.errors import UsageError

_KERNELS = {
    "linear": "timlab.kernels.matmul",
    "rms_norm": "timlab.kernels.rowwise",
    "log_softmax": "timlab.kernels.rowwise",
    "fixed_length_attention": "timlab.kernels.attention",
}

__all__ = [*_KERNELS, "available", "check_device"]


def available() -> bool:
    """Whether Triton is installed."""
    return importlib.util.find_spec("triton") is not None


def check_device(device: str | torch.device, what: str = "device") -> None:
    """One-line ``UsageError`` unless ``device`` (named ``what`` in the message, e.g.
    ``run.device``) is one timlab runs on and this machine has: cpu, mps, or cuda[:N], which needs
    a CUDA build of torch with that GPU visible and Triton for the exact path's batch-invariant
    kernels."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"{what} {str(device)!r} is not a torch device; e.g. cpu, cuda, cuda:1, mps") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"{what}={device}: not a device timlab runs on; valid choices: cpu, cuda, cuda:N, mps")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"{what}={device}: MPS is not available on this machine; use {what}=cpu")
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise UsageError(f"{what}={device}: CUDA is not available on this machine: torch {torch.__version__} (CUDA "
                         f"build {torch.version.cuda or 'none'}) sees no CUDA GPU; use {what}=cpu")
    if not available():
        raise UsageError(f"{what}={device}: the exact path on CUDA needs Triton for its batch-invariant kernels; "
                         f"install it with pip install 'timlab[gpu]'")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"{what}={device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def __getattr__(name: str):  # the kernels import Triton, so only when first asked for
    if name not in _KERNELS:
        raise AttributeError(f"module 'timlab.kernels' has no attribute {name!r}")
    if not available():
        raise ImportError(f"timlab.kernels.{name} needs Triton: pip install 'timlab[gpu]'")
    return getattr(importlib.import_module(_KERNELS[name]), name)
