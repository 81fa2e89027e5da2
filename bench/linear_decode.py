"""Benchmark: the batch-invariant Triton linear at decode shapes, under other compile settings.

    python bench/linear_decode.py [--json OUT]          # needs CUDA and Triton

The exact engine's decode step on a GPU spends most of its time in ``timlab.kernels.matmul``'s
linear. Every setting tried here keeps the kernel batch-invariant by construction: the tile sizes
and launch settings are fixed for a (N, K), never chosen from M, and the arguments that change
between the trainer's call and a decode step's (M, the input's and output's strides) are never
specialized on, so both calls always run one compiled kernel. What varies:

- ``align``: ``rows`` leaves every size and stride unspecialized (timlab before session 19);
  ``layer`` lets Triton specialize on the alignment of N, K and the weight's strides, which are
  the layer's own and the same in every call on that weight (aligned, vectorized weight loads);
- the tile's output columns ``BLOCK_N``, its reduction chunk ``BLOCK_K`` (another chunk sums K in
  another order, so other bits, but the same for every call on a weight), ``num_warps`` and
  ``num_stages``.

For each setting and Qwen3-0.6B layer shape (the MLP's two linears, the query projection and the
tied LM head): whether the rows of 1..70-row calls, at two offsets, equal their rows of a
4,096-row call bit for bit (the trainer's forward), and the time per call at M = 128, 256 and
4,096 rows (``triton.testing.do_bench``, median) next to ``torch.nn.functional.linear`` (cuBLAS).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from timlab.errors import UsageError  # noqa: E402
from timlab.files import write_json  # noqa: E402
from timlab.kernels import check_device  # noqa: E402

SHAPES = {"mlp_up (1024 -> 3072)": (1024, 3072), "mlp_down (3072 -> 1024)": (3072, 1024),
          "q_proj (1024 -> 2048)": (1024, 2048), "lm_head (1024 -> 151936)": (1024, 151_936)}
"""name: (K, N), Qwen3-0.6B's."""
ROWS = (128, 256, 4096)
SETTINGS = [  # (align, BLOCK_N, BLOCK_K, num_warps, num_stages); the first is timlab before session 19,
    # the second what it ships since; the wider K chunks were not measured in session 19
    ("rows", 64, 32, 4, 3), ("layer", 64, 32, 4, 3), ("layer", 64, 32, 4, 4), ("layer", 128, 32, 4, 3),
    ("layer", 128, 32, 8, 3), ("layer", 32, 32, 4, 4), ("layer", 64, 64, 4, 3), ("layer", 64, 128, 4, 3),
    ("layer", 32, 128, 4, 3),
]
UNSPECIALIZED = {"rows": ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_ym", "stride_yn"),
                 "layer": ("M", "stride_xm", "stride_xk", "stride_ym", "stride_yn")}


def configure(align: str, block_n: int, block_k: int, warps: int, stages: int) -> None:
    """Recompile the linear kernel under ``align`` and set its tile and launch constants."""
    import triton

    from timlab.kernels import matmul

    fn = getattr(matmul._linear_kernel, "fn", matmul._linear_kernel)
    matmul._linear_kernel = triton.jit(fn, do_not_specialize_on_alignment=list(UNSPECIALIZED[align]))
    matmul.BLOCK_N, matmul.BLOCK_K, matmul.NUM_WARPS, matmul.NUM_STAGES = block_n, block_k, warps, stages


def invariant(K: int, N: int, dtype=torch.bfloat16) -> bool:
    """Rows of 1..70-row calls at offsets 0 and 5 equal their rows of the 4,096-row call."""
    from timlab.kernels import linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, K, generator=g, device="cuda").to(dtype)
    w = (torch.randn(N, K, generator=g, device="cuda") * K**-0.5).to(dtype)
    full = linear(x, w)
    return all(torch.equal(linear(x[o : o + m], w), full[o : o + m]) for m in range(1, 71) for o in (0, 5))


def timing(K: int, N: int, M: int, dtype=torch.bfloat16) -> tuple[float, float]:
    """(kernel, cuBLAS) microseconds per call."""
    import triton.testing

    from timlab.kernels import linear

    x = torch.randn(M, K, device="cuda").to(dtype)
    w = (torch.randn(N, K, device="cuda") * K**-0.5).to(dtype)
    ours = triton.testing.do_bench(lambda: linear(x, w), return_mode="median")
    ref = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, w), return_mode="median")
    return ours * 1e3, ref * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        check_device("cuda")
    except UsageError as e:
        ap.exit(2, f"linear_decode.py: error: {e}\n")
    rows = []
    for (align, bn, bk, warps, stages), (name, (K, N)) in itertools.product(SETTINGS, SHAPES.items()):
        configure(align, bn, bk, warps, stages)
        row = {"align": align, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages, "shape": name,
               "invariant": invariant(K, N)}
        for M in ROWS:
            row[f"us_{M}"], row[f"cublas_us_{M}"] = timing(K, N, M)
        rows.append(row)
        print(f"{align:<5} BN {bn:<3} BK {bk:<3} warps {warps} stages {stages}  {name:<26} invariant {row['invariant']!s:<5} "
              + "  ".join(f"M {M}: {row[f'us_{M}']:8.1f} us (cuBLAS {row[f'cublas_us_{M}']:7.1f})" for M in ROWS),
              flush=True)
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
