"""Benchmark: the batch-invariant Triton kernels (``timlab.kernels``) against torch's.

    OMP_NUM_THREADS=1 python bench/kernels.py [--device cpu|cuda] [--json OUT]

For each kernel and dtype (fp32, bf16): the largest absolute error against a float64 reference,
next to the stock torch kernel's; whether every row keeps its bits for M = 1..70 rows (linear and
RMSNorm at shifting positions in the tiles) and one decode query equals its row of the full
attention at four positions; and
on CUDA the time per call against torch's. On ``cpu`` the kernels run in Triton's interpreter
(set here), so times are not reported and the shapes are small; on ``cuda`` the shapes are a
Qwen3-0.6B layer's. Without CUDA or Triton, ``--device cuda`` is a one-line error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from timlab.files import write_json  # noqa: E402
from timlab.errors import UsageError  # noqa: E402
from timlab.kernels import check_device  # noqa: E402

SHAPES = {  # rows M, hidden K, output N, heads H / H_kv, head dim D, buffer S, vocab V
    "cpu": dict(M=64, K=256, N=192, H=4, H_kv=2, D=32, S=96, V=3000),
    "cuda": dict(M=4096, K=1024, N=3072, H=16, H_kv=8, D=128, S=1024, V=151936),
}


def max_err(out, exact) -> float:
    return float((out.double() - exact.double()).abs().max())


def timed(fn, device: str, repeats: int = 20) -> float | None:
    """Median seconds per call on CUDA; None on CPU (the interpreter's times mean nothing)."""
    if device != "cuda":
        return None
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_dtype(dtype, device: str, s: dict) -> dict:
    from timlab import kernels
    from timlab.kernels.attention import attention_reference
    from timlab.kernels.rowwise import rms_norm_reference

    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x, w, b = randn(s["M"], s["K"]), randn(s["N"], s["K"]) / s["K"] ** 0.5, randn(s["N"])
    nw = 1 + 0.1 * randn(s["K"])
    x_inv = randn(140, s["K"])  # rows for the invariance checks
    logits = 4 * randn(70, s["V"]).float()
    B, M_att = 2, s["S"]
    q, k, v = randn(B, s["H"], M_att, s["D"]), randn(B, s["H_kv"], s["S"], s["D"]), randn(B, s["H_kv"], s["S"], s["D"])
    allowed = torch.ones(s["S"], s["S"], dtype=torch.bool, device=device).tril().expand(B, 1, s["S"], s["S"]).contiguous()
    scale = s["D"] ** -0.5
    out = {}

    y = kernels.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double())
    full = kernels.linear(x_inv, w, b)
    m_ok = all(torch.equal(kernels.linear(x_inv[(7 * m) % 70 : (7 * m) % 70 + m], w, b), full[(7 * m) % 70 : (7 * m) % 70 + m])
               for m in range(1, 71))
    out["linear"] = {"err": max_err(y, exact), "torch_err": max_err(F.linear(x, w, b), exact), "rows_invariant": m_ok,
                     "s": timed(lambda: kernels.linear(x, w, b), device), "torch_s": timed(lambda: F.linear(x, w, b), device)}

    y = kernels.rms_norm(x, nw, 1e-6)
    exact = rms_norm_reference(x.double(), nw.double(), 1e-6)
    full = kernels.rms_norm(x_inv, nw, 1e-6)
    m_ok = all(torch.equal(kernels.rms_norm(x_inv[(5 * m) % 70 : (5 * m) % 70 + m], nw, 1e-6),
                           full[(5 * m) % 70 : (5 * m) % 70 + m]) for m in range(1, 71))
    out["rms_norm"] = {"err": max_err(y, exact), "torch_err": max_err(rms_norm_reference(x, nw, 1e-6), exact),
                       "rows_invariant": m_ok, "s": timed(lambda: kernels.rms_norm(x, nw, 1e-6), device),
                       "torch_s": timed(lambda: rms_norm_reference(x, nw, 1e-6), device)}

    y = kernels.log_softmax(logits)
    exact = torch.log_softmax(logits.double(), -1)
    m_ok = all(torch.equal(kernels.log_softmax(logits[:m]), y[:m]) for m in range(1, 71))
    out["log_softmax"] = {"err": max_err(y, exact), "torch_err": max_err(torch.log_softmax(logits, -1), exact),
                          "rows_invariant": m_ok, "s": timed(lambda: kernels.log_softmax(logits), device),
                          "torch_s": timed(lambda: torch.log_softmax(logits, -1), device)}

    y = kernels.fixed_length_attention(q, k, v, allowed, scale)
    exact = attention_reference(q.double(), k.double(), v.double(), allowed, scale)
    one_ok = all(torch.equal(kernels.fixed_length_attention(q[:, :, t : t + 1], k, v, allowed[:, :, t : t + 1], scale),
                             y[:, :, t : t + 1]) for t in (0, 1, s["S"] // 3, s["S"] - 1))
    rep = s["H"] // s["H_kv"]
    out["attention"] = {"err": max_err(y, exact), "torch_err": max_err(attention_reference(q, k, v, allowed, scale), exact),
                        "rows_invariant": one_ok,
                        "s": timed(lambda: kernels.fixed_length_attention(q, k, v, allowed, scale), device),
                        "torch_s": timed(lambda: F.scaled_dot_product_attention(
                            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=allowed, scale=scale), device)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    try:
        check_device(args.device)
    except UsageError as e:
        ap.exit(2, f"kernels.py: error: {e}\n")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before timlab.kernels imports Triton
    torch.set_num_threads(1)
    s = SHAPES[args.device]
    out = {"device": args.device, "shapes": s, "torch": torch.__version__,
           "results": {str(d).removeprefix("torch."): bench_dtype(d, args.device, s) for d in (torch.float32, torch.bfloat16)}}
    for dtype, res in out["results"].items():
        for name, r in res.items():
            t = "" if r["s"] is None else f"  {r['s'] * 1e6:9.1f} us vs torch {r['torch_s'] * 1e6:9.1f} us"
            print(f"{dtype:<9} {name:<12} max|err| {r['err']:.3g} (torch {r['torch_err']:.3g})  "
                  f"rows invariant: {r['rows_invariant']}{t}")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
