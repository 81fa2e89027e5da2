"""Benchmark: the CPU time of one RL step of the surge testbed at larger policy widths (issue 57: the
scale ladder's budget, measured before anything is registered).

    OMP_NUM_THREADS=1 python bench/scale_step.py [--steps 6] [--sizes s,m,l,xl] [--json OUT]

Each size is the surge preset (scratch_add, 16 prompts x 8 samples, <= 32 new tokens, GRPO, exact
engine) with another width and depth (``SIZES``), one torch thread, from a warm start made by a
few SFT steps only (``model.pretrain_steps``): its answers are not the learned policy's, so a step
here generates up to the 32-token cap where a learned policy answers in ~23. The figure to budget
with is therefore CPU-s per generated token and per step, both printed; steps/s is 1 / the median
step's CPU time. The first step is dropped (warm-up). Validation is outside ``train_step``: an
evaluation of 512 prompts costs about 4 rollouts' worth of tokens per size on top (not timed here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from timlab.config import resolve  # noqa: E402
from timlab.trainer.run import RLRun  # noqa: E402

SIZES = {
    "s": {"model.hidden_size": 64, "model.num_layers": 3, "model.num_heads": 4, "model.num_kv_heads": 2,
          "model.intermediate_size": 192},   # the surge preset itself, ~0.15M parameters
    "m": {"model.hidden_size": 128, "model.num_layers": 6, "model.num_heads": 4, "model.num_kv_heads": 2,
          "model.intermediate_size": 384},
    "l": {"model.hidden_size": 256, "model.num_layers": 6, "model.num_heads": 8, "model.num_kv_heads": 4,
          "model.intermediate_size": 768},
    "xl": {"model.hidden_size": 384, "model.num_layers": 8, "model.num_heads": 8, "model.num_kv_heads": 4,
           "model.intermediate_size": 1152},
}
"""Size name -> model overrides of the surge preset."""


def measure(name: str, steps: int) -> dict:
    over = [f"{k}={v}" for k, v in SIZES[name].items()] + [f"run.steps={steps}", "run.progress=false",
                                                          "model.pretrain_steps=50"]
    cfg = resolve(preset="surge", overrides=over)
    with tempfile.TemporaryDirectory(prefix="timlab-scale-") as d:
        run = RLRun(cfg, Path(d) / "run")
        try:
            params = sum(p.numel() for p in run.model.parameters())
            cpu, tokens = [], []
            for i in range(steps):
                c0 = time.process_time()
                out = run.train_step()
                if i:
                    cpu.append(time.process_time() - c0)
                    tokens.append(out.metrics["train/response_length_mean"] * cfg.rollout.prompts_per_step
                                  * cfg.rollout.samples_per_prompt)
        finally:
            run.close()
    med = statistics.median(cpu)
    return {"size": name, "params": params, "cpu_s_per_step": med, "steps_per_cpu_s": 1 / med,
            "tokens_per_step": statistics.mean(tokens), "cpu_ms_per_token": 1e3 * sum(cpu) / sum(tokens)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = a.sizes.split(",")
    bad = [n for n in names if n not in SIZES]
    if bad:
        ap.error(f"unknown size {bad[0]!r}; valid choices: {', '.join(SIZES)}")
    rows = []
    for n in names:
        r = measure(n, a.steps)
        rows.append(r)
        print(f"{n:3s} {r['params'] / 1e6:6.2f}M params  {r['cpu_s_per_step']:.3f} CPU-s/step  "
              f"{r['tokens_per_step']:.0f} tokens/step  {r['cpu_ms_per_token']:.3f} CPU-ms/token", flush=True)
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['size']} / {base['size']}: {r['params'] / base['params']:.1f}x parameters, "
              f"{r['cpu_s_per_step'] / base['cpu_s_per_step']:.1f}x CPU per step")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
