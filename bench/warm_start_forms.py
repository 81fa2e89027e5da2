"""Benchmark: what a scratch_add warm start does with its two answer forms.

    OMP_NUM_THREADS=1 python bench/warm_start_forms.py MODEL_DIR --verbosity L [--n 256] [--samples 8]

On ``--n`` validation prompts of the surge preset's split (task.kwargs.verbosity=L): sampled at
temperature 1 (``--samples`` per prompt, seed 0), the share of responses that start the worked
form (``:``), the accuracy of worked and of terse responses, and the share of worked responses
that reach EOS within the budget; greedy, the accuracy with the worked form forced (the prompt
ends in ``:``) and without. Says whether RL can find the worked form: it must be sampled often
enough and pay more than the terse one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from timlab.config import resolve  # noqa: E402
from timlab.engines import build_engine  # noqa: E402
from timlab.engines.base import SamplingParams  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402
from timlab.tasks import build_task, make_splits  # noqa: E402
from timlab.tasks.scratchpad import SCRATCH_MARK  # noqa: E402
from timlab.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--verbosity", type=int, required=True)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = resolve(preset="surge", overrides=[f"task.kwargs.verbosity={args.verbosity}"])
    task = build_task(cfg)
    _, val = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
    val = (val * (args.n // len(val) + 1))[: args.n] if args.n > len(val) else val[: args.n]
    tok = load_tokenizer(args.model_dir)
    model = load_model(args.model_dir).eval()
    engine = build_engine("exact", model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    budget = task.max_answer_chars + 4
    gen = torch.Generator().manual_seed(0)
    rows = [e for e in val for _ in range(args.samples)]
    worked = terse = worked_ok = terse_ok = worked_done = 0
    with torch.no_grad():
        for i in range(0, len(rows), 128):
            chunk = rows[i : i + 128]
            r = engine.generate([task.encode_prompt(tok, e) for e in chunk], max_new_tokens=budget,
                                sampling=SamplingParams(temperature=1.0), generator=gen)
            for e, ids, done in zip(chunk, r.responses(), r.finished.tolist()):
                text = tok.decode(ids)
                ok = bool(done) and task.reward(e, text) == 1.0
                if text.startswith(SCRATCH_MARK):
                    worked, worked_ok, worked_done = worked + 1, worked_ok + ok, worked_done + bool(done)
                else:
                    terse, terse_ok = terse + 1, terse_ok + ok
        greedy = {}
        for forced in ("", SCRATCH_MARK):
            prompts = [task.encode_prompt(tok, e) + tok.encode(forced) for e in val]
            r = engine.generate(prompts, max_new_tokens=budget, sampling=SamplingParams(temperature=0.0))
            greedy[forced] = sum(bool(d) and task.reward(e, forced + tok.decode(ids)) == 1.0
                                 for e, ids, d in zip(val, r.responses(), r.finished.tolist())) / len(val)
    n = worked + terse
    print(f"verbosity {args.verbosity}, {args.model_dir}: sampled {n}: worked form {worked / n:.3f} "
          f"(accuracy {worked_ok / max(worked, 1):.3f}, reached EOS {worked_done / max(worked, 1):.3f}), "
          f"terse {terse / n:.3f} (accuracy {terse_ok / max(terse, 1):.3f}); greedy accuracy {greedy['']:.3f}, "
          f"worked form forced {greedy[SCRATCH_MARK]:.3f} ({len(val)} prompts)")


if __name__ == "__main__":
    main()
