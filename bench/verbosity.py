"""Benchmark: worked-answer length of ``scratch_add`` at each ``task.kwargs.verbosity`` level.

    python bench/verbosity.py [--max-digits 4] [--n 100000]

For each level, ``--n`` examples drawn as the task draws them (seed 0, 1..max-digits-digit
operands), each with its worked answer (``scratch_frac`` 1): the mean, median and max length in
tokens (characters + EOS, the char tokenizer's count), and the task's bound ``max_answer_chars``.
The sums are the same at every level (the same seed gives the same examples).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from timlab.tasks import TASKS  # noqa: E402
from timlab.tasks.scratchpad import VERBOSITY_PADDING  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-digits", type=int, default=4)
    ap.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args()
    for level in range(len(VERBOSITY_PADDING)):
        task = TASKS.get("scratch_add")(max_digits=args.max_digits, scratch_frac=1.0, verbosity=level)
        lengths = [len(task.demonstration(e, random.Random(0))) + 1 for e in task.sample(random.Random(0), args.n)]
        print(f"verbosity {level}: mean {statistics.mean(lengths):.1f} tokens, median {statistics.median(lengths):.0f}, "
              f"max {max(lengths)} (bound {task.max_answer_chars} characters + EOS)")


if __name__ == "__main__":
    main()
