"""Write timlab/data/word_problems.jsonl: 50 arithmetic word problems, the dataset task's default file.

Each line is ``{"question": ..., "answer": ...}``: a two- or three-step problem over small whole
numbers (add, take away, multiply, share equally) and its whole-number answer as a string. Seeded
(``random.Random(0)``), so running it again writes the same bytes; tests/test_dataset_task.py
checks that the committed file is this script's output.

    python scripts/make_word_problems.py            # rewrite the bundled file
    python scripts/make_word_problems.py --out FILE # write elsewhere
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "timlab" / "data" / "word_problems.jsonl"
N_PROBLEMS = 50
NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "books"]
BOXES = ["bags", "boxes", "jars", "baskets"]


def _buy_and_give(rng: random.Random) -> tuple[str, int]:
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    start, bought = rng.randint(5, 60), rng.randint(2, 40)
    given = rng.randint(1, start + bought)
    q = (f"{a} has {start} {item}. {a} buys {bought} more {item} and then gives {given} of them to {b}. "
         f"How many {item} does {a} have now?")
    return q, start + bought - given


def _boxes(rng: random.Random) -> tuple[str, int]:
    a = rng.choice(NAMES)
    item, box = rng.choice(ITEMS), rng.choice(BOXES)
    n, per, extra = rng.randint(2, 12), rng.randint(3, 15), rng.randint(1, 20)
    q = (f"{a} fills {n} {box} with {per} {item} each and has {extra} {item} left over. "
         f"How many {item} did {a} have at the start?")
    return q, n * per + extra


def _share(rng: random.Random) -> tuple[str, int]:
    a = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    friends, each, eaten = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 30)
    total = friends * each + eaten
    q = (f"{a} had {total} {item}, lost {eaten} of them, and shared the rest equally among {friends} "
         f"friends. How many {item} did each friend get?")
    return q, each


def _price(rng: random.Random) -> tuple[str, int]:
    a = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    n, price = rng.randint(2, 9), rng.randint(2, 15)
    paid = n * price + rng.randint(0, 50)
    q = (f"{item.capitalize()} cost {price} dollars each. {a} buys {n} {item} and pays with {paid} dollars. "
         f"How many dollars of change does {a} get?")
    return q, paid - n * price


def _weeks(rng: random.Random) -> tuple[str, int]:
    a = rng.choice(NAMES)
    per_day, days, weeks = rng.randint(2, 20), rng.randint(2, 7), rng.randint(2, 6)
    q = (f"{a} reads {per_day} pages a day, {days} days a week. How many pages does {a} read in "
         f"{weeks} weeks?")
    return q, per_day * days * weeks


KINDS = (_buy_and_give, _boxes, _share, _price, _weeks)


def word_problems(n: int = N_PROBLEMS, seed: int = 0) -> list[dict[str, str]]:
    """``n`` distinct problems, the kinds in turn, drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(out) < n:
        q, answer = KINDS[len(out) % len(KINDS)](rng)
        if q not in seen:
            seen.add(q)
            out.append({"question": q, "answer": str(answer)})
    return out


def render(problems: list[dict[str, str]]) -> str:
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.write_text(render(word_problems()), encoding="utf-8")
    print(f"wrote {N_PROBLEMS} problems to {args.out}")


if __name__ == "__main__":
    main()
