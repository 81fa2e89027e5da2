"""Benchmark: how far vLLM's log-probs are from timlab's trainer forward, on one tiny model.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 \
        /tmp/vllm-venv/bin/python bench/vllm_vs_trainer.py [--json OUT] [--batch 64] [--new-tokens 48]

Needs vllm (vllm-cpu in its own venv: docs/vllm.md). Builds a tiny random Llama written by timlab
(hidden 128, 2 layers, 4 heads / 2 KV heads: head_dim 32, which vLLM's CPU attention supports;
46-token char vocab), rolls out ``--batch`` ragged prompts with the ``vllm`` engine (temperature 1,
no truncation, EOS on), and rescores the sampled tokens with the trainer's forward
(``token_logprobs(mode="exact")`` with autograd on, as in the RL step). Per dtype it reports
max / mean |r| (r = log pi - log mu), the share of bitwise-equal tokens and K3 KL. The ``fast``
engine (timlab's stock-kernel KV-cached engine) vs the same trainer, on its own rollout of the same
prompts, is the reference point. vLLM's tok/s is the median of 3 timed calls after a warm-up (one torch thread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import torch  # noqa: E402

from timlab.engines import build_engine  # noqa: E402
from timlab.metrics import all_metrics  # noqa: E402
from timlab.model.forward import token_logprobs  # noqa: E402
from timlab.model.llama import CausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import make_prompts, tiny_llama  # noqa: E402  (bench/engines.py: the same model and prompts)

def compare(model: CausalLM, r) -> dict:
    """r stats of the trainer's forward against the rollout's log mu, on the rollout's tokens."""
    with torch.enable_grad():
        logp, _ = token_logprobs(model, r.tokens, r.key_valid, mode="exact")  # (B, S) the RL step's log pi
    m = all_metrics(logp.detach(), r.logprobs, r.response_mask)
    return {"max_abs_diff": m["mismatch/max_abs_diff"], "mean_abs_diff": m["mismatch/abs_diff_mean"],
            "frac_bitwise_equal": m["mismatch/frac_bitwise_equal"], "k3_kl": m["rollout_corr/k3_kl"],
            "probs_diff_mean": m["mismatch/probs_diff_mean"], "num_tokens": int(m["mismatch/num_tokens"])}


def run(dtype: str, batch: int, new_tokens: int, repeats: int) -> dict:
    model = tiny_llama(dtype)
    prompts = make_prompts(batch, model.config.vocab_size)
    res = {"dtype": dtype}
    t0 = time.perf_counter()
    eng = build_engine("vllm", model, eos_token_id=2, pad_token_id=0)
    res["vllm_startup_s"] = time.perf_counter() - t0
    eng.generate(prompts, max_new_tokens=new_tokens, generator=torch.Generator().manual_seed(99))  # warm-up
    walls, r = [], None
    for i in range(repeats):
        t0 = time.perf_counter()
        r = eng.generate(prompts, max_new_tokens=new_tokens, generator=torch.Generator().manual_seed(i))
        walls.append(time.perf_counter() - t0)
        res.setdefault("tokens_per_call", []).append(r.num_tokens)
    res["vllm_tok_s"] = statistics.median(n / w for n, w in zip(res["tokens_per_call"], walls))
    t0 = time.perf_counter()
    eng.sync_weights()
    res["sync_weights_s"] = time.perf_counter() - t0
    res["vllm"] = compare(model, r)
    eng.close()
    fast = build_engine("fast", model, eos_token_id=2, pad_token_id=0)
    res["fast"] = compare(model, fast.generate(prompts, max_new_tokens=new_tokens,
                                               generator=torch.Generator().manual_seed(0)))
    return res


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import vllm

    results = [run(d, args.batch, args.new_tokens, args.repeats) for d in args.dtypes.split(",")]
    print(f"vllm {vllm.__version__}, torch {torch.__version__}; {args.batch} prompts x <= {args.new_tokens} tokens")
    print("| dtype | rollout (vs trainer) | tokens | max abs r | mean abs r | bitwise equal | K3 KL | mean abs(pi - mu) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for res in results:
        for engine in ("vllm", "fast"):
            row = res[engine]
            print(f"| {res['dtype']} | {engine} | {row['num_tokens']} | {row['max_abs_diff']:.3g} | "
                  f"{row['mean_abs_diff']:.3g} | {100 * row['frac_bitwise_equal']:.1f}% | {row['k3_kl']:.3g} | "
                  f"{row['probs_diff_mean']:.3g} |")
    for res in results:
        print(f"{res['dtype']}: vLLM start-up {res['vllm_startup_s']:.1f} s, {res['vllm_tok_s']:.0f} tok/s, "
              f"sync_weights {res['sync_weights_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"vllm": vllm.__version__, "args": vars(args), "results": results},
                                              indent=2))
    return results


if __name__ == "__main__":  # vLLM starts its workers with spawn: the guard is required
    main()
