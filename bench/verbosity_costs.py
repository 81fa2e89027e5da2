"""Benchmark: CPU cost of one SFT warm-start step of the surge preset at each ``task.kwargs.verbosity``.

    OMP_NUM_THREADS=1 python bench/verbosity_costs.py [--levels 0,1,2,3] [--steps 10]

For each level: the surge preset's model (0.15M parameters) at its SFT batch (64 examples, 20%
worked, the rest terse, padded to the batch's longest), ``--steps`` timed steps of the same
forward, backward and AdamW update ``timlab pretrain`` runs, after 2 untimed ones. Prints CPU
seconds per step (``time.process_time``: this process only, so a loaded machine does not inflate
it) and the projection to the preset's 1500 steps. The same examples at every level.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from timlab.config import resolve  # noqa: E402
from timlab.model.llama import CausalLM  # noqa: E402
from timlab.tasks import build_task, make_splits  # noqa: E402
from timlab.tokenizer import load_tokenizer, save_char_tokenizer  # noqa: E402
from timlab.trainer.pretrain import model_config_for, sft_batch, sft_update  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for level in (int(x) for x in args.levels.split(",")):
        cfg = resolve(preset="surge", overrides=[f"task.kwargs.verbosity={level}"])
        task = build_task(cfg)
        train, _ = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
        tmp = Path(f"/tmp/verbosity_costs_tok{level}")
        save_char_tokenizer(task.alphabet, tmp)
        tok = load_tokenizer(tmp)
        max_len = task.max_prompt_chars + task.max_answer_chars + 8 + 64
        torch.manual_seed(0)
        model = CausalLM(model_config_for(cfg, tok.vocab_size, tok, max_len))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.model.pretrain_lr)
        rng = random.Random(0)
        seconds, widths = [], []
        for step in range(args.steps + 2):
            batch = rng.sample(train, cfg.model.pretrain_batch)
            tokens, key_valid, loss_mask = sft_batch(tok, batch, [task.demonstration(e, rng) for e in batch])
            t0 = time.process_time()
            sft_update(model, opt, tokens, key_valid, loss_mask)
            if step >= 2:
                seconds.append(time.process_time() - t0)
                widths.append(tokens.shape[1])
        per = sum(seconds) / len(seconds)
        print(f"verbosity {level}: {per:.3f} CPU-s per SFT step (batch {cfg.model.pretrain_batch}, mean padded width "
              f"{sum(widths) / len(widths):.0f} tokens); x{cfg.model.pretrain_steps} steps = {per * cfg.model.pretrain_steps / 60:.1f} CPU-min")


if __name__ == "__main__":
    main()
