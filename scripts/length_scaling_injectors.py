"""The noise-vs-bias length reading (timlab.metrics.length_scaling) on timlab's injectors.

    python scripts/length_scaling_injectors.py [PRESET]     # default: surge (~1 min on one core)

For each injector, 512 rollouts of the preset's SFT warm start (cached by `timlab pretrain` /
`timlab train`) with the injector on the rollout side, rescored by the trainer's forward; prints
the realized k3 and the one-line reading with the three exponents (docs/cli.md, "Noise or bias?").
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.config import resolve, rollout_sampling  # noqa: E402
from timlab.injectors import build_injector  # noqa: E402
from timlab.metrics import all_metrics, format_length_scaling, length_scaling  # noqa: E402
from timlab.model.forward import token_logprobs  # noqa: E402
from timlab.tasks import build_task, make_splits  # noqa: E402
from timlab.trainer.precision import load_policy  # noqa: E402
from timlab.trainer.pretrain import ensure_warm_start  # noqa: E402

INJECTORS = [("logit_noise", 0.3, []), ("logit_noise", 1.0, []), ("head_perturb", 0.5, []), ("head_perturb", 1.0, []),
             ("head_perturb", 2.0, []), ("precision", 0.0, ["mismatch.dtype=bfloat16"]),
             ("weight_rounding", 0.0, ["mismatch.dtype=int8"])]
BATCHES, BATCH = 4, 128


def responses(preset: str, injector: str, magnitude: float, extra: list[str]):
    """(log pi, log mu, mask) over the response columns of BATCHES x BATCH rollouts."""
    cfg = resolve(preset=preset, overrides=[f"mismatch.injector={injector}", f"mismatch.magnitude={magnitude}", *extra])
    train, _ = make_splits(build_task(cfg), seed=cfg.task.split_seed, n_train=BATCHES * BATCH, n_val=8)
    tok, precision = load_policy(ensure_warm_start(cfg).path, cfg, device=torch.device("cpu"))
    model = precision.compute
    inj = build_injector(cfg.mismatch, model, default_engine="exact", eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    parts = []
    for i in range(BATCHES):
        prompts = [tok.encode(train[j].prompt) for j in range(i * BATCH, (i + 1) * BATCH)]
        ro = inj.rollout(prompts, max_new_tokens=cfg.rollout.max_new_tokens, sampling=rollout_sampling(cfg), generator=gen)
        with torch.no_grad():
            lp, _ = token_logprobs(model, ro.tokens, ro.key_valid, mode="exact", kv_len=ro.tokens.shape[1],
                                   score_mask=ro.response_mask)
        P = ro.prompt_width
        parts.append((lp[:, P:], ro.logprobs[:, P:], ro.response_mask[:, P:]))  # (BATCH, max_new_tokens) each
    W = max(p[0].shape[1] for p in parts)
    return [torch.cat([torch.nn.functional.pad(p[k], (0, W - p[k].shape[1])) for p in parts]) for k in range(3)]


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "surge"
    for injector, magnitude, extra in INJECTORS:
        lp, lq, mask = responses(preset, injector, magnitude, extra)
        k3 = all_metrics(lp, lq, mask)["rollout_corr/k3_kl"]
        name = f"{injector} {magnitude:g}" + (f" ({', '.join(extra)})" if extra else "")
        print(f"{name}: k3 {k3:.3g}; {format_length_scaling(length_scaling(lp, lq, mask, seed=0))}", flush=True)


if __name__ == "__main__":
    main()
