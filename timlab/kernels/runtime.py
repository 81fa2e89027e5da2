"""How ``timlab.kernels`` runs its Triton kernels.

Compiled on CUDA tensors; on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set
before ``timlab.kernels`` is first used), which is how CI tests them without a GPU. The forward
values come from the kernels; the backward goes through a torch reference (stock kernels): only
the forward has to be batch-invariant for the rollout and the trainer to agree.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRETED = _interpreting()
"""Whether the kernels run in Triton's interpreter (decided once, when they are defined)."""


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the kernels compute in (tl.dot has no float64)."""


def check_launchable(*tensors: torch.Tensor | None) -> None:
    """Refuse, in one line, tensors the kernels cannot run on (None entries are skipped)."""
    for t in tensors:
        if t is not None and t.is_floating_point() and t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"timlab.kernels computes in float32, bfloat16 or float16; got {t.dtype}")
        if t is None or t.is_cuda or (INTERPRETED and t.device.type == "cpu"):
            continue
        raise ValueError(
            f"timlab.kernels runs on CUDA tensors, or on CPU tensors under Triton's interpreter "
            f"(TRITON_INTERPRET=1 set before timlab.kernels is imported); got a tensor on {t.device}"
        )


def jit_unspecialized(*int_args: str):
    """``triton.jit`` that compiles one kernel whatever the alignment of these integer arguments.

    By default Triton compiles another kernel when an integer argument (a size or a stride) is a
    multiple of 16, and that kernel may order its arithmetic differently. Measured on an H100
    (Triton 3.6): the attention kernel called with one query (a decode step) gave 93-99 of 200
    rows other fp32 bits, and one bf16 row in 200, than the trainer's call with all the queries.
    With the alignment hint off for the size and stride arguments, no row differed (fp32 and
    bf16, head_dim 16 and 128, 4 and 16 heads). Turning value specialization off as well (what
    ``do_not_specialize`` does) was just as exact and up to 4x slower. Triton < 3.2 has no
    alignment switch: there ``do_not_specialize`` turns both off.
    """
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:  # triton >= 3.2
        return triton.jit(do_not_specialize_on_alignment=int_args)
    return triton.jit(do_not_specialize=int_args)


@triton.jit
def dot_acc(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b, accumulated in fp32; a: (BM, BK), b: (BK, BN), acc: (BM, BN) fp32.

    Compiled, this is ``tl.dot`` (tensor cores for bf16/fp16, IEEE fp32 otherwise: torch's
    default, no TF32). The interpreter's ``tl.dot`` calls numpy's matmul, whose BLAS gives a row
    other bits at another position in the tile and which reads bf16 as integers, so interpreted
    kernels multiply in fp32 and sum over k instead: the same fixed order for every element.
    """
    if INTERPRETED:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


class _ReferenceBackward(torch.autograd.Function):
    """Forward by a kernel; backward by recomputing a torch reference and differentiating it."""

    @staticmethod
    def forward(ctx, kernel, reference, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(n) if t is not None else None for t, n in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        grads = iter(torch.autograd.grad(out, [t for t, n in zip(inputs, needs) if n], grad))
        return (None, None, *(next(grads) if n else None for n in needs))


def with_reference_backward(kernel: Callable, reference: Callable, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``kernel(*inputs)``; where autograd needs it, differentiable through ``reference`` (which
    must compute the same function with torch ops)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _ReferenceBackward.apply(kernel, reference, *inputs)
    return kernel(*inputs)
