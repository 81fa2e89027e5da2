"""A randomized search for exactness failures of the ``exact`` engine.

The promise under test: the log-prob the exact engine records for every sampled response token
is bitwise equal (``torch.equal``) to the one the trainer's forward computes for it, with
autograd on, whatever the batch holds. A handful of hand-picked examples cannot back a claim
like that (bf16 rollouts once broke on a ragged batch no test had), so this module draws cases
from a seeded space and checks each one:

- architecture: every one ``timlab.model.llama.ARCHITECTURES`` supports, in folders written by
  ``transformers`` itself (random weights, the LM head scaled so the text is not uniform noise,
  and the EOS row set so rows stop at many different steps); a quarter of the tiny ones are
  Qwen3-MoE (4-16 experts, top 1-4, renormalized or not, every or every other layer sparse;
  transformers' small router init makes near-ties common), drawn after a dense arch's own
  draws so every dense case is the one it was before MoE existed;
- width: tiny (hidden 32-256, 1-4 layers, GQA ratios 1-4, head dims 8-128) or the per-layer
  shapes of Qwen3-0.6B, Qwen2.5-0.5B and Llama-3.2-1B at 2 layers (``REAL_WIDTHS``);
- dtype float32 / bfloat16 / float16; 1, 2 or 4 torch threads;
- batch 1-64 rows of ragged prompts (1-60 tokens), some sharing a prefix, some repeated (the
  engine's shared prefill); the finished-row compaction off, at the default or at a random level;
  up to 128 new tokens;
- sampling: greedy, temperature, top-k, top-p (the recorded log-prob is the model's, whatever
  the sampling distribution).

Each case is scored by the trainer three ways, all with autograd on: the whole (B, S) grid as
``timlab probe`` does, the realized columns with the rollout's buffer length and a score mask as
the RL step does, and a random subset of rows as a PPO mini-batch does. A case fails when any
response token of any of the three differs in any bit. ``case_command`` gives the one-line
command that repeats a case (``bench/exactness_fuzz.py`` is the command-line front end).

The CPU instruction set is fixed when torch loads, so a run covers one ISA; the front end runs a
second process with the ISA capped to AVX2 (``timlab.machine.PIN_ENV``).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from timlab.config import short_hash
from timlab.engines.base import SamplingParams
from timlab.engines.device_loop import DeviceLoop
from timlab.engines.native import ExactEngine
from timlab.errors import UsageError
from timlab.machine import PIN_ENV
from timlab.model.forward import token_logprobs
from timlab.model.llama import ARCHITECTURES

DENSE_ARCHITECTURES = ("llama", "qwen2", "qwen3")
MOE_FRAC = 0.25
"""Share of tiny architectures that are Qwen3-MoE."""

PAD, BOS, EOS = 0, 1, 2
"""Special token ids of every fuzz model (prompts use ids from 3 up)."""

DTYPES = ("float32", "bfloat16", "float16")
THREADS = (1, 2, 4)

REAL_WIDTHS = {
    "qwen3-0.6b": dict(model_type="qwen3", hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128,
                       vocab=151936, tie=True, rope_theta=1e6, context=40960),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden=896, intermediate=4864, heads=14, kv_heads=2, head_dim=64,
                         vocab=151936, tie=True, rope_theta=1e6, context=32768),
    "llama-3.2-1b": dict(model_type="llama", hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64,
                         vocab=128256, tie=True, rope_theta=5e5, context=131072,
                         rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                       ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))),
}
"""Per-layer shapes of three real models (2 layers each in the harness)."""


@dataclass(frozen=True)
class Arch:
    """A model folder's architecture and the knobs of its random weights (its cache key)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie: bool = False
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()
    context: int = 512
    """max_position_embeddings."""
    head_scale: float = 8.0
    """The LM head's weights are multiplied by this (sharper next-token distributions)."""
    eos_rate: float = 0.05
    """Target mean probability of EOS per step (rows stop after ~1/eos_rate tokens, spread widely)."""
    width: str = "tiny"
    """``tiny`` or a key of REAL_WIDTHS."""
    experts: int = 0
    """qwen3_moe: experts per sparse layer (0: dense)."""
    top_k: int = 0
    expert_intermediate: int = 0
    norm_topk: bool = False
    sparse_step: int = 1

    @property
    def key(self) -> str:
        d = asdict(self)
        if not self.experts:  # a dense arch keeps the key (and the weights) it had before MoE
            for name in ("experts", "top_k", "expert_intermediate", "norm_topk", "sparse_step"):
                d.pop(name)
        return short_hash(d, 16)


@dataclass(frozen=True)
class Case:
    """One exactness check: a model, a dtype, threads, a batch of prompts and sampling settings."""

    seed: int
    index: int
    arch: Arch
    dtype: str
    threads: int
    prompts: tuple = field(repr=False)
    max_new_tokens: int = 32
    compact_below: float = 0.75
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    sample_seed: int = 0

    def summary(self) -> str:
        a = self.arch
        lens = [len(p) for p in self.prompts]
        return (f"{a.model_type}/{a.width} h{a.hidden} L{a.layers} H{a.heads}/{a.kv_heads} d{a.head_dim} V{a.vocab} "
                f"{self.dtype} t{self.threads} B{len(self.prompts)} P{min(lens)}-{max(lens)} N{self.max_new_tokens} "
                f"compact {self.compact_below:.2f} T{self.temperature} k{self.top_k} p{self.top_p}")


def _tiny_arch(rng: random.Random) -> Arch:
    kv = rng.choice((1, 2, 4))
    heads = kv * rng.randint(1, 4)
    head_dim = rng.choice((8, 16, 24, 32, 64, 128))
    # transformers wants hidden divisible by the head count (head_dim is set on its own)
    hidden = heads * rng.choice([m for m in range(1, 257) if 32 <= heads * m <= 256])
    arch = Arch(
        model_type=rng.choice(DENSE_ARCHITECTURES), hidden=hidden, intermediate=rng.choice((2, 3, 4)) * hidden,
        layers=rng.randint(1, 4), heads=heads, kv_heads=kv, head_dim=head_dim,
        vocab=rng.choice((16, 32, 58, 100, 256, 512)), tie=rng.random() < 0.3,
        rope_theta=rng.choice((1e4, 1e6)), head_scale=rng.choice((1.0, 8.0, 30.0)),
        eos_rate=rng.choice((0.01, 0.03, 0.1, 0.2)),
    )
    if rng.random() < MOE_FRAC:  # drawn after the dense arch's draws, which stay as they were
        experts = rng.choice((4, 8, 16))
        arch = replace(arch, model_type="qwen3_moe", experts=experts, top_k=rng.randint(1, 4),
                       expert_intermediate=rng.choice((8, 16, 24, 48, 64)), norm_topk=rng.random() < 0.5,
                       sparse_step=rng.choice((1, 1, 2)))
    return arch


def _real_arch(rng: random.Random) -> Arch:
    name = rng.choice(sorted(REAL_WIDTHS))
    spec = dict(REAL_WIDTHS[name])
    return Arch(layers=2, width=name, head_scale=8.0, eos_rate=0.1, **spec)  # one folder per width (~1 GB)


ARCH_POOL = 32
"""Distinct architectures per seed (tiny ones; the real widths are three)."""


def draw_case(seed: int, index: int, *, real_width_frac: float = 0.02) -> Case:
    """Case ``index`` of the space seeded by ``seed`` (the same pair always gives the same case)."""
    rng = random.Random(f"timlab-exactness:{seed}:{index}")
    real = rng.random() < real_width_frac
    # the architectures come from a pool of ARCH_POOL per seed, so their folders are reused
    arch_rng = random.Random(f"timlab-exactness-arch:{seed}:{rng.randrange(ARCH_POOL)}")
    arch = _real_arch(arch_rng) if real else _tiny_arch(arch_rng)
    dtype = rng.choice(DTYPES)
    threads = rng.choice((1, 1, 1) + THREADS[1:])  # one thread most often: several are slow on a loaded machine
    # prompts: a few distinct ones, repeated (shared prefill), some sharing a common prefix
    max_rows = 4 if real else 64
    rows = min(max_rows, rng.choice((1, 2, 4, 7, 12, 20, 33, 64)))
    samples = rng.choice((1, 1, 2, 3, 4, 8))
    n_distinct = max(1, rows // samples)
    max_len = 30 if real else 60
    prefix = [rng.randrange(3, arch.vocab) for _ in range(rng.randint(1, max_len // 2))] if rng.random() < 0.3 else []
    distinct = []
    for _ in range(n_distinct):
        tail = [rng.randrange(3, arch.vocab) for _ in range(rng.randint(1, max_len - len(prefix)))]
        distinct.append(tuple(prefix + tail))
    prompts = tuple(p for p in distinct for _ in range(samples))[:max(rows, 1)]
    sampling = rng.choice(("plain", "plain", "greedy", "temperature", "top_k", "top_p", "all"))
    temperature = {"greedy": 0.0, "temperature": rng.choice((0.6, 1.3)), "all": rng.choice((0.7, 1.2))}.get(sampling, 1.0)
    top_k = rng.choice((1, 5, 20)) if sampling in ("top_k", "all") else 0
    top_p = rng.choice((0.5, 0.8, 0.95)) if sampling in ("top_p", "all") else 1.0
    return Case(
        seed=seed, index=index, arch=arch, dtype=dtype, threads=threads, prompts=prompts,
        max_new_tokens=rng.choice((4, 8, 16)) if real else rng.choice((1, 4, 16, 32, 64, 128)),
        compact_below=rng.choice((0.0, 0.75, round(rng.uniform(0.1, 0.99), 2))),
        temperature=temperature, top_k=top_k, top_p=top_p, sample_seed=rng.randrange(2**31),
    )


# ------------------------------------------------------------------------------ model folders
def _transformers():
    try:
        import transformers
    except ImportError:
        raise UsageError("the exactness harness writes its model folders with transformers: "
                         "pip install 'timlab[hf]'") from None
    return transformers


def _hf_config(arch: Arch):
    transformers = _transformers()
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3_moe": transformers.Qwen3MoeConfig}
    kwargs = dict(
        vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers, num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
        head_dim=arch.head_dim, max_position_embeddings=arch.context, rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )
    if arch.rope_scaling:
        kwargs["rope_scaling"] = dict(arch.rope_scaling)
    if arch.experts:
        kwargs.update(num_experts=arch.experts, num_experts_per_tok=arch.top_k,
                      moe_intermediate_size=arch.expert_intermediate, norm_topk_prob=arch.norm_topk,
                      decoder_sparse_step=arch.sparse_step, mlp_only_layers=[],
                      experts_implementation="eager")  # the grouped GEMM refuses odd widths
    return cls[arch.model_type](**kwargs)


def _eos_row(model, arch: Arch, gen: torch.Generator) -> None:
    """Set the LM head's EOS row so that EOS takes about ``arch.eos_rate`` of the mass on average.

    The row points along the mean final hidden state of random text; its length is found by
    bisection on those states' next-token distributions. Hidden states that point away make
    EOS rare, others make it likely: rows stop at widely different steps.
    """
    ids = torch.randint(3, arch.vocab, (8, 24), generator=gen)
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state.reshape(-1, arch.hidden)  # (N, hidden) after the final norm
        w = model.lm_head.weight
        u = h.mean(0)
        u = u / u.norm().clamp_min(1e-12)
        logits = h @ w.T  # (N, V)
        z = h @ u  # (N,)
        lo, hi = 0.0, 1.0
        def rate(a: float) -> float:
            lg = logits.clone()
            lg[:, EOS] = a * z
            return float(torch.softmax(lg, -1)[:, EOS].mean())
        while rate(hi) < arch.eos_rate and hi < 1e4:
            hi *= 2
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate(mid) < arch.eos_rate else (lo, mid)
        w[EOS] = hi * u


def model_folder(arch: Arch, cache_dir: str | Path) -> Path:
    """The folder of ``arch``'s random model, written by transformers into ``cache_dir`` once."""
    path = Path(cache_dir) / f"{arch.model_type}-{arch.width}-{arch.key}"
    if (path / "config.json").exists():
        return path
    transformers = _transformers()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    seed = int(arch.key[:8], 16)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}[arch.model_type]
    with torch.random.fork_rng():  # transformers initializes from the global generator
        torch.manual_seed(seed)
        model = cls(_hf_config(arch)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:  # not all ones: the norms' weights take part in the bits
                    p.add_(0.1 * torch.randn_like(p))
            model.lm_head.weight.mul_(arch.head_scale)
    _eos_row(model, arch, torch.Generator().manual_seed(seed))
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


# ------------------------------------------------------------------------------ one case
@dataclass
class CaseResult:
    """What one case found: tokens checked, tokens that differ per trainer form, the worst |r|."""

    case: Case
    tokens: int
    bad: dict
    max_abs_diff: float
    lengths: tuple
    seconds: float

    @property
    def ok(self) -> bool:
        return not any(self.bad.values())


def _compare(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> tuple[int, float]:
    a, b = logp.detach()[mask], rollout_logp[mask]
    return int((a != b).sum()), float((a - b).abs().max()) if a.numel() else 0.0


def run_case(case: Case, cache_dir: str | Path, *, backend: str = "auto", device: str = "cpu",
             loop: DeviceLoop | None = None) -> CaseResult:
    """Roll out ``case`` with the exact engine and compare with the trainer's three forwards.

    ``backend``: the exact path's kernels (``timlab.model.ops.KERNEL_BACKENDS``); ``triton`` runs
    the GPU kernels, on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``). ``device``:
    where the model runs (the sampler's generator too); ``loop``: the engine's ``device_loop``
    (None: the host loop).
    """
    from timlab.model.hf_io import load_model
    from timlab.model.ops import kernel_backend

    t0 = time.perf_counter()
    folder = model_folder(case.arch, cache_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads)
    with contextlib.ExitStack() as stack:
        stack.enter_context(kernel_backend(backend))
        stack.callback(torch.set_num_threads, threads)
        model = load_model(folder, dtype=case.dtype, device=device)
        engine = ExactEngine(model, eos_token_id=EOS, pad_token_id=PAD)
        engine.compact_below, engine.device_loop = case.compact_below, loop
        sampling = SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p)
        r = engine.generate([list(p) for p in case.prompts], max_new_tokens=case.max_new_tokens, sampling=sampling,
                            generator=torch.Generator(device=device).manual_seed(case.sample_seed))
        B, S = r.tokens.shape
        bad, worst = {}, 0.0
        with torch.enable_grad():
            # 1. the whole grid, as `timlab probe --score trainer`
            lp, _ = token_logprobs(model, r.tokens, r.key_valid, mode="exact")
            bad["grid"], d = _compare(lp, r.logprobs, r.response_mask)
            worst = max(worst, d)
            # 2. the realized columns with the rollout's buffer length and a score mask, as the RL step
            L = r.prompt_width + max(1, int(r.lengths.max()))
            mask = r.response_mask[:, :L]
            lp, _ = token_logprobs(model, r.tokens[:, :L], r.key_valid[:, :L], mode="exact", kv_len=S,
                                   score_mask=mask)
            bad["rl_step"], d = _compare(lp, r.logprobs[:, :L], mask)
            worst = max(worst, d)
            # 3. a random subset of rows, as a PPO mini-batch
            g = torch.Generator().manual_seed(case.sample_seed + 1)
            rows = torch.randperm(B, generator=g)[: 1 + int(torch.randint(B, (1,), generator=g))].sort().values
            lp, _ = token_logprobs(model, r.tokens[rows, :L], r.key_valid[rows, :L], mode="exact", kv_len=S,
                                   score_mask=mask[rows])
            bad["mini_batch"], d = _compare(lp, r.logprobs[rows, :L], mask[rows])
            worst = max(worst, d)
    return CaseResult(case=case, tokens=r.num_tokens, bad=bad, max_abs_diff=worst,
                      lengths=tuple(r.lengths.tolist()), seconds=time.perf_counter() - t0)


def case_command(seed: int, index: int, isa: str = "native", backend: str = "auto", extra: str = "") -> str:
    """The one-line command that repeats case ``index`` of seed ``seed`` (``extra``: more options)."""
    env = " ".join(f"{k}={v}" for k, v in PIN_ENV.items()) + " " if isa == "avx2" else ""
    tail = (f" --backend {backend}" if backend != "auto" else "") + (f" {extra}" if extra else "")
    return f"{env}python bench/exactness_fuzz.py --seed {seed} --case {index}{tail}"


def coverage(cases: list[Case]) -> dict:
    """How many of ``cases`` fall in each value of each axis (a set that misses one is visible)."""
    def count(values) -> dict:
        return dict(sorted(Counter(values).items(), key=lambda kv: str(kv[0])))

    return {
        "model_type": count(c.arch.model_type for c in cases),
        "width": count(c.arch.width for c in cases),
        "dtype": count(c.dtype for c in cases),
        "threads": count(c.threads for c in cases),
        "rows": count("1" if len(c.prompts) == 1 else "2-16" if len(c.prompts) <= 16 else "17-64" for c in cases),
        "shared_prefill": count(len(set(c.prompts)) < len(c.prompts) for c in cases),
        "compaction": count("off" if c.compact_below == 0 else "default" if c.compact_below == 0.75 else "random"
                            for c in cases),
        "sampling": count("greedy" if c.temperature == 0 else
                          "+".join(n for n, on in (("T", c.temperature != 1), ("top_k", c.top_k > 0),
                                                   ("top_p", c.top_p < 1)) if on) or "plain" for c in cases),
        "gqa_ratio": count(c.arch.heads // c.arch.kv_heads for c in cases),
        "max_new_tokens": count(c.max_new_tokens for c in cases),
    }


def log_ratio_histogram(results: list[CaseResult]) -> dict:
    """Cases per order of magnitude of their worst |r| (0 for exact cases)."""
    return dict(Counter("0" if r.max_abs_diff == 0 else f"1e{math.floor(math.log10(r.max_abs_diff))}"
                        for r in results))
