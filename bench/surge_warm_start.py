"""Benchmark: does a surge warm start leave RL room to learn? Greedy vs worked-out accuracy.

    OMP_NUM_THREADS=1 python bench/surge_warm_start.py --preset surge_moe [--set model.pretrain_steps=600 ...]

Builds (or reuses, from the cache) the SFT warm start of a preset with the given overrides and
prints, on the preset's validation prompts: greedy accuracy (how the warm start answers: tersely
when it leaves room), the mean greedy response length, and greedy accuracy when the scratchpad is
forced (the prompt ends in ``:``, so the policy must work the sum out): what RL can reach by
learning to write it. The surge testbed needs a low first and a high second (the dense surge
start: 0.57 and 0.99 on these prompts; docs/FINDINGS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.config import resolve  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402
from timlab.tasks import build_task, make_splits  # noqa: E402
from timlab.tasks.scratchpad import SCRATCH_MARK  # noqa: E402
from timlab.tokenizer import load_tokenizer  # noqa: E402
from timlab.trainer.scoring import greedy_accuracy  # noqa: E402
from timlab.trainer.pretrain import ensure_warm_start  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="surge_moe")
    ap.add_argument("--set", action="append", default=[], help="config overrides, section.key=value")
    a = ap.parse_args()
    cfg = resolve(preset=a.preset, overrides=a.set)
    t0 = time.process_time()
    warm = ensure_warm_start(cfg)
    build_s = time.process_time() - t0
    task = build_task(cfg)
    _, val = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
    tok, model = load_tokenizer(warm.path), load_model(warm.path).eval()
    budget = task.max_answer_chars + 8
    greedy, length = greedy_accuracy(model, tok, task, val, max_new_tokens=budget)
    forced = [dataclasses.replace(e, prompt=e.prompt + SCRATCH_MARK) for e in val]
    worked, worked_len = greedy_accuracy(model, tok, task, forced, max_new_tokens=budget)
    print(f"{warm.path.name} ({'cached' if warm.cached else f'built in {build_s:.0f} CPU-s'}), "
          f"{len(val)} validation prompts, overrides {a.set or 'none'}:")
    print(f"  greedy accuracy {greedy:.3f} (mean length {length:.1f}); scratchpad forced {worked:.3f} "
          f"(mean length {worked_len + 1:.1f}); room for RL {worked - greedy:+.3f}")


if __name__ == "__main__":
    main()
