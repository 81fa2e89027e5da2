"""Benchmark: exact-engine decode speed at long answers (T = 1,000 new tokens) on the CPU, before/after.

    OMP_NUM_THREADS=1 python bench/decode_long.py [--new-tokens 1000] [--rounds 3]
                                                  [--before DIR] [--json OUT] [--profile]

The rollout the trainer makes at a long answer length: the surge preset's policy (hidden 64, 3
layers, 4 heads / 2 KV heads, MLP 192, 0.15M parameters) with its context raised to the prompt
width + T, seeded random weights, and the trainer's batch: ``rollout.prompts_per_step`` scratch_add
prompts x ``rollout.samples_per_prompt`` samples (16 x 8 = 128 rows), temperature 1, one torch
thread. EOS is disabled (its id set outside the vocabulary), so every row decodes exactly T tokens
and the work does not depend on the weights.

Each measurement runs in a fresh process: one short warm-up rollout, then one timed rollout of T
tokens, reporting CPU time (user + system; steadier than wall time on a shared machine) and wall
time. ``--before DIR``: a checkout of the code to compare with, e.g.
``git archive <commit> | tar -x -C DIR``; each round then measures both trees, alternating which
goes first, and the script prints the after/before ratio of the median CPU-time tokens/s and
whether the two trees' rollouts (tokens and log-probs) are bitwise equal. ``--profile``: the top
ops of one rollout of this tree under ``torch.profiler``. Each measurement also reports its system
CPU time and minor page faults (``getrusage``): fresh large allocations cost page faults.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parents[1]


def worker(tree: str, new_tokens: int, profile: bool) -> dict:
    """One measurement with the code of ``tree`` (imported from there)."""
    sys.path.insert(0, tree)
    import torch

    from timlab.config import resolve
    from timlab.engines import build_engine
    from timlab.model.llama import CausalLM, random_init_
    from timlab.tasks import build_task, make_splits
    from timlab.tokenizer import load_tokenizer, save_char_tokenizer
    from timlab.trainer.pretrain import model_config_for

    torch.set_num_threads(1)
    cfg = resolve(preset="surge")
    task = build_task(cfg)
    _, val = make_splits(task, seed=cfg.task.split_seed, n_train=1, n_val=cfg.rollout.prompts_per_step)
    with tempfile.TemporaryDirectory() as d:
        save_char_tokenizer(task.alphabet, d)
        tok = load_tokenizer(d)
    prompts = [tok.encode(e.prompt) for e in val for _ in range(cfg.rollout.samples_per_prompt)]
    width = max(len(p) for p in prompts)
    model = CausalLM(model_config_for(cfg, tok.vocab_size, tok, width + new_tokens))
    random_init_(model, torch.Generator().manual_seed(0))
    model.refresh_rope()
    model.eval()
    engine = build_engine("exact", model, eos_token_id=tok.vocab_size, pad_token_id=tok.pad_token_id)

    def rollout(n: int):
        return engine.generate(prompts, max_new_tokens=n, generator=torch.Generator().manual_seed(0))

    rollout(16)  # warm-up: first-call costs (allocations, RoPE table)
    if profile:
        from torch.profiler import profile as torch_profile

        with torch_profile() as prof:
            rollout(new_tokens)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    w0, c0 = time.perf_counter(), time.process_time()
    r = rollout(new_tokens)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    assert r.num_tokens == len(prompts) * new_tokens, (r.num_tokens, len(prompts) * new_tokens)
    digest = hashlib.sha256(r.tokens.numpy().tobytes() + r.logprobs.numpy().tobytes()).hexdigest()
    return {"tree": tree, "rows": len(prompts), "prompt_width": width, "new_tokens": new_tokens,
            "num_parameters": sum(p.numel() for p in model.parameters()), "tokens": r.num_tokens,
            "cpu_s": cpu, "wall_s": wall, "system_s": u1.ru_stime - u0.ru_stime,
            "minor_page_faults": u1.ru_minflt - u0.ru_minflt, "cpu_tokens_per_s": r.num_tokens / cpu,
            "wall_tokens_per_s": r.num_tokens / wall, "digest": digest}


def measure(tree: str, new_tokens: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", tree, "--new-tokens", str(new_tokens)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", help="a checkout of the code to compare with")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one rollout")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.new_tokens, args.profile)))
        return {}
    if args.profile:
        worker(str(HERE), args.new_tokens, True)
        return {}

    trees = {"after": str(HERE)}
    if args.before:
        trees = {"before": str(Path(args.before).resolve()), **trees}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for i in range(args.rounds):
        order = list(trees) if i % 2 == 0 else list(trees)[::-1]
        for name in order:
            runs[name].append(measure(trees[name], args.new_tokens))
            r = runs[name][-1]
            print(f"round {i + 1} {name:<6} {r['cpu_tokens_per_s']:>8,.0f} tok/s (CPU {r['cpu_s']:.1f} s, of it "
                  f"system {r['system_s']:.1f} s; wall {r['wall_s']:.1f} s; {r['minor_page_faults']:,} page faults)",
                  flush=True)
    first = runs["after"][0]
    out = {"rows": first["rows"], "prompt_width": first["prompt_width"], "new_tokens": args.new_tokens,
           "num_parameters": first["num_parameters"], "rounds": args.rounds, "trees": trees, "runs": runs,
           "median_cpu_tokens_per_s": {k: statistics.median(r["cpu_tokens_per_s"] for r in v) for k, v in runs.items()},
           "median_wall_tokens_per_s": {k: statistics.median(r["wall_tokens_per_s"] for r in v) for k, v in runs.items()}}
    print(f"{first['num_parameters']:,} params, {first['rows']} rows x {args.new_tokens} new tokens "
          f"(prompt width {first['prompt_width']}), 1 thread, median of {args.rounds}:")
    for k, v in out["median_cpu_tokens_per_s"].items():
        print(f"  {k:<6} {v:>8,.0f} tok/s CPU time, {out['median_wall_tokens_per_s'][k]:>8,.0f} wall")
    if args.before:
        out["ratio_cpu"] = out["median_cpu_tokens_per_s"]["after"] / out["median_cpu_tokens_per_s"]["before"]
        out["ratio_wall"] = out["median_wall_tokens_per_s"]["after"] / out["median_wall_tokens_per_s"]["before"]
        out["bitwise_equal"] = len({r["digest"] for v in runs.values() for r in v}) == 1
        print(f"after/before: {out['ratio_cpu']:.2f}x (CPU time), {out['ratio_wall']:.2f}x (wall); "
              f"rollouts bitwise equal: {out['bitwise_equal']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
