"""Benchmark: rollout speed at Qwen3-0.6B's widths, exact vs fast vs HF generate, each against the bandwidth roofline.

Writes a random Qwen3 folder with ``transformers`` (Qwen3-0.6B's config: hidden 1024, 28 layers,
16 / 8 heads, head_dim 128, vocabulary 151,936, tied embeddings), loads it in bf16 and, for each
batch size, times rollouts of ``--new-tokens`` tokens per row from ragged prompts of 16-64 tokens
with EOS disabled (every row generates them all), for each variant:

- ``exact``, ``fast``: the engines with the host decode loop (``Engine._generate``);
- ``exact+loop``, ``fast+loop``: with ``DeviceLoop(sync_every=K)`` (``timlab.engines.device_loop``);
- ``exact+graphs``, ``fast+graphs``: the same with the decode step replayed as CUDA graphs;
- ``hf``: timlab's hf engine (transformers ``generate``, SDPA, its KV cache).

The roofline: a decode step reads at least every weight once (the embedding table only as the
tied LM head) and the KV cache it attends over once: the whole S-long buffer for the exact path,
the keys written so far for the others (their mean over the steps). Its time is those bytes over
the device's bandwidth, measured here with a large device-to-device copy (read + write), or given
with ``--bandwidth``. Each variant's row shows tok/s, ms per new token (prefill included), the
roofline's tok/s and the share of it reached; then the ratios exact/fast, exact/hf and the device
loop's gain. For each exact variant the first timed rollout is rescored by the trainer's forward
and the share of bitwise-equal log-probs printed (it must be 100%).

    python bench/gpu_rollout.py --device cuda --json /tmp/gpu_rollout.json   # batch 32, 128, 256
    python bench/gpu_rollout.py --tiny                                      # a CPU smoke run, seconds

``--tiny`` uses a 2-layer model of hidden 64 and vocabulary 512, batches 4 and 8, 8 new tokens:
it checks that the script runs; its numbers are not GPU numbers. On a device other than CUDA the
``+graphs`` variants run their static-buffer step eagerly (nothing is captured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import torch  # noqa: E402

from timlab.engines import SamplingParams, build_engine  # noqa: E402
from timlab.engines.device_loop import DeviceLoop  # noqa: E402
from timlab.errors import UsageError  # noqa: E402
from timlab.kernels import check_device  # noqa: E402
from timlab.model.forward import token_logprobs  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151_936)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)
VARIANTS = ("exact", "exact+loop", "exact+graphs", "fast", "fast+loop", "fast+graphs", "hf")


def write_random_qwen3(path: Path, widths: dict, seed: int = 0) -> Path:
    """A random Qwen3 folder of the given widths, written by transformers itself."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "qwen3", max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **widths)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_bandwidth(device: str, mib: int) -> float:
    """Bytes/s of a device-to-device copy of ``mib`` MiB, counting the read and the write."""
    x = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    n, t0 = 10, time.perf_counter()
    for _ in range(n):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * n / (time.perf_counter() - t0)


def step_bytes(model, variant: str, batch: int, prompt_width: int, new_tokens: int, buffer_len: int) -> float:
    """What one decode step must read at least: the weights once and the KV cache it attends over once."""
    cfg = model.config
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # a tied head counted once
    weights = sum(p.numel() * p.element_size() for p in params)
    if not cfg.tie_word_embeddings:  # the embedding table is only gathered from
        weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    keys = buffer_len if variant.startswith("exact") else prompt_width + (new_tokens + 1) / 2
    kv = batch * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.dim_per_head * keys * model.dtype.itemsize
    return weights + kv


def build(model, variant: str, sync_every: int):
    name, _, loop = variant.partition("+")
    engine = build_engine(name, model, eos_token_id=model.config.vocab_size, pad_token_id=0)  # EOS never sampled
    if loop:
        engine.device_loop = DeviceLoop(sync_every=sync_every, cuda_graphs=loop == "graphs")
    return engine


def time_variant(model, variant: str, prompts, *, new_tokens: int, repeats: int, sync_every: int, device: str) -> dict:
    """One warm-up rollout (Triton compiles, graphs are captured), then ``repeats`` timed ones (median)."""
    engine = build(model, variant, sync_every)

    def rollout():
        return engine.generate(prompts, max_new_tokens=new_tokens, sampling=SamplingParams(),
                               generator=torch.Generator(device=device).manual_seed(1))

    rollout()
    seconds, r = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        r = rollout()
        sync(device)
        seconds.append(time.perf_counter() - t0)
    s = statistics.median(seconds)
    row = {"variant": variant, "tokens": r.num_tokens, "rollout_s": s, "tokens_per_s": r.num_tokens / s,
           "ms_per_step": 1e3 * s / new_tokens, "buffer_len": r.tokens.shape[1], "prompt_width": r.prompt_width}
    if variant.startswith("exact"):
        logp, _ = token_logprobs(model, r.tokens, r.key_valid, kv_len=r.tokens.shape[1])
        m = r.response_mask
        row["bitwise_equal_share"] = float((logp[m] == r.logprobs[m]).float().mean())
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda (default), or cpu with --tiny")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and tiny batches: a smoke run (CPU by default)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 32,128,256; --tiny 4,8)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (default 128; --tiny 8)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--sync-every", type=int, default=DeviceLoop.sync_every, help="the device loop's host-read interval")
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts per variant (the median is reported)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bandwidth", type=float, default=None, help="device bandwidth in GB/s (default: measured)")
    ap.add_argument("--model", help="an HF folder to use instead of a random Qwen3")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.tiny else "cuda")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; valid choices: {', '.join(VARIANTS)}")
    try:
        check_device(device)
        DeviceLoop(sync_every=args.sync_every)
    except UsageError as e:
        ap.exit(2, f"gpu_rollout.py: error: {e}\n")
    batches = [int(b) for b in (args.batches or ("4,8" if args.tiny else "32,128,256")).split(",")]
    new_tokens = args.new_tokens or (8 if args.tiny else 128)
    bandwidth = 1e9 * args.bandwidth if args.bandwidth else measure_bandwidth(device, 64 if args.tiny else 1024)
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"{device_name}, torch {torch.__version__}, bandwidth {bandwidth / 1e9:,.0f} GB/s "
          f"({'given' if args.bandwidth else 'measured'}), {args.dtype}, {new_tokens} new tokens, "
          f"sync every {args.sync_every}", flush=True)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else write_random_qwen3(Path(tmp) / "qwen3", TINY if args.tiny else QWEN3_06B)
        model = load_model(folder, dtype=args.dtype, device=device)
        g = torch.Generator().manual_seed(0)
        lo, hi = (4, 12) if args.tiny else (16, 64)
        for batch in batches:
            prompts = [torch.randint(3, model.config.vocab_size, (int(n),), generator=g).tolist()
                       for n in torch.randint(lo, hi + 1, (batch,), generator=g)]
            for variant in variants:
                row = {"batch": batch, **time_variant(model, variant, prompts, new_tokens=new_tokens,
                                                      repeats=args.repeats, sync_every=args.sync_every, device=device)}
                b = step_bytes(model, variant, batch, row["prompt_width"], new_tokens, row["buffer_len"])
                row["roofline_tokens_per_s"] = batch * bandwidth / b
                row["roofline_share"] = row["tokens_per_s"] / row["roofline_tokens_per_s"]
                rows.append(row)
                bitwise = f"  bitwise {row['bitwise_equal_share']:.2%}" if "bitwise_equal_share" in row else ""
                print(f"B {batch:>4} {variant:<13} {row['tokens_per_s']:>10,.0f} tok/s {row['ms_per_step']:>8.2f} ms/step"
                      f"  roofline {row['roofline_tokens_per_s']:>10,.0f} tok/s ({row['roofline_share']:6.1%}){bitwise}",
                      flush=True)
            by = {r["variant"]: r["tokens_per_s"] for r in rows if r["batch"] == batch}
            ratios = [(f"{a}/{b}", by[a] / by[b]) for a, b in (
                ("exact", "fast"), ("exact", "hf"), ("exact+graphs", "fast+graphs"), ("exact+graphs", "hf"),
                ("exact+loop", "exact"), ("exact+graphs", "exact"), ("fast+graphs", "fast")) if a in by and b in by]
            print(f"B {batch:>4} ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios), flush=True)
        n_params = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    out = {"device": device, "device_name": device_name, "torch": torch.__version__, "dtype": args.dtype,
           "tiny": args.tiny, "num_parameters": n_params, "new_tokens": new_tokens, "sync_every": args.sync_every,
           "bandwidth_bytes_per_s": bandwidth, "bandwidth_measured": not args.bandwidth, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
