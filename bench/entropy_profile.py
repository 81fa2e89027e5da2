"""The model's per-position next-token entropy along scratch_add's long answers (``task.kwargs.restate``).

    OMP_NUM_THREADS=1 python bench/entropy_profile.py MODEL:RESTATE [MODEL:RESTATE ...] \
        --out docs/img/long_answers_entropy.png [--n 64] [--show 4]

For each model (an SFT of ``bench/long_answers.py --save``, trained at ``restate``): teacher-forced
on the gold completions of the first ``--n`` validation prompts of the surge split
(``task.kwargs.scratch_frac=1.0``, ``task.n_val=512``), the entropy (nats) of the next-token
distribution at every answer token, EOS included. One panel per model: ``--show`` answers' profiles
against the response position, the restated operands shaded, and in the title the mean number of
"uncertain" tokens (entropy > 0.1 nats) per answer, in the restated part and in the worked part.
If the construction works, the restated part stays near 0 nats at any length and the uncertain
tokens sit in the worked part, about as many at T ~ 1,000 as at T ~ 30. Prints the numbers too.

``--top Q`` (default 0.02): also prints where an entropy cut at the top-Q quantile of all answer
tokens lands (the cut Study L1's hi/lo arms would use): the cut in nats and the share of the tokens
above it that are in the worked part, against the worked part's share of all tokens (a cut that
singles out the decisions puts far more than that share there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from long_answers import UNCERTAIN_NATS, teacher_forced_profile  # noqa: E402

from timlab.config import resolve  # noqa: E402
from timlab.model.hf_io import load_model  # noqa: E402
from timlab.tasks import build_task, make_splits  # noqa: E402
from timlab.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", metavar="MODEL:RESTATE")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--show", type=int, default=4)
    ap.add_argument("--top", type=float, default=0.02)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.models), 1, figsize=(10, 2.6 * len(args.models)), squeeze=False)
    for ax, spec in zip(axes[:, 0], args.models):
        path, _, restate = spec.rpartition(":")
        restate = int(restate)
        cfg = resolve(preset="surge", overrides=[f"task.kwargs.restate={restate}", "task.kwargs.scratch_frac=1.0",
                                                 "task.n_val=512"])
        task = build_task(cfg)
        _, val = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
        model, tok = load_model(path), load_tokenizer(path)
        prof = teacher_forced_profile(model, tok, task, val[: args.n], restate=restate)
        ent, n_rest = prof["entropy"], prof["restated"]
        unc_rest = sum(sum(h > UNCERTAIN_NATS for h in e[:k]) for e, k in zip(ent, n_rest)) / len(ent)
        unc_work = sum(sum(h > UNCERTAIN_NATS for h in e[k:]) for e, k in zip(ent, n_rest)) / len(ent)
        mean_T = sum(map(len, ent)) / len(ent)
        s = prof["summary"]
        print(f"restate {restate}: mean T {mean_T:.1f}; uncertain tokens per answer {unc_rest:.2f} restated + "
              f"{unc_work:.2f} worked; mean entropy restated {s.get('restated_entropy', 0):.4f}, worked "
              f"{s['worked_entropy']:.4f} nats; teacher-forced exact {s['tf_exact']:.3f} ({args.n} prompts)")
        flat = sorted((h, j >= k) for e, k in zip(ent, n_rest) for j, h in enumerate(e))  # (entropy, in worked part)
        top = flat[len(flat) - max(1, round(args.top * len(flat))):]
        worked_share = sum(w for _, w in flat) / len(flat)
        print(f"restate {restate}: top {args.top:.0%} of {len(flat)} answer tokens by entropy: cut {top[0][0]:.2e} nats, "
              f"{sum(w for _, w in top) / len(top):.2f} of them in the worked part (the worked part is "
              f"{worked_share:.3f} of all tokens)")
        for i in range(min(args.show, len(ent))):
            line, = ax.semilogy(range(len(ent[i])), [max(h, 1e-5) for h in ent[i]], lw=0.8)
            if n_rest[i]:
                ax.axvspan(0, n_rest[i] - 0.5, color=line.get_color(), alpha=0.06)
        ax.axhline(UNCERTAIN_NATS, color="grey", ls="--", lw=0.7)
        ax.set_ylim(1e-5, 5)
        ax.set_ylabel("entropy (nats)")
        ax.set_title(f"restate {restate} (mean T {mean_T:.0f}): uncertain tokens (> {UNCERTAIN_NATS} nats) per answer "
                     f"{unc_rest:.2f} restated + {unc_work:.2f} worked; teacher-forced exact {s['tf_exact']:.2f}",
                     fontsize=9)
    axes[-1, 0].set_xlabel("response position (tokens; the restated operands shaded, the worked answer after)")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
