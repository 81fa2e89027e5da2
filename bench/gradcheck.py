"""Benchmark: wall time of ``timlab gradcheck`` (``run_gradcheck``) on the default warm start.

    OMP_NUM_THREADS=1 python bench/gradcheck.py [--json OUT] [--repeats 3] [--samples 256]
                                                [--preset default] [--injector head_perturb]
                                                [--magnitude 1] [--buckets 1] [--set KEY=VALUE ...]

Resolves the preset (default: ``default``, the 0.8M-parameter reverse-string model; its SFT
warm start is trained and cached on first use, which is NOT timed: one untimed call to
``ensure_warm_start`` comes first), then times ``run_gradcheck`` end to end with one torch
thread: loading the model, building the injector, the paired rollouts of pi and mu, the 2 x K
micro-batch gradients, the per-token score norms for B, and the Gram-matrix bootstrap. Every
call uses the same seed, so all repeats do identical work; the median wall and CPU time are
reported, with the breakdown (``result.cost``) of the median call.

Target: "well under a minute on 2 cores" for the default settings (256 samples, micro-batch 8,
1000 bootstrap replicates, 8 score-norm sequences); ``ratio_to_60s`` = median wall / 60 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import torch

from timlab.files import write_json  # noqa: E402
from timlab.config import resolve
from timlab.gradcheck.command import run_gradcheck
from timlab.trainer.pretrain import ensure_warm_start

TARGET_S = 60.0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--injector", default="head_perturb")
    ap.add_argument("--magnitude", type=float, default=1.0)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--buckets", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="extra config override (repeatable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    cfg = resolve(preset=args.preset, overrides=[f"mismatch.injector={args.injector}",
                                                 f"mismatch.magnitude={args.magnitude}", *args.set])
    model_dir = ensure_warm_start(cfg).path  # cached after the first call; not timed

    wall: list[float] = []
    cpu: list[float] = []
    results = []
    for _ in range(args.repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        res = run_gradcheck(cfg, samples=args.samples, buckets=args.buckets)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
        results.append(res)
    med = sorted(range(args.repeats), key=lambda i: wall[i])[(args.repeats - 1) // 2]
    res = results[med]
    p = res.pooled
    out = {
        "preset": args.preset,
        "model": str(model_dir),
        "num_parameters": res.settings["params"],
        "injector": args.injector,
        "magnitude": args.magnitude,
        "samples": args.samples,
        "micro_batch": res.settings["micro_batch"],
        "buckets": args.buckets,
        "n_boot": res.settings["n_boot"],
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average": os.getloadavg()[0],
        "wall_s": wall,  # in call order: the first call is the cold one
        "cpu_s": cpu,
        "wall_s_median": statistics.median(wall),
        "cpu_s_median": statistics.median(cpu),
        "cost": res.cost,
        "outside_estimator_s": wall[med] - res.cost["total_s"],
        "ratio_to_60s": statistics.median(wall) / TARGET_S,
        "tokens_per_side": int(sum(r["T_mean"] for r in res.buckets) / len(res.buckets) * args.samples),
        "notes": res.notes,
        "result": {"k3": res.mismatch.get("rollout_corr/k3_kl"), "cosine": p["cosine"], "rel_bias": p["rel_bias"],
                   "rel_bias_lo": p["rel_bias_lo"], "rel_bias_hi": p["rel_bias_hi"], "noise_floor_rel": p["noise_floor_rel"]},
    }
    c = res.cost
    print(f"gradcheck on {args.preset} ({out['num_parameters']:,} params), {args.injector} magnitude {args.magnitude:g}, "
          f"{args.samples} samples, {args.buckets} bucket(s), 1 thread, median of {args.repeats}")
    print(f"wall {out['wall_s_median']:.2f} s (calls in order: {', '.join(f'{w:.2f}' for w in wall)}), "
          f"CPU {out['cpu_s_median']:.2f} s, load average {out['load_average']:.2f}")
    print(f"breakdown (median call): estimator {c['total_s']:.2f} s = rollouts {c['rollout_s']:.2f} + gradients "
          f"{c['gradient_s']:.2f} + score norms {c['score_norm_s']:.2f} + stats {c['stats_s']:.2f} "
          f"(+ {c['total_s'] - c['rollout_s'] - c['gradient_s'] - c['score_norm_s'] - c['stats_s']:.2f} other); "
          f"setup (config, load, injector) {out['outside_estimator_s']:.2f} s; "
          f"{c['vector_bytes'] / 2**20:.0f} MiB of gradient vectors")
    print(f"ratio to 60 s: {out['ratio_to_60s']:.3f} (target: well under 1)")
    print(f"result: k3 {out['result']['k3']:.3g}, cosine {p['cosine']:.4f}, relative bias {p['rel_bias']:.3g} "
          f"[{p['rel_bias_lo']:.3g}, {p['rel_bias_hi']:.3g}], noise floor {p['noise_floor_rel']:.3g}")
    for n in res.notes:
        print(f"note: {n}")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
