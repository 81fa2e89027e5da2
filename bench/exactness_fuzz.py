"""Randomized exactness harness: does every exact rollout log-prob equal the trainer's, bit for bit?

Draws ``--cases`` cases from the seeded space of ``timlab.experiments.diagnostics.exactness`` (architectures,
widths, dtypes, threads, ragged batches, compaction, sampling settings), rolls each out with the
exact engine and compares every response token's log-prob with the trainer's forward (three ways:
whole grid, RL step, mini-batch). Prints the number of cases, the number that failed, a one-line
command per failure, and how the cases covered each axis.

    python bench/exactness_fuzz.py --cases 1000 --seed 0 --isa both --json bench/exactness_fuzz.json
    python bench/exactness_fuzz.py --seed 0 --case 17          # repeat one case, verbose
    python bench/exactness_fuzz.py --cases 200 --device cuda --device-loop 8 --cuda-graphs

``--isa avx2`` runs the cases in a child process with torch, oneDNN and MKL capped at AVX2;
``--isa both`` runs them under the machine's own ISA and again capped. Model folders are written
by transformers once per architecture into ``--cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # cases with 2-4 threads on a shared machine: no spinning

CHILD = "TIMLAB_EXACTNESS_CHILD"


def _default_cache() -> str:
    root = os.environ.get("TIMLAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "timlab")
    return os.path.join(root, "exactness")


def run_here(args, isa: str) -> dict:
    import torch

    from timlab.experiments.diagnostics import exactness as ex
    from timlab.files import write_json

    indices = [args.case] if args.case is not None else list(range(args.start, args.start + args.cases))
    cases = [ex.draw_case(args.seed, i, real_width_frac=args.real_width_frac) for i in indices]
    if args.model_type:
        cases = [c for c in cases if c.arch.model_type == args.model_type]
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    failures, results, t0 = [], [], time.perf_counter()
    loop, extra = _loop_options(args)
    for n, case in enumerate(cases, 1):
        try:
            res = ex.run_case(case, args.cache, backend=args.backend, device=args.device, loop=loop)
        except Exception as e:  # a crash is a finding too: report it with its command
            failures.append({"index": case.index, "case": case.summary(), "error": f"{type(e).__name__}: {e}",
                             "command": ex.case_command(args.seed, case.index, isa, args.backend, extra)})
            print(f"[{isa}] case {case.index}: ERROR {type(e).__name__}: {e}", flush=True)
            continue
        results.append(res)
        if not res.ok:
            failures.append({"index": case.index, "case": case.summary(), "bad_tokens": res.bad,
                             "tokens": res.tokens, "max_abs_diff": res.max_abs_diff,
                             "command": ex.case_command(args.seed, case.index, isa, args.backend, extra)})
        if args.case is not None or not res.ok or args.verbose:
            print(f"[{isa}] case {case.index}: {'ok' if res.ok else 'FAIL'} {case.summary()} tokens {res.tokens} "
                  f"bad {res.bad} max|r| {res.max_abs_diff:.3g} ({res.seconds:.1f} s)", flush=True)
        if n % args.every == 0 or n == len(cases):
            print(f"[{isa}] {n}/{len(cases)} cases, {len(failures)} failed, {time.perf_counter() - t0:.0f} s",
                  flush=True)
    summary = {
        "isa": isa, "backend": args.backend, "device": args.device, "decode_loop": extra or "host",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
        "seed": args.seed, "cases": len(cases), "failed": len(failures),
        "tokens_checked": sum(r.tokens for r in results), "seconds": round(time.perf_counter() - t0, 1),
        "failures": failures, "coverage": ex.coverage(cases), "max_abs_diff_histogram": ex.log_ratio_histogram(results),
    }
    if args.json:
        write_json(args.json, summary)
    return summary


def _loop_options(args):
    """The engine's ``device_loop`` from ``--device-loop``/``--cuda-graphs``, and those options as typed."""
    from timlab.engines.device_loop import DeviceLoop

    if not args.device_loop:
        return None, (f"--device {args.device}" if args.device != "cpu" else "")
    extra = f"--device-loop {args.device_loop}" + (" --cuda-graphs" if args.cuda_graphs else "")
    extra = (f"--device {args.device} " if args.device != "cpu" else "") + extra
    return DeviceLoop(sync_every=args.device_loop, cuda_graphs=args.cuda_graphs), extra


def run_child(args, isa: str) -> dict:
    """The same cases in a child process whose environment caps the ISA."""
    from timlab.machine import PIN_ENV

    out = Path(args.cache) / f"child-{os.getpid()}.json"
    argv = [sys.executable, __file__, "--seed", str(args.seed), "--cases", str(args.cases), "--start", str(args.start),
            "--cache", args.cache, "--json", str(out), "--every", str(args.every),
            "--real-width-frac", str(args.real_width_frac), "--isa", "native", "--backend", args.backend]
    if args.model_type:
        argv += ["--model-type", args.model_type]
    if args.case is not None:
        argv += ["--case", str(args.case)]
    env = {**os.environ, **PIN_ENV, CHILD: isa}
    subprocess.run(argv, env=env, check=False)
    summary = json.loads(out.read_text())  # the child ran under ``isa``: its commands carry PIN_ENV
    out.unlink()
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200, help="how many cases to draw (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the case space (default 0)")
    ap.add_argument("--start", type=int, default=0, help="index of the first case (default 0)")
    ap.add_argument("--case", type=int, default=None, help="run only this case index, verbosely")
    ap.add_argument("--isa", choices=("native", "avx2", "both"), default="native",
                    help="the machine's own ISA, AVX2-capped (a child process), or both (default native)")
    ap.add_argument("--real-width-frac", type=float, default=0.02,
                    help="share of cases at a real model's per-layer widths (default 0.02)")
    ap.add_argument("--cache", default=_default_cache(), help="where model folders are written (default: %(default)s)")
    ap.add_argument("--every", type=int, default=25, help="print progress every this many cases")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--verbose", action="store_true", help="a line per case")
    ap.add_argument("--model-type", default=None, help="run only the drawn cases of this architecture (e.g. qwen3_moe)")
    ap.add_argument("--device", default="cpu", help="where the models run: cpu or cuda (default cpu)")
    ap.add_argument("--device-loop", type=int, default=0, metavar="K",
                    help="roll out with the device-side decode loop, a host read every K steps (default 0: the host loop)")
    ap.add_argument("--cuda-graphs", action="store_true", help="with --device-loop: the decode step as CUDA graphs")
    ap.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                    help="the exact path's kernels; triton on a CPU runs the GPU kernels in Triton's interpreter")
    args = ap.parse_args()
    if args.backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton loads; a GPU run sets it to 0
    if args.cases < 1:
        ap.error("--cases must be >= 1")
    if args.device_loop < 0 or (args.cuda_graphs and not args.device_loop):
        ap.error("--device-loop must be >= 1 (0: the host loop), and --cuda-graphs needs it")
    if args.isa != "native" and (args.device != "cpu" or args.device_loop):
        ap.error("--isa avx2/both are CPU runs of the host loop; leave out --device and --device-loop")
    isa_name = os.environ.get(CHILD, "native")
    if args.isa == "native":
        summaries = [run_here(args, isa_name)]  # writes --json itself
    else:  # the AVX2 run's summary comes back from its child; --json is written here
        json_path, args.json = args.json, None
        summaries = ([run_here(args, "native")] if args.isa == "both" else []) + [run_child(args, "avx2")]
        if json_path:
            from timlab.files import write_json

            write_json(json_path, summaries[0] if len(summaries) == 1 else {"runs": summaries})
    if os.environ.get(CHILD):
        return 0
    for s in summaries:
        print(f"\n{s['isa']} ISA (torch {s['torch']}, capability {s['cpu_capability']}): {s['cases']} cases, "
              f"{s['failed']} failed, {s['tokens_checked']} tokens checked, {s['seconds']} s")
        for f in s["failures"]:
            print(f"  FAIL {f['case']}\n       {f.get('error') or f['bad_tokens']}\n       repeat: {f['command']}")
        print("  coverage:", json.dumps(s["coverage"]))
        print("  worst |r| per case:", json.dumps(s["max_abs_diff_histogram"]))
    return 1 if any(s["failed"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
