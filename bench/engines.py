"""Benchmark: rollout throughput of the exact, fast and hf engines on one tiny model.

    OMP_NUM_THREADS=1 python bench/engines.py [--json OUT] [--batch 64] [--new-tokens 48]
                                              [--repeats 5] [--model DIR] [--dtype float32]
                                              [--device cuda]

Builds a tiny random Llama (about 0.5M parameters, a character vocabulary) or loads ``--model``,
draws one batch of ragged prompts, and times ``engine.generate`` for each engine with one torch
thread: one warm-up call each, then ``--repeats`` rounds (every engine once per round, in
rotating order, so background load hits all alike); the median is reported, wall and CPU time. EOS is
disabled (its id is set outside the vocabulary) so every engine generates exactly
batch x new-tokens tokens and does the same work. ``hf`` is timlab's hf engine (transformers
``generate`` with its KV cache, SDPA, plus the conversion to timlab's layout); ``hf_raw`` is the
bare ``generate`` call on the same HF model, to show what the wrapper costs. ``exact+loop`` and
``fast+loop`` are those engines with the device-side decode loop (``DeviceLoop()``).

Targets (the exact engine's cost of exactness): exact >= 0.8 x fast and exact >= hf. With
``--device cuda`` the exact engine runs the Triton kernels of ``timlab.kernels`` and the fast one
cuBLAS and SDPA; the GPU target is exact >= 1/1.3 x fast. Without CUDA or Triton that is a one-line
error. (No GPU run of this script has been made yet.)
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import torch  # noqa: E402

from timlab.engines import SamplingParams, build_engine  # noqa: E402
from timlab.engines.device_loop import DeviceLoop  # noqa: E402
from timlab.errors import UsageError  # noqa: E402
from timlab.kernels import check_device  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402
from timlab.model.llama import CausalLM, ModelConfig  # noqa: E402

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-=()"


def tiny_llama(dtype: str) -> CausalLM:
    """hidden 128, 2 layers, 4 heads / 2 KV heads, MLP 512, 46-token char vocab: ~0.5M params."""
    cfg = ModelConfig(
        vocab_size=4 + len(CHARS), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.refresh_rope()
    return model.to(getattr(torch, dtype)).eval()


def make_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Ragged prompts of 8-24 ordinary tokens (ids >= 4: no specials)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 25, (batch,), generator=g).tolist()
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def time_rounds(fns: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds per call. One warm-up call each, then ``repeats`` rounds in which every
    engine runs once (the order rotates each round), so load from other processes hits all alike."""
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:
            w0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", help="HF-format model folder (default: a built-in tiny Llama)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--engines", default="exact,fast,hf,hf_raw")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (needs a GPU and Triton)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        check_device(args.device)
    except UsageError as e:
        ap.exit(2, f"engines.py: error: {e}\n")

    model = load_model(args.model, dtype=args.dtype, device=args.device) if args.model else tiny_llama(args.dtype)
    model = model.to(args.device)
    model.refresh_rope()
    vocab = model.config.vocab_size
    no_eos = vocab  # an id outside the vocabulary: never sampled, so no row stops early
    prompts = make_prompts(args.batch, vocab)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    n_tokens = args.batch * args.new_tokens

    fns = {}
    for name in args.engines.split(","):
        base, _, loop = name.partition("+")
        engine = build_engine("hf" if name == "hf_raw" else base, model, eos_token_id=no_eos, pad_token_id=0)
        if loop:  # exact+loop, fast+loop: the device-side decode loop at its default settings
            engine.device_loop = DeviceLoop()
        if name == "hf_raw":
            fns[name] = _raw_hf_generate(engine, prompts, args.new_tokens)
        else:
            def fn(engine=engine):
                r = engine.generate(prompts, max_new_tokens=args.new_tokens, sampling=sampling,
                                    generator=torch.Generator(device=args.device).manual_seed(0))
                assert r.num_tokens == n_tokens, (r.num_tokens, n_tokens)
            fns[name] = fn
    results, cpu = time_rounds(fns, args.repeats)

    tps = {k: n_tokens / statistics.median(v) for k, v in results.items()}
    ratios = {}
    if "exact" in tps and "fast" in tps:
        ratios["exact/fast"] = tps["exact"] / tps["fast"]
    if "exact" in tps and "hf" in tps:
        ratios["exact/hf"] = tps["exact"] / tps["hf"]
    out = {
        "model": args.model or "builtin tiny llama",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "device": args.device,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "tokens_per_s": tps,
        "cpu_tokens_per_s": {k: n_tokens / statistics.median(v) for k, v in cpu.items()},
        "seconds": {k: sorted(v) for k, v in results.items()},
        "ratios": ratios,
        "targets_met": {"exact>=0.8*fast": ratios.get("exact/fast", 0) >= 0.8,
                        "exact>=hf": ratios.get("exact/hf", 0) >= 1.0},
    }
    print(f"{out['num_parameters']:,} params, {args.dtype}, batch {args.batch} x {args.new_tokens} new tokens, "
          f"1 thread, median of {args.repeats}")
    print(f"{'engine':<10} {'tok/s':>10} {'median s':>10} {'cpu tok/s':>10}")
    for k, v in tps.items():
        print(f"{k:<10} {v:>10.0f} {statistics.median(results[k]):>10.4f} {out['cpu_tokens_per_s'][k]:>10.0f}")
    for k, v in ratios.items():
        print(f"{k:<10} {v:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def _raw_hf_generate(engine, prompts, new_tokens):
    """transformers' own generate on the engine's HF copy: no timlab layout conversion."""
    tokens, key_valid, P = engine.pack(prompts, new_tokens)
    config = engine._generation_config(SamplingParams(), new_tokens)
    config.output_logits = config.output_scores = config.return_dict_in_generate = False

    def fn():
        torch.manual_seed(0)
        with torch.no_grad():
            out = engine.hf_model.generate(input_ids=tokens[:, :P], attention_mask=key_valid[:, :P].long(),
                                           generation_config=config)
        assert out.shape[1] == P + new_tokens

    return fn


if __name__ == "__main__":
    main()
