"""Greedy accuracy of a scratch_add warm start by prompt length (characters, so by operand size).

    OMP_NUM_THREADS=1 python bench/accuracy_by_prompt.py MODEL_DIR --verbosity L [--n 256] [--max-new-tokens 386]

On the first ``--n`` validation prompts of the surge preset's split (``task.kwargs.scratch_frac=1.0``,
``task.n_val=512``, the E3 starts' draw) at ``task.kwargs.verbosity=L``: per prompt length, the
number of prompts, how many the greedy answer gets right, and how many reach EOS within the budget.
Says whether a start that fails does so on the long sums (the longest worked answers) or everywhere.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from timlab.config import resolve  # noqa: E402
from timlab.engines import build_engine  # noqa: E402
from timlab.engines.base import SamplingParams  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402
from timlab.tasks import build_task, make_splits  # noqa: E402
from timlab.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--verbosity", type=int, required=True)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=386)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = resolve(preset="surge", overrides=[f"task.kwargs.verbosity={args.verbosity}", "task.kwargs.scratch_frac=1.0",
                                             "task.n_val=512"])
    task = build_task(cfg)
    _, val = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
    val = val[: args.n]
    tok = load_tokenizer(args.model_dir)
    engine = build_engine("exact", load_model(args.model_dir).eval(), eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        r = engine.generate([task.encode_prompt(tok, e) for e in val], max_new_tokens=args.max_new_tokens,
                            sampling=SamplingParams(temperature=0.0))
    by: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for e, ids, done in zip(val, r.responses(), r.finished.tolist()):
        row = by[len(e.prompt)]
        row[0] += 1
        row[1] += bool(done) and task.reward(e, tok.decode(ids)) == 1.0
        row[2] += bool(done)
    print(f"{args.model_dir}, verbosity {args.verbosity}, {len(val)} prompts, greedy:")
    print("prompt chars  prompts  correct  reached EOS")
    for k in sorted(by):
        print(f"{k:>12}  {by[k][0]:>7}  {by[k][1]:>7}  {by[k][2]:>11}")


if __name__ == "__main__":
    main()
