"""Benchmark: CPU-seconds of one SFT step and one RL train step at long answers, before and after a change.

    git archive 2880e5c timlab | tar -x -C /tmp/before      # the code to compare with
    OMP_NUM_THREADS=1 python bench/train_long.py --before /tmp/before [--restate 1 31 109] [--json out.json]
    OMP_NUM_THREADS=1 python bench/train_long.py --profile 109 rl      # where one step's time goes (this checkout)

The steps at ``scratch_add``'s long answers (``task.kwargs.restate`` 1, 31, 109: T ~ 30, 300,
1,000), on the surge preset's policy (hidden 64, 3 layers, 4 heads over 2 KV heads, MLP 192,
``timlab pretrain``'s initialization, seed 0), one thread:

- ``sft``: ``timlab.trainer.pretrain.sft_update`` (fast mode) on a batch of 64 worked
  demonstrations (``task.kwargs.scratch_frac=1.0``), what ``bench/long_answers.py`` times;
- ``rl``: the trainer's update at one epoch and one mini-batch (``Trainer._score`` and ``_update``):
  ``token_logprobs`` in exact mode with autograd, entropy, the rollout's buffer length and the
  response mask; ``ppo_clip_loss``; backward; gradient clipping at 1; AdamW. The rollout is 16
  prompts x 8 samples whose responses are worked demonstrations (no decoding is timed).

Each (code, length, kind) runs in a fresh process (``--child``) on the same seeded batches;
before and after alternate over ``--rounds``. CPU time is ``time.process_time`` of the step alone.
Each process also writes a SHA-256 of the bits of every step's loss, log-probs and gradients
and of the final weights; the summary says whether before and after agree bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
STEPS = {1: 20, 31: 5, 109: 2}
"""Timed steps per process at each restate (a T ~ 1,000 RL step took ~66 CPU-s before the change)."""


def _setup(code: str, restate: int, kind: str):
    """(step, digest): ``step()`` runs one ``kind`` step at ``restate`` with the timlab package in
    ``code`` and returns (its CPU-s, the batch width); ``digest`` hashes the bits it produced."""
    sys.path.insert(0, code)
    import torch

    from timlab.config import resolve
    from timlab.model.forward import buffer_length, teacher_forced_batch, token_logprobs
    from timlab.model.llama import CausalLM
    from timlab.tasks import build_task, make_splits
    from timlab.tokenizer import load_tokenizer, save_char_tokenizer
    from timlab.trainer.losses import ppo_clip_loss
    from timlab.trainer.pretrain import _init_weights, model_config_for, sft_batch, sft_update

    assert Path(sys.modules["timlab"].__file__).is_relative_to(code), "timlab imported from elsewhere"
    torch.set_num_threads(1)
    cfg = resolve(preset="surge", overrides=[f"task.kwargs.restate={restate}", "task.kwargs.scratch_frac=1.0"])
    task = build_task(cfg)
    train, _ = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
    tok_dir = Path(f"/tmp/train_long_tok_{restate}_{os.getpid()}")
    save_char_tokenizer(task.alphabet, tok_dir)
    tok = load_tokenizer(tok_dir)
    max_new = task.max_answer_chars + 8
    torch.manual_seed(cfg.model.pretrain_seed)
    model = CausalLM(model_config_for(cfg, tok.vocab_size, tok, task.max_prompt_chars + max_new + 64))
    _init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.model.pretrain_lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng = random.Random(0)
    digest = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        digest.update(t.detach().contiguous().numpy().tobytes())

    def sft_step() -> tuple[float, int, torch.Tensor]:
        batch = rng.sample(train, cfg.model.pretrain_batch)
        tokens, key_valid, mask = sft_batch(tok, batch, [task.demonstration(e, rng) for e in batch])
        t0 = time.process_time()
        loss = sft_update(model, opt, tokens, key_valid, mask)
        return time.process_time() - t0, tokens.shape[1], loss

    def rl_step() -> tuple[float, int, torch.Tensor]:
        G = cfg.rollout.samples_per_prompt
        examples = [e for e in rng.sample(train, cfg.rollout.prompts_per_step) for _ in range(G)]
        prompts = [task.encode_prompt(tok, e) for e in examples]
        answers = [tok.encode(task.demonstration(e, rng)) + [tok.eos_token_id] for e in examples]
        tokens, key_valid, mask = teacher_forced_batch(prompts, answers, tok.pad_token_id)
        S = buffer_length(max(len(p) for p in prompts), max_new)  # the rollout's buffer
        adv = torch.tensor([rng.gauss(0.0, 1.0) for _ in examples])
        t0 = time.process_time()
        logp, _ = token_logprobs(model, tokens, key_valid, mode="exact", with_entropy=True, kv_len=S, score_mask=mask)
        loss, _ = ppo_clip_loss(logp, logp.detach(), adv, mask.float(), denom=float(mask.sum()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        add(logp)
        return time.process_time() - t0, tokens.shape[1], loss

    def step() -> tuple[float, int]:
        cpu, width, loss = (sft_step if kind == "sft" else rl_step)()
        add(loss)
        for p in model.parameters():
            add(p.grad)
        return cpu, width

    def final_digest() -> str:
        for p in model.parameters():
            add(p)
        return digest.hexdigest()

    return step, final_digest


def _child(args) -> None:
    """One process: ``args.steps`` timed steps; prints their CPU-s, widths and the bits' digest."""
    step, final_digest = _setup(args.code, args.restate, args.kind)
    times, widths = zip(*(step() for _ in range(args.steps)))
    print(json.dumps({"cpu_s": times, "width": widths, "bits": final_digest()}))


def _run(code: str, restate: int, kind: str, steps: int) -> dict:
    cmd = [sys.executable, str(HERE), "--child", "--code", code, "--kind", kind, "--steps", str(steps),
           "--restate", str(restate)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _profile(restate: int, kind: str) -> None:
    """torch.profiler over one step of this checkout (after one unprofiled step)."""
    from torch.profiler import ProfilerActivity, profile

    step, _ = _setup(str(HERE.parents[1]), restate, kind)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cpu, _ = step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    print(f"{kind} step at restate {restate}: {cpu:.2f} CPU-s (under the profiler)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a folder holding the timlab package to compare with")
    ap.add_argument("--restate", type=int, nargs="+", default=[1, 31, 109])
    ap.add_argument("--kinds", nargs="+", default=["sft", "rl"], choices=["sft", "rl"])
    ap.add_argument("--rounds", type=int, default=1, help="before/after alternations per (length, kind)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--profile", nargs=2, metavar=("RESTATE", "KIND"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--code", help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.restate = args.restate[0]
        return _child(args)
    if args.profile:
        return _profile(int(args.profile[0]), args.profile[1])
    codes = {"after": str(HERE.parents[1])}
    if args.before:
        codes = {"before": str(Path(args.before).resolve()), **codes}
    rows = []
    for restate in args.restate:
        for kind in args.kinds:
            res = {name: [] for name in codes}
            for _ in range(args.rounds):
                for name, code in codes.items():
                    res[name].append(_run(code, restate, kind, STEPS.get(restate, 2)))
            row = {"restate": restate, "kind": kind, "width": statistics.mean(res["after"][0]["width"])}
            for name in codes:
                row[f"{name}_cpu_s"] = statistics.median(t for r in res[name] for t in r["cpu_s"])
            if args.before:
                row["ratio"] = row["before_cpu_s"] / row["after_cpu_s"]
                row["same_bits"] = len({r["bits"] for name in codes for r in res[name]}) == 1
            row["runs"] = res
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "runs"}),
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
