"""Benchmark: RL steps/s and generated tokens/s of timlab's training step, and the FLOP rate it reaches.

    OMP_NUM_THREADS=1 python bench/steps.py [--json OUT] [--settings smoke,demo,default,long]
                                            [--steps 8] [--compare] [--width] [--width-threads 1,2]

For each setting a fresh ``RLRun`` (temporary run directory, SFT warm start built and cached on
first use, so set ``TIMLAB_CACHE``) runs ``--steps`` calls of ``train_step()`` with one torch
thread; the first is dropped (warm-up). Each call is timed in wall and CPU time
(``time.process_time``); steps/s = 1 / median step time, tokens/s = generated response tokens
(EOS included) over the kept steps / their total time. Validation, checkpoints and metric files
are outside ``train_step`` and not timed.

Settings (the project's presets, run as configured; the engine is the exact one):

- ``smoke``: 45k parameters, 16 sequences, <= 10 new tokens;
- ``demo``: 0.15M parameters, 128 sequences, <= 24 new tokens (answers of 3-14 characters);
- ``default``: 0.80M parameters, 128 sequences, <= 40 new tokens (answers of 4-24 characters);
- ``long``: the ``default`` warm start asked for its longest answers only (16-24 characters,
  ``task.kwargs.min_len=16``), the longest responses a preset produces.

FLOP rate: a second fresh run of the same setting replays the same steps (RL runs are
deterministic given the seed, so it does the same work) under ``torch.utils.flop_counter``,
which counts the matmul FLOPs actually executed (padding rows included; elementwise ops not
counted). Achieved rate = those FLOPs of the kept steps / their measured time. The machine's
fp32 GEMM peak is measured in the same process: the best of several 1024^3 and 2048^3
``torch.mm`` calls on one thread, in wall time and in CPU time; each fraction divides like by like.

``--compare``: per setting, two fresh runs in this process stepping alternately, one as the code
is and one with the two work-skipping features off (``ExactEngine.share_prefill`` and the
trainer's position skipping, ``forward.MIN_SKIP_MACS``): their speed-up, measured under the same
background load.

``--width``: a random Qwen3-0.6B-width model (hidden 1024, MLP 3072, 16 heads / 8 KV heads,
head_dim 128, 2 layers, vocabulary cut to 4096) built by timlab: an exact-engine rollout
(32 prompts x 16 new tokens) plus the trainer's forward and backward, timed for each thread count
in ``--width-threads`` (interleaved, 3 rounds, median), and checked bitwise across thread counts.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import timlab.model.forward as forward  # noqa: E402
from timlab.files import write_json  # noqa: E402
from timlab.config import resolve  # noqa: E402
from timlab.engines import SamplingParams, build_engine  # noqa: E402
from timlab.engines.native import ExactEngine  # noqa: E402
from timlab.model.forward import token_logprobs  # noqa: E402
from timlab.model.llama import CausalLM, ModelConfig  # noqa: E402
from timlab.trainer.pretrain import pretrain  # noqa: E402
from timlab.trainer.run import RLRun  # noqa: E402

SETTINGS = ("smoke", "demo", "default", "long")


def setting_config(name: str, steps: int):
    """The Config of one benchmark setting (see the module docstring)."""
    common = [f"run.steps={steps}", "run.progress=false"]
    if name == "long":
        warm = pretrain(resolve(preset="default")).path
        return resolve(preset="default", overrides=common + [f"model.path={warm}", "task.kwargs.min_len=16"])
    return resolve(preset=name, overrides=common)


def gemm_peak(threads: int = 1, repeats: int = 5) -> tuple[float, float]:
    """Best fp32 torch.mm rate (FLOP/s) over square sizes 1024 and 2048 on ``threads`` threads,
    in wall time and in CPU time (the CPU-time figure is the one other jobs cannot depress)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wall = cpu = 0.0
        for n in (1024, 2048):
            a, b = torch.randn(n, n), torch.randn(n, n)
            torch.mm(a, b)
            for _ in range(repeats):
                t, c = time.perf_counter(), time.process_time()
                torch.mm(a, b)
                wall = max(wall, 2 * n**3 / (time.perf_counter() - t))
                cpu = max(cpu, 2 * n**3 / max(time.process_time() - c, 1e-9))
        return wall, cpu
    finally:
        torch.set_num_threads(old)


def time_steps(cfg, steps: int) -> dict:
    """Wall and CPU seconds and generated tokens of each train_step after the first."""
    with tempfile.TemporaryDirectory(prefix="timlab-steps-") as d:
        run = RLRun(cfg, Path(d) / "run")
        wall, cpu, tokens = [], [], []
        try:
            for i in range(steps):
                w0, c0 = time.perf_counter(), time.process_time()
                out = run.train_step()
                w, c = time.perf_counter() - w0, time.process_time() - c0
                if i > 0:
                    wall.append(w)
                    cpu.append(c)
                    tokens.append(out.metrics["train/response_length_mean"] * cfg.rollout.prompts_per_step
                                  * cfg.rollout.samples_per_prompt)
        finally:
            run.close()
    return {"wall": wall, "cpu": cpu, "tokens": tokens}


def count_flops(cfg, steps: int) -> float:
    """Matmul FLOPs executed by train_steps 2..steps of a fresh run (the first is the warm-up)."""
    with tempfile.TemporaryDirectory(prefix="timlab-flops-") as d:
        run = RLRun(cfg, Path(d) / "run")
        try:
            run.train_step()
            counter = FlopCounterMode(display=False)
            with counter:
                for _ in range(steps - 1):
                    run.train_step()
        finally:
            run.close()
    return float(counter.get_total_flops())


def bench_setting(name: str, steps: int, peak: tuple[float, float]) -> dict:
    cfg = setting_config(name, steps)
    t = time_steps(cfg, steps)
    flops = count_flops(cfg, steps)
    n_tok = sum(t["tokens"])
    out = {
        "setting": name,
        "sequences_per_step": cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "task_kwargs": cfg.task.kwargs,
        "kept_steps": len(t["wall"]),
        "steps_per_s": 1.0 / statistics.median(t["wall"]),
        "cpu_steps_per_s": 1.0 / statistics.median(t["cpu"]),
        "tokens_per_s": n_tok / sum(t["wall"]),
        "cpu_tokens_per_s": n_tok / sum(t["cpu"]),
        "mean_response_length": n_tok / len(t["tokens"]) / (cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt),
        "matmul_flops_per_step": flops / len(t["wall"]),
        "achieved_flop_per_s": flops / sum(t["wall"]),
        "cpu_achieved_flop_per_s": flops / sum(t["cpu"]),
        "seconds": t["wall"],
    }
    out["peak_fraction"] = out["achieved_flop_per_s"] / peak[0]
    out["cpu_peak_fraction"] = out["cpu_achieved_flop_per_s"] / peak[1]
    return out


def compare_skipping(name: str, steps: int) -> dict:
    """Median step time with and without the shared prefill and the trainer's position skipping,
    two runs of the same setting stepping alternately (the first step of each dropped)."""
    cfg = setting_config(name, steps)
    on = forward.MIN_SKIP_MACS, True
    off = 1 << 62, False
    t = {"on": {"wall": [], "cpu": []}, "off": {"wall": [], "cpu": []}}
    with tempfile.TemporaryDirectory(prefix="timlab-compare-") as d:
        runs = {k: RLRun(cfg, Path(d) / k) for k in t}
        try:
            for i in range(steps):
                for k in ("on", "off") if i % 2 else ("off", "on"):
                    forward.MIN_SKIP_MACS, ExactEngine.share_prefill = on if k == "on" else off
                    w0, c0 = time.perf_counter(), time.process_time()
                    runs[k].train_step()
                    if i > 0:
                        t[k]["wall"].append(time.perf_counter() - w0)
                        t[k]["cpu"].append(time.process_time() - c0)
        finally:
            forward.MIN_SKIP_MACS, ExactEngine.share_prefill = on
            for r in runs.values():
                r.close()
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in t.items()}
    return {"median_s": med, "speedup": med["off"]["wall"] / med["on"]["wall"],
            "cpu_speedup": med["off"]["cpu"] / med["on"]["cpu"]}


# ----------------------------------------------------------------------------- real width
def real_width_model(seed: int = 0) -> CausalLM:
    """Qwen3-0.6B's widths, 2 layers, vocabulary 4096, random weights (std 0.02, norms 1)."""
    cfg = ModelConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, model_type="qwen3",
        rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    model.refresh_rope()
    return model


def bench_width(threads: list[int], rounds: int = 3, batch: int = 32, new_tokens: int = 16) -> dict:
    """Exact rollout + trainer forward/backward at real width per thread count; bitwise check."""
    model = real_width_model()
    engine = build_engine("exact", model, eos_token_id=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 4096, (int(n),), generator=g).tolist() for n in torch.randint(8, 25, (batch,), generator=g)]
    times: dict[int, dict[str, list[float]]] = {t: {"rollout": [], "trainer": [], "cpu": []} for t in threads}
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    old = torch.get_num_threads()
    try:
        for r in range(rounds + 1):  # round 0 is the warm-up
            for t in threads:
                torch.set_num_threads(t)
                w0, c0 = time.perf_counter(), time.process_time()
                ro = engine.generate(prompts, max_new_tokens=new_tokens, sampling=SamplingParams(),
                                     generator=torch.Generator().manual_seed(1))
                w1 = time.perf_counter()
                logp, _ = token_logprobs(model, ro.tokens, ro.key_valid, kv_len=ro.tokens.shape[1])
                (logp * ro.response_mask).sum().backward()
                model.zero_grad(set_to_none=True)
                w2, c2 = time.perf_counter(), time.process_time()
                if r > 0:
                    times[t]["rollout"].append(w1 - w0)
                    times[t]["trainer"].append(w2 - w1)
                    times[t]["cpu"].append(c2 - c0)
                results[t] = (ro.logprobs[ro.response_mask], logp.detach()[ro.response_mask])
    finally:
        torch.set_num_threads(old)
    ref_mu, _ = results[threads[0]]
    out = {"threads": threads, "batch": batch, "new_tokens": new_tokens,
           "num_parameters": sum(p.numel() for p in model.parameters()), "per_threads": {}}
    for t in threads:
        mu, pi = results[t]
        out["per_threads"][t] = {
            "rollout_s": statistics.median(times[t]["rollout"]),
            "trainer_s": statistics.median(times[t]["trainer"]),
            "cpu_s": statistics.median(times[t]["cpu"]),
            "rollout_equals_trainer": bool(torch.equal(mu, pi)),
            "rollout_equals_first_thread_count": bool(torch.equal(mu, ref_mu)),
        }
    base = out["per_threads"][threads[0]]
    for t in threads:
        p = out["per_threads"][t]
        p["speedup"] = (base["rollout_s"] + base["trainer_s"]) / (p["rollout_s"] + p["trainer_s"])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {', '.join(SETTINGS)}")
    ap.add_argument("--steps", type=int, default=8, help="train_step calls per setting (the first is dropped)")
    ap.add_argument("--compare", action="store_true", help="also time each setting with the work skipping off")
    ap.add_argument("--width", action="store_true", help="also time a real-width model per thread count")
    ap.add_argument("--width-threads", default="1,2", help="thread counts for --width")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown setting {unknown[0]!r}; valid choices: {', '.join(SETTINGS)}")

    peak = gemm_peak()
    out = {"torch": torch.__version__, "threads": 1, "fp32_gemm_peak_flop_per_s": peak[0],
           "cpu_fp32_gemm_peak_flop_per_s": peak[1], "load_average": os.getloadavg(), "settings": {}}
    print(f"fp32 GEMM peak (1 thread): {peak[0] / 1e9:.1f} GFLOP/s wall, {peak[1] / 1e9:.1f} CPU time; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'setting':<8} {'steps/s':>8} {'cpu st/s':>9} {'tok/s':>8} {'cpu tok/s':>10} {'mean len':>9} "
          f"{'MFLOP/step':>11} {'% peak':>7} {'cpu % peak':>10}")
    for name in names:
        r = bench_setting(name, args.steps, peak)
        out["settings"][name] = r
        print(f"{name:<8} {r['steps_per_s']:>8.2f} {r['cpu_steps_per_s']:>9.2f} {r['tokens_per_s']:>8.0f} "
              f"{r['cpu_tokens_per_s']:>10.0f} {r['mean_response_length']:>9.2f} {r['matmul_flops_per_step'] / 1e6:>11.1f} "
              f"{100 * r['peak_fraction']:>6.2f}% {100 * r['cpu_peak_fraction']:>9.2f}%", flush=True)
    if args.compare:
        for name in names:
            c = compare_skipping(name, args.steps)
            out["settings"][name]["compare_skipping"] = c
            print(f"{name}: skipping on vs off, median step {c['median_s']['on']['wall']:.3f} vs "
                  f"{c['median_s']['off']['wall']:.3f} s: {c['speedup']:.2f}x wall, {c['cpu_speedup']:.2f}x CPU", flush=True)
    if args.width:
        threads = [int(t) for t in args.width_threads.split(",")]
        w = bench_width(threads)
        out["width"] = w
        for t, p in w["per_threads"].items():
            print(f"real width, {t} thread(s): rollout {p['rollout_s']:.2f} s, trainer fwd+bwd {p['trainer_s']:.2f} s, "
                  f"CPU {p['cpu_s']:.2f} s, speed-up {p['speedup']:.2f}x, rollout == trainer: "
                  f"{p['rollout_equals_trainer']}, == {threads[0]} thread(s): {p['rollout_equals_first_thread_count']}")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
