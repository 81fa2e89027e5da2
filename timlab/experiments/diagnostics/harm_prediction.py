""""Is my mismatch a problem?": the answer ``timlab check`` and ``timlab analyze`` print, from the lab's measured cells.

Used by ``timlab.experiments.diagnostics.check.format_check`` / ``write_check_html`` and
``timlab.experiments.diagnostics.analyze.format_analysis`` (``harm_answer``). It reads two committed records:
the **evidence** (``timlab/data/harm_evidence.json``: every measured cell with its kind, realized
k3, answer length T, persistence where logged, parameter count and accuracy cost with its 95%
interval; ``timlab.experiments.studies.evidence``, ``python scripts/harm_evidence.py --write``) and
the newest **calibration** that shipped (``CALIBRATIONS``: Study H2's held-out winner where its signal
condition held, else Study H's k3). Given what the caller knows (k3
per token; optionally T, the kind family the user states with ``--kind``,
``mismatch/persistence_ema``, the model's parameter count) it prints a few lines:

1. **the verdict**, one of these tiers, over the *comparable* cells: those without a remedy, of the
   stated kind family (any family when none is stated), with answers within a factor
   ``LENGTH_BAND`` of T (any length when T is unknown):
   - **no verdict**: no comparable cell exists (a kind the lab never measured, or a length outside
     every cell's band). k3 exactly 0 gets its own line (nothing to judge).
   - **above what the lab has measured**: k3 exceeds every comparable cell's k3; the line gives the
     costs of the comparable cells within a factor ``BAND`` of the largest k3 and their falls.
   - **below any cost the lab could detect**: k3 is below the smallest k3 of any comparable cell
     whose cost was detectable (an uncorrected permutation p < 0.05 with the bootstrap interval
     above 0, per cell); the line names that cell. It assumes a smaller mismatch of a measured kind
     costs no more than a larger one.
   - **in the range where measured cells cost a to b points**: otherwise; a and b are the smallest
     and largest point costs of the comparable cells whose k3 is within a factor ``BAND`` of this
     one (where none is, the nearest comparable cell below and above it).
2. **the nearest measured cells** (``NEAREST``), each with its study, kind, k3, T, cost and interval,
   seeds and detectability. Distance: |ln(k3_cell / k3)| + |ln(T_cell / T)| (T known) +
   ``PERSISTENCE_WEIGHT`` x |persistence difference| (the user's persistence known; a cell without
   one counts as ``PERSISTENCE_UNKNOWN`` apart). A factor e in k3 or in T counts the same, since
   E3b's costs grew as T x k3; ``PERSISTENCE_WEIGHT`` = 4 makes P2's two arms (persistence_ema 0.67
   and 0.37, costs 3.0 and 0.9 points) about as far apart as a factor 3 in k3.
3. **what the lab cannot say**: a model size outside the cells' parameter counts (or unknown), other
   tasks, a length outside the cells', an unstated kind, an unknown persistence.
4. **a predicted cost** only where the calibrated statistic's 95% prediction interval
   (``predictor.prediction``) is narrower than ``MAX_WIDTH``; elsewhere one line says why not.

No interval wider than ``MAX_WIDTH`` is printed: a cell whose measured interval is wider shows its
cost and says its interval is wider. Costs are in points of accuracy (0.01 of accuracy = 1 point).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from timlab.errors import UsageError

DATA = Path(__file__).resolve().parents[2] / "data"
EVIDENCE = DATA / "harm_evidence.json"
"""The committed evidence record (``timlab.experiments.studies.evidence`` writes it)."""
STUDY_H_CALIBRATION = DATA / "harm_calibration.json"
"""Study H's committed calibration record (``timlab study analyze docs/examples/studies/harm.yaml --write``)."""

CALIBRATIONS = (DATA / "harm2_calibration.json", STUDY_H_CALIBRATION)
"""The calibration records in the order they supersede each other: Study H2's (written by ``timlab study
analyze docs/examples/studies/harm2.yaml --write`` when its signal condition held), then Study H's."""

CALIBRATION = next((p for p in CALIBRATIONS if p.exists()), STUDY_H_CALIBRATION)
"""The record the answer reads."""

MAX_WIDTH = 0.10
"""The widest 95% interval (high minus low, in accuracy) that the answer prints."""
NEAREST = 3
"""How many nearest cells are shown."""
BAND = 3.0
"""Cells "at this k3": within this factor of it."""
LENGTH_BAND = 2.0
"""Comparable cells have answers within this factor of the user's length."""
PERSISTENCE_WEIGHT = 4.0
"""Distance per unit of ``mismatch/persistence_ema`` difference."""
PERSISTENCE_UNKNOWN = 0.3
"""The persistence difference a cell without a logged persistence counts as (when the user's is known):
about the gap between P2's persistent and fresh arms (0.67 and 0.37), since such a cell could be at either end."""
PERSISTENCE = "mismatch/persistence_ema"
K3 = "rollout_corr/k3_kl"


def load(path: str | Path) -> dict | None:
    p = Path(path)
    return json.loads(p.read_text(encoding="utf-8")) if p.exists() else None


def kinds(evidence: dict | None = None) -> list[str]:
    """The kind families the lab has measured (what ``--kind`` accepts)."""
    rec = load(EVIDENCE) if evidence is None else evidence
    return sorted({c["family"] for c in (rec or {}).get("cells", [])})


def check_kind(kind: str | None, evidence: dict | None = None) -> None:
    """A one-line ``UsageError`` for a kind the lab has not measured, naming the valid ones."""
    valid = kinds(evidence)
    if kind is not None and kind not in valid:
        raise UsageError(f"--kind {kind!r}: not a kind the lab has measured (valid: {', '.join(valid)})")


# ------------------------------------------------------------------------------ formatting
def _pts(x: float) -> str:
    """An accuracy difference in points, one decimal ("4.2"; "-0.3")."""
    return f"{100 * x:.1f}".replace("-0.0", "0.0")


def _k(x: float) -> str:
    return f"{x:.1e}"


def cost_text(c: dict) -> str:
    """A cell's cost with its 95% interval in points, or without it where it is wider than ``MAX_WIDTH``."""
    lo, hi = c["cost_ci"]
    ci = f" [95% {_pts(lo)}, {_pts(hi)}]" if hi - lo <= MAX_WIDTH else f" (its 95% interval is wider than {100 * MAX_WIDTH:g})"
    return f"cost {_pts(c['cost'])} points{ci}, {c['seeds']} seeds, {'detectable' if c['detectable'] else 'not detectable'}"


def cell_text(c: dict) -> str:
    """One nearest cell: "P1/persist (head_perturb persistent, controller target k3 0.01; k3 1.2e-02, T 23): cost ...; Study P1"."""
    what = c["kind"] + (f", {c['dose']}" if c["dose"] else "")
    pers = f", persistence {c['persistence_ema']:.2f}" if c.get("persistence_ema") is not None else ""
    window = "" if c["cost_window"][1] <= 150 else f" (steps {c['cost_window'][0]}-{c['cost_window'][1]})"
    return (f"{c['cell']} ({what}; k3 {_k(c['k3'])}, T {c['length']:.0f}{pers}): {cost_text(c)}{window}; "
            f"{c['source']}")


# ------------------------------------------------------------------------------ the answer
def comparable(cells: list[dict], *, length: float | None, kind: str | None) -> list[dict]:
    """The cells the verdict reads: no remedy, the stated kind family, answers within ``LENGTH_BAND`` of ``length``."""
    return [c for c in cells if not c["remedy"] and (kind is None or c["family"] == kind)
            and (length is None or 1 / LENGTH_BAND <= c["length"] / length <= LENGTH_BAND)]


def distance(c: dict, k3: float, length: float | None, persistence: float | None) -> float:
    d = abs(math.log(c["k3"] / k3))
    if length is not None:
        d += abs(math.log(c["length"] / length))
    if persistence is not None:
        p = c.get("persistence_ema")
        d += PERSISTENCE_WEIGHT * (PERSISTENCE_UNKNOWN if p is None else abs(p - persistence))
    return d


def nearest(cells: list[dict], k3: float, *, length: float | None, kind: str | None,
            persistence: float | None, n: int = NEAREST) -> list[dict]:
    """The ``n`` cells without a remedy (of the stated family, where it has cells) nearest by ``distance``."""
    pool = [c for c in cells if not c["remedy"]]
    if kind:
        pool = [c for c in pool if c["family"] == kind] or pool
    return sorted(pool, key=lambda c: (distance(c, k3, length, persistence), c["cell"]))[:n]


def verdict(cells: list[dict], k3: float, *, length: float | None, kind: str | None) -> tuple[str, str]:
    """(tier, its line): the tier is ``none``, ``above``, ``below`` or ``range`` (module docstring)."""
    where = (f"{kind} cells" if kind else "cells of any kind") + (
        f" with answers of {length / LENGTH_BAND:.0f}-{length * LENGTH_BAND:.0f} tokens" if length is not None else "")
    if k3 == 0:
        return "below", "verdict: no mismatch (k3 is exactly 0); nothing to judge"
    C = comparable(cells, length=length, kind=kind)
    if not C:
        if kind and not any(c["family"] == kind for c in cells):
            why = f"the lab has measured no {kind} mismatch"
        else:
            lens = [c["length"] for c in cells if not c["remedy"] and (kind is None or c["family"] == kind)]
            why = (f"no measured {kind + ' ' if kind else ''}cell has answers within a factor {LENGTH_BAND:g} of "
                   f"{length:.0f} tokens (measured: {min(lens):.0f}-{max(lens):.0f})")
        return "none", f"verdict: none: {why}"
    top = max(c["k3"] for c in C)
    if k3 > top:
        big = [c for c in C if c["k3"] >= top / BAND]
        falls = sum(c["falls"] for c in big)
        return "above", (f"verdict: above what the lab has measured (the largest k3 of its {where} is {_k(top)}; "
                         f"those within a factor {BAND:g} of it cost {_range(big)} points"
                         + (f" and {falls} of {sum(c['seeds'] for c in big)} runs fell)" if falls else ")"))
    det = [c for c in C if c["detectable"]]
    if not det or k3 < min(c["k3"] for c in det):
        if not det:
            return "below", (f"verdict: below any cost the lab could detect (none of its {len(C)} {where} cost "
                             f"anything detectable, up to k3 {_k(top)})")
        first = min(det, key=lambda c: c["k3"])
        return "below", (f"verdict: below any cost the lab could detect (the smallest k3 among its {where} that cost "
                         f"anything detectable was {_k(first['k3'])}: {first['cell']}, {first['kind']}, "
                         f"{_pts(first['cost'])} points)")
    near = [c for c in C if 1 / BAND <= c["k3"] / k3 <= BAND]
    if not near:
        below = [c for c in C if c["k3"] < k3]
        above = [c for c in C if c["k3"] > k3]
        near = [max(below, key=lambda c: c["k3"])] * bool(below) + [min(above, key=lambda c: c["k3"])] * bool(above)
    lo, hi = min(c["k3"] for c in near), max(c["k3"] for c in near)
    return "range", (f"verdict: in the range where measured cells cost {_range(near)} points of accuracy "
                     f"({len(near)} {where} at k3 {_k(lo)}-{_k(hi)})")


def _range(cells: list[dict]) -> str:
    lo, hi = min(c["cost"] for c in cells), max(c["cost"] for c in cells)
    return f"{_pts(lo)} to {_pts(hi)}"


def cannot_say(cells: list[dict], *, length: float | None, kind: str | None, persistence: float | None,
               params: int | None) -> str:
    """What the lab's cells do not cover for this mismatch, one line."""
    ps = [c["params"] for c in cells]
    lens = [c["length"] for c in cells]
    tasks = sorted({c["task"] for c in cells})
    out = []
    size = f"{min(ps) / 1e6:.2g}M-{max(ps) / 1e6:.2g}M"
    if params is None:
        out.append(f"models larger than the lab's {size} parameters")
    elif not min(ps) <= params <= max(ps):
        n = f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"
        out.append(f"a model of {n} parameters (the lab's: {size})")
    out.append(f"tasks other than {', '.join(tasks)}")
    if length is None:
        out.append(f"an unknown answer length (the lab's: {min(lens):.0f}-{max(lens):.0f} tokens)")
    elif not min(lens) / LENGTH_BAND <= length <= max(lens) * LENGTH_BAND:
        out.append(f"answers of {length:.0f} tokens (the lab's: {min(lens):.0f}-{max(lens):.0f})")
    if kind is None:
        out.append("its kind (--kind)")
    if persistence is None:
        out.append(f"its persistence ({PERSISTENCE}{_persistence_gap(cells)})")
    return "cannot say: " + "; ".join(out)


def _persistence_gap(cells: list[dict]) -> str:
    """"; at one k3 a run-long direction cost 2.8x a fresh one, P1", from the record's P1 cells."""
    p1 = {c["kind"]: c["cost"] for c in cells if c["study"] == "P1"}
    a, b = p1.get("head_perturb persistent"), p1.get("head_perturb redrawn every 1 step")
    return f"; at one k3 a run-long direction cost {a / b:.1f}x a fresh one, P1" if a and b and b > 0 else ""


def _who(calibration: dict | None) -> str:
    """Whose calibration a record is, as the line names it: "Study H2's" (a record without a label: Study H's)."""
    return f"{(calibration or {}).get('label') or 'Study H'}'s"


def predicted_line(metrics: dict, calibration: dict | None, *, length: float | None) -> str:
    """The calibrated statistic's predicted cost where its 95% interval is narrower than ``MAX_WIDTH``, else why none."""
    from timlab.experiments.studies.predictor import prediction

    if not calibration or not calibration.get("winner"):
        return f"predicted cost: none ({_who(calibration)} calibration names no statistic)"
    who = _who(calibration)
    name = calibration["winner"]
    c = calibration["candidates"][name]
    v = metrics.get(c["metric"])
    if v is None or not math.isfinite(v):
        return f"predicted cost: none ({name} = {c['metric']} is not measured here)"
    S = abs(v) if c["absolute"] else v
    lo, hi = c["range"]
    lengths = calibration.get("lengths")
    if not lo <= S <= hi:
        return f"predicted cost: none ({name} {S:.2g} is outside {who} calibrated {lo:.2g}-{hi:.2g})"
    if length is not None and lengths and not lengths[0] <= length <= lengths[1]:
        return (f"predicted cost: none (answers of {length:.0f} tokens are outside {who} calibrated "
                f"{lengths[0]:.0f}-{lengths[1]:.0f})")
    pred, a, b = prediction(c["b"], c["b_var"], c["loko"], S)
    if b - a >= MAX_WIDTH:
        return (f"predicted cost: none (the prediction interval of {who} calibrated {name} is +-{_pts((b - a) / 2)} "
                f"points here, wider than the {100 * MAX_WIDTH:g} points timlab prints)")
    return f"predicted cost: {_pts(pred)} points [95% {_pts(a)}, {_pts(b)}] from {name} {S:.3g} ({who} calibration)"


def answer_lines(metrics: dict, *, length: float | None = None, kind: str | None = None, params: int | None = None,
                 evidence: dict | None = None, calibration: dict | None = None) -> list[str]:
    """The answer for a mismatch whose statistics are ``metrics`` (``rollout_corr/k3_kl`` needed;
    ``mismatch/persistence_ema`` used where present): a head line, then the verdict, the nearest
    cells, what the lab cannot say and the predicted cost, each one line (module docstring)."""
    ev = load(EVIDENCE) if evidence is None else evidence
    cal = load(CALIBRATION) if calibration is None else calibration
    k3 = metrics.get(K3)
    if ev is None or not ev.get("cells"):
        return ["is this mismatch a problem? no answer: no evidence record (timlab/data/harm_evidence.json; python "
                "scripts/harm_evidence.py --write)"]
    if k3 is None or not math.isfinite(k3):
        return [f"is this mismatch a problem? no answer: {K3} is not measured here"]
    check_kind(kind, ev)
    k3 = max(float(k3), 0.0)
    pers = metrics.get(PERSISTENCE)
    pers = float(pers) if pers is not None and math.isfinite(pers) else None
    cells = ev["cells"]
    head = (f"is this mismatch a problem? k3 {_k(k3)} per token"
            + (f", answers of {length:.0f} tokens" if length is not None else "")
            + (f", kind {kind}" if kind else "") + (f", persistence {pers:.2f}" if pers is not None else ""))
    lines = [head, "  " + verdict(cells, k3, length=length, kind=kind)[1]]
    if k3 > 0:
        lines += ["  nearest: " + cell_text(c) for c in nearest(cells, k3, length=length, kind=kind, persistence=pers)]
    lines.append("  " + cannot_say(cells, length=length, kind=kind, persistence=pers, params=params))
    lines.append("  " + predicted_line(metrics, cal, length=length))
    return lines


def harm_answer(metrics: dict, **kw) -> str:
    """``answer_lines`` joined into one block of text."""
    return "\n".join(answer_lines(metrics, **kw))
