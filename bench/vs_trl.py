"""Benchmark: steps/s of timlab's RL training step vs TRL's ``GRPOTrainer`` on the same tiny model.

    OMP_NUM_THREADS=1 python bench/vs_trl.py [--json OUT] [--prompts 16] [--samples 8]
                                             [--new-tokens 32] [--steps 12] [--rounds 2]
                                             [--engine exact] [--model DIR] [--set KEY=VALUE ...]

Both sides train the same HF model folder (default: timlab's SFT warm start for the ``smoke``
preset's reverse task, built and cached on first use; ``--model`` for another folder holding a
char tokenizer) on the same task, with the same batch (prompts x samples per prompt), the same
maximum generation length, temperature 1, top_k 0, top_p 1, fp32, CPU, one torch thread, one
process:

- timlab: ``RLRun(resolve(preset="smoke", overrides=[model.path, rollout.*]))``;
  ``run.train_step()`` timed around the call (rollout with ``--engine``, trainer forward,
  metrics incl. the per-step distributions, IS, loss, AdamW update, scheduler). Validation,
  checkpoints and metric writing happen outside ``train_step`` and are not timed.
- TRL: ``GRPOTrainer`` loading the folder itself (``PreTrainedTokenizerFast`` for the char
  tokenizer), ``num_generations`` = samples, ``per_device_train_batch_size`` = prompts x samples
  (one generation per optimizer step, one update per generation), ``max_completion_length`` =
  new tokens, no vLLM, ``gradient_checkpointing=False`` (TRL's default True only slows a model
  this small), ``report_to=[]``, the task's 0/1 reward. A callback times ``on_step_begin`` ->
  ``on_step_end`` (generation, reward, loss, backward, optimizer and scheduler step); logging
  happens after ``on_step_end`` and is not timed.

Each round builds a fresh run/trainer per side (setup not timed), runs ``--steps`` steps and
drops the first (warm-up); sides alternate, timlab first, so background load hits both alike.
steps/s = 1 / median step time over all rounds; CPU-time figures are given alongside. Realized
mean completion lengths are reported for both sides: they sample from the same policy, but
rows stop at EOS, so lengths (and so work) can differ slightly.

Target: timlab >= 3 x TRL steps/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import torch  # noqa: E402

from timlab.files import write_json  # noqa: E402
from timlab.config import resolve  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402
from timlab.tasks import build_task, make_splits  # noqa: E402
from timlab.trainer.pretrain import pretrain  # noqa: E402
from timlab.trainer.run import RLRun  # noqa: E402


def timlab_config(args, model_dir: str):
    return resolve(preset="smoke", overrides=list(args.set) + [
        f"model.path={model_dir}",
        f"rollout.engine={args.engine}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        f"run.steps={args.steps}", "run.progress=false",
    ])


def time_timlab(cfg, steps: int) -> dict:
    """Wall and CPU seconds of each ``train_step`` after the first, and the mean response lengths."""
    with tempfile.TemporaryDirectory(prefix="timlab-bench-") as d:
        run = RLRun(cfg, Path(d) / "run")
        wall, cpu, lengths = [], [], []
        for i in range(steps):
            w0, c0 = time.perf_counter(), time.process_time()
            out = run.train_step()
            w, c = time.perf_counter() - w0, time.process_time() - c0
            if i > 0:
                wall.append(w)
                cpu.append(c)
                lengths.append(out.metrics["train/response_length_mean"])
        if run.log is not None:
            run.log.close()
    return {"wall": wall, "cpu": cpu, "lengths": lengths}


def time_trl(cfg, model_dir: str, steps: int, out_dir: Path) -> dict:
    """Wall and CPU seconds of each GRPOTrainer optimizer step after the first."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = build_task(cfg)
    train, _ = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
    data = Dataset.from_dict({"prompt": [e.prompt for e in train], "answer": [e.answer for e in train]})
    by_prompt = {e.prompt: e for e in train}

    def reward(prompts, completions, **kwargs):
        return [task.reward(by_prompt[p], c) for p, c in zip(prompts, completions)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.wall, self.cpu = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self._w, self._c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.wall.append(time.perf_counter() - self._w)
            self.cpu.append(time.process_time() - self._c)

    r = cfg.rollout
    n = r.prompts_per_step * r.samples_per_prompt
    targs = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=n, num_generations=r.samples_per_prompt,
        generation_batch_size=n, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=r.max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, max_grad_norm=cfg.optim.grad_clip,
        lr_scheduler_type="constant", beta=0.0, max_steps=steps, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
        log_completions=False, seed=cfg.run.seed,
    )
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=targs, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"wall": timer.wall[1:], "cpu": timer.cpu[1:], "lengths": lengths[1:]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12, help="steps per round and side (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine", default="exact", help="timlab rollout engine: exact (default), fast, hf")
    ap.add_argument("--model", help="HF model folder with a char tokenizer (default: the smoke SFT warm start)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="extra timlab config override on top of the smoke preset, also used for the warm "
                         "start, e.g. --set task.kwargs.max_len=24 (repeatable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    import transformers
    import trl

    model_dir = args.model or str(pretrain(resolve(preset="smoke", overrides=list(args.set) or None)).path)
    cfg = timlab_config(args, model_dir)
    res = {"timlab": {"wall": [], "cpu": [], "lengths": []}, "trl": {"wall": [], "cpu": [], "lengths": []}}
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as d:
        for i in range(args.rounds):
            for side in ("timlab", "trl"):
                got = time_timlab(cfg, args.steps) if side == "timlab" else time_trl(cfg, model_dir, args.steps, Path(d) / str(i))
                for k in res[side]:
                    res[side][k] += got[k]

    def rate(xs):
        return 1.0 / statistics.median(xs)

    out = {
        "model": model_dir,
        "num_parameters": sum(p.numel() for p in load_model(model_dir).parameters()),
        "task": cfg.task.name, "task_kwargs": cfg.task.kwargs, "overrides": list(args.set),
        "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
        "steps_per_round": args.steps, "rounds": args.rounds, "timlab_engine": args.engine,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__,
        "timlab_steps_per_s": rate(res["timlab"]["wall"]),
        "trl_steps_per_s": rate(res["trl"]["wall"]),
        "timlab_cpu_steps_per_s": rate(res["timlab"]["cpu"]),
        "trl_cpu_steps_per_s": rate(res["trl"]["cpu"]),
        "timlab_mean_response_length": statistics.mean(res["timlab"]["lengths"]),
        "trl_mean_completion_length": statistics.mean(res["trl"]["lengths"]),
        "seconds": {side: sorted(v["wall"]) for side, v in res.items()},
    }
    out["speedup"] = out["timlab_steps_per_s"] / out["trl_steps_per_s"]
    out["cpu_speedup"] = out["timlab_cpu_steps_per_s"] / out["trl_cpu_steps_per_s"]
    out["target_met"] = out["speedup"] >= 3.0
    print(f"{out['num_parameters']:,} params, {args.prompts} prompts x {args.samples} samples, "
          f"<= {args.new_tokens} new tokens, 1 thread, median of {len(res['timlab']['wall'])} steps per side")
    print(f"{'side':<8} {'steps/s':>8} {'median s':>9} {'cpu steps/s':>12} {'mean len':>9}")
    for side, key in (("timlab", "timlab_mean_response_length"), ("trl", "trl_mean_completion_length")):
        print(f"{side:<8} {out[f'{side}_steps_per_s']:>8.2f} {statistics.median(res[side]['wall']):>9.4f} "
              f"{out[f'{side}_cpu_steps_per_s']:>12.2f} {out[key]:>9.2f}")
    print(f"speedup timlab/TRL: {out['speedup']:.2f}x (CPU time: {out['cpu_speedup']:.2f}x); target >= 3x: "
          f"{'met' if out['target_met'] else 'NOT met'}")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
