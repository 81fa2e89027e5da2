"""Benchmark: SFT cost and learning curve of scratch_add's long answers (``task.kwargs.restate``).

    OMP_NUM_THREADS=1 python bench/long_answers.py --restate 31 --steps 1500 --cpu-budget 600 \
        [--eval-every 100] [--init MODEL] [--save DIR] [--greedy 128] [--set model.hidden_size=96 ...]

The surge preset's SFT (every demonstration worked: ``task.kwargs.scratch_frac=1.0``, batch 64,
the LR schedule of ``timlab pretrain`` over ``--steps``), stopped when this process has used
``--cpu-budget`` CPU-seconds (``time.process_time``: a loaded machine does not inflate it), so a
learning curve at T ~ 1,000 fits a fixed budget. ``--init MODEL`` continues from a saved model of
the same architecture and alphabet (a curriculum: learn at T ~ 300, then go on at T ~ 1,000).

Every ``--eval-every`` steps, on the first 128 validation prompts, teacher-forced on the gold
completion (one forward, no decoding):

- ``tf_exact``: the share of prompts whose every answer token (EOS included) is the model's argmax
  given the gold prefix. Greedy decoding then writes the gold completion, so this is a lower bound
  on greedy accuracy (greedy can also reach the right sum another way), and costs one forward;
- per-token argmax accuracy and mean entropy (nats) on the restated part (the countdown entries)
  and on the worked part (level 0's answer after the last entry, where the decisions are);
- the mean number of answer tokens per prompt whose entropy is above 0.1 nats ("uncertain").

``--greedy N``: at the end, greedy accuracy on the first N validation prompts with the exact
engine (what ``timlab pretrain`` reports). Prints one JSON line per evaluation and a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from timlab.config import resolve  # noqa: E402
from timlab.model.forward import full_step, teacher_forced_batch  # noqa: E402
from timlab.model.hf_io import load_model, save_model  # noqa: E402
from timlab.model.llama import CausalLM  # noqa: E402
from timlab.tasks import build_task, make_splits  # noqa: E402
from timlab.tasks.scratchpad import restatement  # noqa: E402
from timlab.tokenizer import load_tokenizer, save_char_tokenizer  # noqa: E402
from timlab.trainer.pretrain import _init_weights, model_config_for, sft_batch, sft_update  # noqa: E402
from timlab.trainer.scoring import greedy_accuracy  # noqa: E402

UNCERTAIN_NATS = 0.1
"""A token whose next-token entropy is above this counts as uncertain (a decision)."""


@torch.no_grad()
def teacher_forced_profile(model: CausalLM, tok, task, examples, *, restate: int) -> dict:
    """Per example, along the gold completion + EOS: entropy (nats), argmax == gold, and whether
    the token belongs to the restated part. Returns the summary dict described in the docstring
    and the raw per-example lists (``entropy``, ``restated``)."""
    completions = [tok.encode(task.gold_completion(e)) + [tok.eos_token_id] for e in examples]
    prompts = [task.encode_prompt(tok, e) for e in examples]
    tokens, key_valid, mask = teacher_forced_batch(prompts, completions, tok.pad_token_id)
    logits = model(tokens, full_step(key_valid), mode="fast")  # (B, S, V)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, S-1, V): predicts column c+1
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1)  # (B, S-1)
    hit = logp.argmax(-1) == tokens[:, 1:]  # (B, S-1)
    mask = mask[:, 1:]
    P = max(len(p) for p in prompts)
    out = {"entropy": [], "restated": []}
    exact, n_unc = [], []
    acc = {"restated": [0, 0], "worked": [0, 0]}
    ent = {"restated": 0.0, "worked": 0.0}
    for b, (e, c) in enumerate(zip(examples, completions)):
        a, bb = (int(x) for x in e.prompt[:-1].split("+"))
        n_rest = len(restatement(a, bb, restate))
        cols = slice(P - 1, P - 1 + len(c))  # logits at column P-1+i predict completion token i
        h, ok = entropy[b, cols], hit[b, cols]
        assert bool(mask[b, cols].all())
        exact.append(bool(ok.all()))
        n_unc.append(int((h > UNCERTAIN_NATS).sum()))
        for part, sl in (("restated", slice(0, n_rest)), ("worked", slice(n_rest, len(c)))):
            acc[part][0] += int(ok[sl].sum())
            acc[part][1] += int(ok[sl].numel())
            ent[part] += float(h[sl].sum())
        out["entropy"].append(h.tolist())
        out["restated"].append(n_rest)
    summary = {"tf_exact": sum(exact) / len(exact), "uncertain_tokens": sum(n_unc) / len(n_unc)}
    for part in acc:
        if acc[part][1]:
            summary[f"{part}_token_acc"] = acc[part][0] / acc[part][1]
            summary[f"{part}_entropy"] = ent[part] / acc[part][1]
    return {"summary": summary, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--restate", type=int, required=True)
    ap.add_argument("--steps", type=int, default=1500, help="the LR schedule's length (the preset's 1500)")
    ap.add_argument("--cpu-budget", type=float, default=600.0, help="stop after this many CPU-seconds")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--n-eval", type=int, default=128)
    ap.add_argument("--init", help="continue from this model folder (same architecture and alphabet)")
    ap.add_argument("--save", help="save the final model here (an HF folder with the char tokenizer)")
    ap.add_argument("--greedy", type=int, default=0, help="greedy accuracy on this many validation prompts at the end")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides, e.g. model.hidden_size=96")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = resolve(preset="surge", overrides=[f"task.kwargs.restate={args.restate}", "task.kwargs.scratch_frac=1.0",
                                             "task.n_val=512", *args.set])
    task = build_task(cfg)
    train, val = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
    tok_dir = Path(f"/tmp/long_answers_tok_{args.restate}")
    save_char_tokenizer(task.alphabet, tok_dir)
    tok = load_tokenizer(tok_dir)
    max_new = task.max_answer_chars + 8
    if args.init:
        model = load_model(args.init)
        need = task.max_prompt_chars + max_new + 64
        if model.config.max_position_embeddings < need:  # RoPE has no weights: only the bound moves
            model.config = dataclasses.replace(model.config, max_position_embeddings=need)
            model.refresh_rope()
    else:
        torch.manual_seed(cfg.model.pretrain_seed)
        model = CausalLM(model_config_for(cfg, tok.vocab_size, tok, task.max_prompt_chars + max_new + 64))
        _init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.model.pretrain_lr, weight_decay=0.01, betas=(0.9, 0.98))
    steps = args.steps
    warmup = max(1, steps // 20)

    def lr_factor(s: int) -> float:  # timlab pretrain's: linear warmup, cosine decay to 5%
        return min(1.0, (s + 1) / warmup) * max(0.05, 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    rng = random.Random(cfg.model.pretrain_seed)
    evals = val[: args.n_eval]
    train_cpu, eval_cpu, widths = 0.0, 0.0, []
    step = 0
    curve = []
    while step < steps and train_cpu < args.cpu_budget:
        step += 1
        model.train()
        batch = rng.sample(train, min(cfg.model.pretrain_batch, len(train)))
        tokens, key_valid, loss_mask = sft_batch(tok, batch, [task.demonstration(e, rng) for e in batch])
        t0 = time.process_time()
        loss = sft_update(model, opt, tokens, key_valid, loss_mask)
        sched.step()
        train_cpu += time.process_time() - t0
        widths.append(tokens.shape[1])
        if step % args.eval_every == 0 or step == steps or train_cpu >= args.cpu_budget:
            model.eval()
            t0 = time.process_time()
            prof = teacher_forced_profile(model, tok, task, evals, restate=args.restate)
            eval_cpu += time.process_time() - t0
            row = {"step": step, "loss": round(loss.item(), 5), "train_cpu_s": round(train_cpu, 1),
                   **{k: round(v, 4) for k, v in prof["summary"].items()}}
            curve.append(row)
            print(json.dumps(row), flush=True)
    result = {"restate": args.restate, "init": args.init, "num_params": n_params, "steps_done": step,
              "cpu_s_per_step": train_cpu / step, "mean_padded_width": sum(widths) / len(widths),
              "eval_cpu_s": eval_cpu, "overrides": args.set, "curve": curve}
    if args.greedy:
        t0 = time.process_time()
        acc, mean_len = greedy_accuracy(model, tok, task, val[: args.greedy], max_new_tokens=max_new)
        result.update(greedy_accuracy=acc, greedy_mean_length=mean_len, greedy_cpu_s=time.process_time() - t0)
    if args.save:
        save_model(model, Path(args.save), tokenizer_dir=tok_dir)
    print("SUMMARY " + json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)


if __name__ == "__main__":
    main()
