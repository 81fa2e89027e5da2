"""Benchmark: how Triton's argument specialization affects the attention kernel's row invariance.

    python bench/kernel_specialization.py [--variants default,no_alignment,none]   # needs CUDA

For each variant the attention kernel is recompiled with Triton's specialization of its integer
arguments (sizes, strides) left on (``default``), with the alignment hint off
(``no_alignment``: what ``timlab.kernels`` ships) or with value and alignment specialization off
(``none``). Each single query (a decode step), and each chunk of 8, is compared bitwise with its
row of the all-queries call (the trainer's forward), in fp32 and bf16, for head_dim 16 and 128
and 4 and 16 heads. Then ``bench/kernels.py --device cuda`` times the kernels under that variant.
"""

from __future__ import annotations

import argparse
import itertools
import runpy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.errors import UsageError  # noqa: E402
from timlab.kernels import check_device  # noqa: E402

VARIANTS = {
    "default": {},
    "no_alignment": {"do_not_specialize_on_alignment": True},
    "none": {"do_not_specialize": True, "do_not_specialize_on_alignment": True},
}
def _attention_ints(kernel) -> list[str]:
    """The attention kernel's size and stride arguments."""
    return [a for a in kernel.arg_names if a in ("H_KV", "REP", "M", "S", "D") or (a.startswith("s") and a != "scale")]


def _linear_ints(kernel) -> tuple[str, ...]:
    """The linear kernel's ``ROW_ARGS``: the only integer arguments it leaves unspecialized."""
    from timlab.kernels import matmul

    return matmul.ROW_ARGS


INT_ARGS = {"attention": ("_attention_kernel", _attention_ints), "matmul": ("_linear_kernel", _linear_ints)}
"""Per module: its kernel's name and the integer arguments a variant's specialization switches."""


def recompile(variant: str) -> None:
    """Swap the module-level kernels for ones compiled under ``variant``."""
    import triton

    from timlab.kernels import attention, matmul

    for module, (name, int_args) in zip((attention, matmul), INT_ARGS.values()):
        kernel = getattr(module, name)
        kwargs = {k: list(int_args(kernel)) for k in VARIANTS[variant]}
        setattr(module, name, triton.jit(kernel.fn, **kwargs))


def attention_inputs(dtype, *, H: int, D: int, S: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, H_kv = 2, H // 2

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device="cuda")

    q, k, v = randn(B, H, S, D), randn(B, H_kv, S, D), randn(B, H_kv, S, D)
    allowed = torch.ones(S, S, dtype=torch.bool, device="cuda").tril().expand(B, 1, S, S).clone()
    allowed[0, :, :, :5] = False  # left padding of sequence 0; each query still sees itself
    allowed[0, :, torch.arange(S), torch.arange(S)] = True
    return q, k, v, allowed, D**-0.5


def row_invariance(S: int = 200) -> list[dict]:
    from timlab.kernels import fixed_length_attention as attend

    rows = []
    for dtype, D, H in itertools.product((torch.float32, torch.bfloat16), (16, 128), (4, 16)):
        q, k, v, a, scale = attention_inputs(dtype, H=H, D=D, S=S)
        full = attend(q, k, v, a, scale)
        diffs = [float((attend(q[:, :, t : t + 1], k, v, a[:, :, t : t + 1], scale) - full[:, :, t : t + 1]).abs().max())
                 for t in range(S)]
        chunks = sum(not torch.equal(attend(q[:, :, t : t + 8], k, v, a[:, :, t : t + 8], scale), full[:, :, t : t + 8])
                     for t in range(S - 8))
        rows.append({"dtype": str(dtype)[6:], "head_dim": D, "heads": H, "single_differing": sum(d > 0 for d in diffs),
                     "max_diff": max(diffs), "chunks_differing": chunks, "queries": S})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-timing", action="store_true", help="skip bench/kernels.py")
    args = ap.parse_args(argv)
    try:
        check_device("cuda")
    except UsageError as e:
        ap.exit(2, f"kernel_specialization.py: error: {e}\n")
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            ap.exit(2, f"kernel_specialization.py: error: --variants: unknown {variant!r} (choose from {', '.join(VARIANTS)})\n")
        recompile(variant)
        print(f"=== {variant}", flush=True)
        for r in row_invariance():
            print(f"{r['dtype']:<9} head_dim {r['head_dim']:<4} heads {r['heads']:<3} single queries differing "
                  f"{r['single_differing']}/{r['queries']} (max {r['max_diff']:.2g}), 8-query chunks differing "
                  f"{r['chunks_differing']}", flush=True)
        if not args.no_timing:
            sys.argv = ["kernels.py", "--device", "cuda"]
            runpy.run_path(str(Path(__file__).with_name("kernels.py")), run_name="__main__")


if __name__ == "__main__":
    main()
