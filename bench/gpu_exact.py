"""Benchmark: the exact engine on a GPU at real model width, rollout log-probs vs the trainer's.

Writes a random Qwen3 folder with ``transformers`` (Qwen3-0.6B's config by default: hidden 1024,
28 layers, 16 / 8 heads, head_dim 128, vocabulary 151,936), loads it with timlab, samples ragged
prompts with each rollout engine, rescores the samples with the trainer's forward (autograd on,
as in an RL step) and prints, per engine and dtype: the share of response tokens whose log-probs
are bitwise equal, the largest |log pi - log mu|, and the rollout's tokens/s.

    python bench/gpu_exact.py --device cuda --json /tmp/gpu_exact.json
    python bench/gpu_exact.py --layers 2 --vocab 4096          # a quick look, any device
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.engines import SamplingParams, build_engine  # noqa: E402
from timlab.errors import UsageError  # noqa: E402
from timlab.kernels import check_device  # noqa: E402
from timlab.model.forward import token_logprobs  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_rollout import QWEN3_06B  # noqa: E402
from gpu_rollout import write_random_qwen3 as write_qwen3  # noqa: E402


def write_random_qwen3(path: Path, *, layers: int, vocab: int, seed: int = 0) -> Path:
    """A random Qwen3 folder with Qwen3-0.6B's widths, written by transformers itself."""
    return write_qwen3(path, {**QWEN3_06B, "num_hidden_layers": layers, "vocab_size": vocab}, seed)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compare(model, engine_name: str, prompts, *, new_tokens: int, device: str) -> dict:
    """One rollout, rescored by the trainer; the tokens/s of a second, timed rollout."""
    engine = build_engine(engine_name, model, eos_token_id=model.config.vocab_size, pad_token_id=0)

    def rollout():
        return engine.generate(prompts, max_new_tokens=new_tokens, sampling=SamplingParams(),
                               generator=torch.Generator(device=device).manual_seed(1))

    r = rollout()  # also the warm-up (Triton compiles here)
    sync(device)
    t0 = time.perf_counter()
    r2 = rollout()
    sync(device)
    seconds = time.perf_counter() - t0
    assert torch.equal(r.tokens, r2.tokens)  # the engine is deterministic for a fixed generator
    logp, _ = token_logprobs(model, r.tokens, r.key_valid, kv_len=r.tokens.shape[1])
    logp.sum().backward()
    model.zero_grad(set_to_none=True)
    mu, pi = r.logprobs[r.response_mask], logp.detach()[r.response_mask]
    diff = (pi.float() - mu.float()).abs()
    return {
        "engine": engine_name,
        "tokens": int(mu.numel()),
        "bitwise_equal_share": float((pi == mu).float().mean()),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "rollout_s": seconds,
        "tokens_per_s": r.num_tokens / seconds,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--batch", type=int, default=32, help="sequences per rollout")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--engines", default="exact,fast")
    ap.add_argument("--model", help="an HF folder to use instead of a random Qwen3")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    try:
        check_device(args.device)
    except UsageError as e:
        ap.exit(2, f"gpu_exact.py: error: {e}\n")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else write_random_qwen3(Path(tmp) / "qwen3", layers=args.layers, vocab=args.vocab)
        g = torch.Generator().manual_seed(0)
        rows = []
        for dtype in args.dtypes.split(","):
            model = load_model(folder, dtype=dtype, device=args.device)
            vocab = model.config.vocab_size
            prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
                       for n in torch.randint(8, 65, (args.batch,), generator=g)]
            for name in args.engines.split(","):
                row = {"dtype": dtype, **compare(model, name, prompts, new_tokens=args.new_tokens, device=args.device)}
                rows.append(row)
                print(f"{dtype:<9} {name:<6} tokens {row['tokens']:>6}  bitwise {row['bitwise_equal_share']:7.2%}  "
                      f"max|r| {row['max_abs_diff']:.3g}  mean|r| {row['mean_abs_diff']:.3g}  "
                      f"{row['tokens_per_s']:,.0f} tok/s", flush=True)
            n_params = sum(p.numel() for p in model.parameters())
            del model
    out = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "num_parameters": n_params,
        "layers": args.layers, "vocab": args.vocab, "batch": args.batch, "new_tokens": args.new_tokens,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
