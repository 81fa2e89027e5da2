"""Benchmark: the realized mismatch (k3 and mean |r|) of the realistic injectors, fp8, kv_cache
and stale, beside the older bf16 and int8 arms, on two models.

    OMP_NUM_THREADS=1 python bench/realistic_injectors.py [--only surge|qwen] [--steps 20] [--json OUT]

- ``surge``: the surge testbed's policy (its SFT warm start, ``--preset surge``, built and cached
  under ``TIMLAB_CACHE`` if missing). One short GRPO run per arm (``--steps``, the preset's LR
  2e-4, the exact engine) in a temporary directory; reported: the mean over steps 5..N of the
  logged ``rollout_corr/k3_kl`` and ``mismatch/abs_diff_mean`` (mean |r|, r = log pi - log mu
  per response token), so ``stale`` up to k = 4 is measured at its full lag.
- ``qwen``: Qwen3-0.6B's width (hidden 1024, 16/8 heads of 128, MLP 3072, vocabulary 151,936,
  tied embeddings) with 2 layers, random weights as transformers initializes and writes them
  (``Qwen3ForCausalLM``, seed 0, fp32). One batch: 8 random prompts of 16 tokens x 2 samples,
  32 new tokens, sampled with each injector on the exact engine and scored by the trainer's
  exact forward. ``stale`` k = 1: the rollout model is the weights before one AdamW step
  (lr 1e-6, a typical RL LR at this size) on a REINFORCE loss with seeded +-1 advantages on a
  first batch, the trainer the weights after it.

One torch thread; each arm's numbers are deterministic (seeded), so one run is the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from timlab.config import MismatchSection, resolve  # noqa: E402
from timlab.engines import SamplingParams  # noqa: E402
from timlab.injectors import build_injector  # noqa: E402
from timlab.metrics import all_metrics  # noqa: E402
from timlab.model.forward import token_logprobs  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402
from timlab.trainer.run import train  # noqa: E402

ARMS = {  # name -> mismatch settings
    "none": {"injector": "none"},
    "precision bf16": {"injector": "precision", "dtype": "bfloat16"},
    "weight_rounding int8": {"injector": "weight_rounding", "dtype": "int8"},
    "fp8 per_tensor": {"injector": "fp8", "scale_granularity": "per_tensor"},
    "fp8 per_channel": {"injector": "fp8", "scale_granularity": "per_channel"},
    "kv_cache bf16": {"injector": "kv_cache", "dtype": "bfloat16"},
    "kv_cache fp8": {"injector": "kv_cache", "dtype": "fp8"},
    "kv_cache fp8_e5m2": {"injector": "kv_cache", "dtype": "fp8_e5m2"},
    "stale 1": {"injector": "stale", "magnitude": 1},
    "stale 2": {"injector": "stale", "magnitude": 2},
    "stale 4": {"injector": "stale", "magnitude": 4},
}
QWEN_ARMS = [a for a in ARMS if a not in ("stale 2", "stale 4")]
FIRST_STEP = 5
"""Surge runs report the mean over steps FIRST_STEP..N (stale k <= 4 is at its full lag there)."""


def surge_arm(settings: dict, steps: int) -> dict:
    sets = [f"mismatch.{k}={v}" for k, v in settings.items()]
    cfg = resolve(preset="surge", overrides=[*sets, f"run.steps={steps}", f"run.eval_every={steps}",
                                             f"run.checkpoint_every={steps}", "run.progress=false",
                                             "run.distributions_every=0"])
    with tempfile.TemporaryDirectory() as tmp:
        cpu = time.process_time()
        train(cfg, Path(tmp) / "run")
        cpu = time.process_time() - cpu
        df = pd.read_parquet(Path(tmp) / "run" / "metrics.parquet").set_index("step").loc[FIRST_STEP:]
    return {"k3": float(df["rollout_corr/k3_kl"].mean()), "mean_abs_r": float(df["mismatch/abs_diff_mean"].mean()),
            "k3_first": float(df["rollout_corr/k3_kl"].iloc[0]), "k3_last": float(df["rollout_corr/k3_kl"].iloc[-1]),
            "cpu_s": cpu}


def qwen_model(folder: Path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                      max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    return load_model(folder, dtype="float32")


def _sample(inj, prompts):
    return inj.rollout(prompts, max_new_tokens=32, sampling=SamplingParams(), generator=torch.Generator().manual_seed(1))


def _measure(model, r) -> dict:
    lp, _ = token_logprobs(model, r.tokens, r.key_valid, mode="exact")
    m = all_metrics(lp.detach(), r.logprobs, r.response_mask.float())
    return {"k3": m["rollout_corr/k3_kl"], "mean_abs_r": m["mismatch/abs_diff_mean"]}


def qwen_arm(model, settings: dict, prompts) -> dict:
    sec = MismatchSection(**{"magnitude": 0.0, **settings})
    inj = build_injector(sec, model, eos_token_id=151645, pad_token_id=151643)
    cpu = time.process_time()
    inj.begin_step(1)
    if settings["injector"] == "stale":  # one update between the rollout's weights and the trainer's
        first = _sample(inj, prompts)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        adv = torch.randint(0, 2, (first.tokens.shape[0],), generator=torch.Generator().manual_seed(2)) * 2.0 - 1
        with torch.enable_grad():
            lp, _ = token_logprobs(model, first.tokens, first.key_valid, mode="exact")
            mask = first.response_mask.float()
            loss = -((lp * mask).sum(-1) * adv).sum() / mask.sum()
            loss.backward()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        opt.step()
        inj.refresh()
        inj.begin_step(2)
        out = _measure(model, _sample(inj, prompts))
        model.load_state_dict(saved)  # the next arm starts from the same weights
        model.zero_grad(set_to_none=True)
    else:
        out = _measure(model, _sample(inj, prompts))
    out["cpu_s"] = time.process_time() - cpu
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("surge", "qwen"), help="measure one model only")
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps per surge arm (default 20)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict = {}
    if args.only in (None, "surge"):
        results["surge"] = {}
        for name, settings in ARMS.items():
            results["surge"][name] = row = surge_arm(settings, args.steps)
            print(f"surge  {name:22s} k3 {row['k3']:.3e}  mean|r| {row['mean_abs_r']:.3e}  "
                  f"(k3 step {FIRST_STEP} {row['k3_first']:.2e}, step {args.steps} {row['k3_last']:.2e}; "
                  f"{row['cpu_s']:.0f} CPU-s)", flush=True)
    if args.only in (None, "qwen"):
        results["qwen"] = {}
        with tempfile.TemporaryDirectory() as tmp:
            model = qwen_model(Path(tmp) / "qwen3-width")
        g = torch.Generator().manual_seed(0)
        base = [torch.randint(0, 151643, (16,), generator=g).tolist() for _ in range(8)]  # no special tokens
        prompts = [p for p in base for _ in range(2)]
        for name in QWEN_ARMS:
            results["qwen"][name] = row = qwen_arm(model, ARMS[name], prompts)
            print(f"qwen   {name:22s} k3 {row['k3']:.3e}  mean|r| {row['mean_abs_r']:.3e}  ({row['cpu_s']:.0f} CPU-s)",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
