"""Write ``timlab/data/sample_logprobs.jsonl``: real rollout vs trainer log-probs for ``timlab analyze``.

What it does (one thread, ~5 s on a CPU):
- builds a tiny Llama (hidden 32, 2 layers, char vocabulary of the ``reverse`` task) with seeded
  random weights, as ``tests/test_probe.py`` does;
- for each of 4 "steps": draws 8 ``reverse`` prompts, samples 2 responses each with the ``fast``
  engine (stock KV-cached kernels: log mu), scores the same tokens with the trainer's forward
  (``token_logprobs(mode="exact")`` with autograd on: log pi), and records the task's dense reward
  (``positional_match``) of each response;
- between steps, perturbs every weight by 1% Gaussian noise: a stand-in for an optimizer update so
  the steps are different policies (the rollout and the trainer always share the same weights,
  so the mismatch is numeric TIM only, never off-policy drift).

The log-probs are float32 tensors; each is written with the shortest decimal that reads back as
the same float32 (``str(np.float32(x))``), which keeps the file small and keeps equal values equal.
With a random-weight model the responses are gibberish: the file exercises the schema and the
metrics, not a task.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/make_sample_logprobs.py [--out PATH] [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import numpy as np  # noqa: E402
import torch  # noqa: E402

from timlab.engines import SamplingParams, build_engine  # noqa: E402
from timlab.experiments.diagnostics.analyze import write_rows  # noqa: E402
from timlab.model.forward import token_logprobs  # noqa: E402
from timlab.model.llama import CausalLM, ModelConfig, random_init_  # noqa: E402
from timlab.tasks import get_task  # noqa: E402
from timlab.tokenizer import build_char_tokenizer  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "timlab" / "data" / "sample_logprobs.jsonl"


def tiny_model(vocab_size: int, *, seed: int, dtype: torch.dtype) -> CausalLM:
    cfg = ModelConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    g = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    random_init_(model, g)
    return model.to(dtype)


def perturb(model: CausalLM, g: torch.Generator, scale: float = 0.01) -> None:
    """A stand-in for an optimizer update: w += scale * |w|-sized Gaussian noise."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g).to(p.dtype))


def f32(values: list[float]) -> list[float]:
    """Shortest decimal that reads back as the same float32."""
    return [float(str(np.float32(v))) for v in values]


def make_rows(*, steps: int = 4, prompts_per_step: int = 8, samples: int = 2, max_new_tokens: int = 24,
              dtype: str = "float32", seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    task = get_task("reverse", min_len=3, max_len=10)
    tok = build_char_tokenizer(task.alphabet)
    eos = tok.token_to_id("<eos>")
    model = tiny_model(tok.get_vocab_size(), seed=seed, dtype=getattr(torch, dtype))
    engine = build_engine("fast", model, eos_token_id=eos, pad_token_id=tok.token_to_id("<pad>"))
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = []
    for step in range(1, steps + 1):
        examples = [ex for ex in task.sample(rng, prompts_per_step) for _ in range(samples)]
        prompts = [tok.encode(ex.prompt).ids for ex in examples]
        r = engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=SamplingParams(), generator=g)
        with torch.enable_grad():  # the real training forward, as in the RL step
            logp, _ = token_logprobs(model, r.tokens, r.key_valid, mode="exact")
        logp = logp.detach().float()  # (B, S)
        for b, ex in enumerate(examples):
            m = r.response_mask[b]  # (S,) response tokens, EOS included
            response_ids = r.tokens[b][m].tolist()
            text = tok.decode([t for t in response_ids if t != eos])
            rows.append({
                "id": f"s{step}-{b:02d}",
                "step": step,
                "prompt": ex.prompt,
                "response": text,
                "tokens": response_ids,
                "trainer_logprobs": f32(logp[b][m].tolist()),
                "rollout_logprobs": f32(r.logprobs[b][m].tolist()),
                "reward": round(task.reward(ex, text, dense=True), 6),
            })
        perturb(model, g)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = make_rows(dtype=args.dtype, seed=args.seed)
    write_rows(rows, args.out)
    n_tok = sum(len(r["tokens"]) for r in rows)
    print(f"wrote {args.out}: {len(rows)} sequences, {n_tok} response tokens, {Path(args.out).stat().st_size} bytes")


if __name__ == "__main__":
    main()
