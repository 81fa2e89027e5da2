"""docs/FINDINGS.md against the committed sweeps, and the statistics behind its verdicts.

The generated blocks of FINDINGS (``<!-- findings:NAME -->``) are recomputed from sweeps/ by
scripts/findings_tables.py; the committed text must equal them, so a number that drifts from
the data (or data that change under a number) fails here."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from script_loader import load_script
from timlab.experiments.stats import binom_cdf, clopper_pearson, permutation_floor, permutation_test

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- statistics
def test_clopper_pearson_known_values():
    # reference values: scipy.stats.beta.ppf(0.025, k, n - k + 1) / beta.ppf(0.975, k + 1, n - k)
    cases = {(0, 5): (0.0, 0.5218237501), (1, 5): (0.0050507634, 0.7164179361), (4, 5): (0.2835820639, 0.9949492366),
             (5, 5): (0.4781762499, 1.0), (2, 10): (0.0252107263, 0.5560954623), (7, 20): (0.1539092048, 0.5921885345)}
    for (k, n), (lo, hi) in cases.items():
        got = clopper_pearson(k, n)
        assert got[0] == pytest.approx(lo, abs=1e-8) and got[1] == pytest.approx(hi, abs=1e-8), (k, n, got)
    # 0 successes: the upper end is 1 - (alpha/2)^(1/n) in closed form
    assert clopper_pearson(0, 10)[1] == pytest.approx(1 - 0.025 ** 0.1, abs=1e-10)
    assert binom_cdf(2, 4, 0.5) == pytest.approx(11 / 16)
    with pytest.raises(ValueError):
        clopper_pearson(6, 5)


def test_exact_permutation_test_hand_counted():
    # complete separation, 5 vs 5: only the observed labeling and its mirror reach |diff| = 5 -> 2/252
    r = permutation_test([6, 7, 8, 9, 10], [1, 2, 3, 4, 5])
    assert r.exact and r.n_relabelings == 252 and r.diff == 5 and r.p == pytest.approx(2 / 252) == r.floor
    assert permutation_floor(4, 4) == pytest.approx(2 / 70)
    # identical groups: every relabeling is at least as extreme
    assert permutation_test([1, 1], [1, 1]).p == 1
    # 2 vs 2, a = {3, 4}, b = {1, 2}: relabelings of {1,2,3,4} into pairs give |diff| 2 (x2), 1 (x2), 0 (x2) -> 2/6
    assert permutation_test([3, 4], [1, 2]).p == pytest.approx(2 / 6)
    # Monte Carlo when enumeration is capped: close to the exact p, and it says it is not exact
    a, b = [0.81, 0.83, 0.80, 0.80, 0.82], [0.70, 0.70, 0.80, 0.79, 0.77]
    exact = permutation_test(a, b)
    mc = permutation_test(a, b, max_exact=10, n_mc=20_000)
    assert exact.p == pytest.approx(6 / 252) and not mc.exact and abs(mc.p - exact.p) < 0.006
    with pytest.raises(ValueError):
        permutation_test([], [1.0])


# ------------------------------------------------------------------------------- FINDINGS
def test_findings_blocks_match_the_committed_sweeps():
    mod = load_script("findings_tables")
    text = mod.FINDINGS.read_text()
    blocks = mod.render()
    for name in mod.BLOCKS:
        assert f"<!-- findings:{name} -->" in text, name
    regenerated = mod.splice(text, blocks)
    if regenerated != text:
        import difflib

        diff = "\n".join(difflib.unified_diff(text.splitlines(), regenerated.splitlines(), "committed", "data", lineterm="", n=0))
        pytest.fail("docs/FINDINGS.md drifted from sweeps/ (python scripts/findings_tables.py --write):\n" + diff[:4000])
    # a few anchors the verdicts rest on, independent of the formatting
    assert "p = 0.429" in blocks["verdict-tests"]  # P2 sooner: collapse steps 1.5 vs 2 are not separable
    assert "-2.29 to -1.41" in blocks["threshold"] and "229-1310" in blocks["threshold"]
    assert "0.023-0.035" in blocks["threshold"]
    # the new remedies (issue 26): five arms of five seeds, the Holm-adjusted verdicts as pre-registered
    rem = blocks["surge-remedies"]
    for arm in ("no remedy", "token TIS (C = 2)", "bypass_ppo_clip", "decoupled_k3_rs_token_tis", "token TIS + batch normalize"):
        assert f"| {arm} | 5 |" in rem, arm
    assert "| bypass_ppo_clip vs no remedy | -0.595 | 0.008 | 0.048 | worse |" in rem
    assert "| token TIS + batch normalize vs no remedy | +0.123 | 0.016 | 0.063 | not separable with 5 seeds |" in rem
    assert rem.count("not separable with 5 seeds") == 4 and "raw p = 0.040" in rem
    # Study E3 (issue 24 item 4): valid at every level, the length fit undecided, no cell at its threshold
    e3 = blocks["e3-study"]
    assert e3.count(": VALID.") == 3 and "rho = beta / alpha = 5.74 [95% bootstrap -18.32, 20.60]" in e3
    assert "**undecided**" in e3 and "Cells that agree with the threshold fit: 12 of 12." in e3


def test_e3c_verdict_row_quotes_its_block():
    """The E3c verdict row rounds the out-of-sample table of its generated block: the measured loss,
    and per hypothesis the prediction and its verdict, so the prose cannot drift from the data."""
    mod = load_script("findings_tables")
    text = mod.FINDINGS.read_text()
    block = text.split("<!-- findings:e3c-study -->")[1].split("<!-- /findings:e3c-study -->")[0]
    row = next(line for line in text.splitlines() if line.startswith("| E3c |"))
    rows = [r.split(" | ") for r in block.splitlines() if r.startswith("| 3 | head_0.72 | 5.1e-04 |")]
    assert len(rows) == 3

    def interval(cell):  # "0.024 [8.7e-03, 0.042]" -> "0.024 [0.009, 0.042]"
        x, lo, hi = (float(v) for v in cell.replace("[", "").replace("]", "").replace(",", "").split())
        return f"{x:.3f} [{lo:.3f}, {hi:.3f}]"

    assert f"measured {interval(rows[0][4])} of accuracy" in row
    for r in rows:
        assert interval(r[6]) in row and r[8].rstrip(" |").split(" (")[0] in row, r
    d = rows[0][7].replace("[", "").replace("]", "").replace(",", "").split()
    assert "D {:+.3f} [{:+.3f}, {:+.3f}], consistent".format(*map(float, d)).replace("D +", "D ") in row
    assert "Level 3, head_0.72: **T * k3** holds out of sample; the registered fit's extrapolation: **holds**." in block


def _numbers(cell: str) -> list[float]:
    """The numbers of a table cell such as "-0.0524 [-0.0629, -0.0411]"."""
    return [float(v) for v in cell.replace("[", " ").replace("]", " ").replace(",", " ").split()]


def _block_cost(acc: str, arm: str) -> tuple[str, str]:
    """An arm's cost from a study block's "arm minus control" table ``acc`` as a verdict row rounds
    it (the control's level minus the arm's, so the sign flips): ("0.052 [0.041, 0.063]", Holm p)."""
    cells = next(r for r in acc.splitlines() if r.startswith(f"| {arm} |")).split(" | ")
    x, lo, hi = _numbers(cells[2])
    return f"{-x:.3f} [{-hi:.3f}, {-lo:.3f}]", cells[4]


def test_p2_verdict_row_quotes_its_block_and_data():
    """The P2 verdict row rounds its generated block (each arm's cost, the registered difference and
    its p, the realized k3) and the cost per unit of k3 recomputed from the registered endpoints."""
    from timlab.experiments.study import endpoint_values, load_study

    text = load_script("findings_tables").FINDINGS.read_text()
    block = text.split("<!-- findings:persistence-p2 -->")[1].split("<!-- /findings:persistence-p2 -->")[0]
    row = next(line for line in text.splitlines() if line.startswith("| P2 (persistence) |"))
    acc = block.split("**accuracy level, evaluations at steps 50-150 (primary)**, arm minus control")[1]

    persist, p_persist = _block_cost(acc, "persist")
    fresh, p_fresh = _block_cost(acc, "redraw_1")
    assert f"a run-long direction costs {persist} of accuracy (steps 50-150, Holm p = {p_persist})" in row
    assert f"a fresh direction every step {fresh} (Holm p = {p_fresh})" in row
    rule1 = next(r for r in block.splitlines() if r.startswith("| redraw_1 - persist | +0.9")).split(" | ")
    d, lo, hi = _numbers(rule1[2])
    assert f"fresh minus run-long {d:+.3f} [{lo:+.3f}, {hi:+.3f}], p = {rule1[3]}" in row
    k3 = {a: next(r for r in block.splitlines() if r.startswith(f"| {a} |")).split(" | ")[1].split()[0]
          for a in ("persist", "redraw_1")}
    assert f"({k3['persist']} against {k3['redraw_1']} over steps 10-150)" in row
    cols = endpoint_values(load_study(REPO / "docs" / "examples" / "studies" / "p2.yaml"), root=REPO)[""]
    per_k3 = {a: (cols["control"]["acc_level"].mean() - cols[a]["acc_level"].mean()) / cols[a]["k3"].mean()
              for a in ("persist", "redraw_1")}
    assert (f"it cost {per_k3['persist'] / per_k3['redraw_1']:.1f}x as much ({per_k3['persist']:.1f} against "
            f"{per_k3['redraw_1']:.2f} of accuracy per unit of mean k3)") in row


def test_p2_verdict_row_quotes_its_16_seed_blocks():
    """The P2 row's 16-seed sentence rounds the extension's block (rule 1 pooled over the two machine
    blocks, its stratified p) and block amd's own comparison (block p2-amd)."""
    text = load_script("findings_tables").FINDINGS.read_text()
    block = text.split("<!-- findings:persistence-p2-16 -->")[1].split("<!-- /findings:persistence-p2-16 -->")[0]
    amd = text.split("<!-- findings:p2-amd -->")[1].split("<!-- /findings:p2-amd -->")[0]
    row = next(line for line in text.splitlines() if line.startswith("| P2 (persistence) |"))
    rule1 = next(r for r in block.splitlines() if r.startswith("| redraw_1 - persist | +0.9")).split(" | ")
    d, lo, hi = _numbers(rule1[2])
    assert f"fresh minus run-long {d:+.3f} [{lo:+.3f}, {hi:+.3f}], stratified p = {rule1[3]}" in row
    m = re.search(r"redraw_1 minus persist: ([+-][0-9.]+), exact permutation p = ([0-9.]+)", amd)
    assert f"the new block alone {float(m.group(1)):+.3f}, p = {float(m.group(2)):.3f}" in row


def test_h2_verdict_row_quotes_its_blocks():
    """The H2 row rounds its harm2-test block: the signal condition, the winner's and k3's out-of-sample
    errors and their paired difference, the range of held-out costs, the prediction intervals' half
    widths, and k3 x persistence against k3; its verdict names the block's winner."""
    text = load_script("findings_tables").FINDINGS.read_text()
    block = text.split("<!-- findings:harm2-test -->")[1].split("<!-- /findings:harm2-test -->")[0]
    row = next(line for line in text.splitlines() if line.startswith("| H2 |"))
    q, p = re.search(r"Cochran's Q over the 6 held-out cells' costs = ([0-9.]+) on 5 df, p = ([0-9.e+-]+)", block).groups()
    assert f"Q = {float(q):.0f}, p = {float(p):.0e}" in row
    assert "Verdict: **max_abs predicts better than k3**" in block and "max_abs (the largest per-token abs" in row
    err = {k: re.search(rf"\n\| {re.escape(k)} \| ([0-9.]+) \[([0-9.]+), ([0-9.]+)\] \| ([^|]+) \|", block).groups()
           for k in ("k3", "max_abs", "k3_persist")}
    mx, k3 = err["max_abs"], err["k3"]
    assert (f"RMSE max_abs {float(mx[0]):.3f} [{float(mx[1]):.3f}, {float(mx[2]):.3f}], k3 {float(k3[0]):.3f} "
            f"[{float(k3[1]):.3f}, {float(k3[2]):.3f}]") in row
    d, lo, hi = _numbers(mx[3])
    assert f"paired {d:+.3f} [{lo:+.3f}, {hi:+.3f}]" in row
    assert _numbers(err["k3_persist"][3])[2] < 0 and "k3 x persistence is worse than k3" in row
    costs = [float(c) for c in re.findall(r"\n\| \S+ \| (?:redraw5|kv|stale) \| \+([0-9.]+) \|", block)]
    assert len(costs) == 6 and f"held-out costs {min(costs):.3f}-{max(costs):.3f}" in row
    halves = [(float(b) - float(a)) / 2 for a, b in re.findall(r"\[([+-][0-9.]+), ([+-][0-9.]+)\]", block.split(
        "**Held-out predictions**")[1].split("**Out-of-sample results**")[0])]
    assert f"+-{min(halves):.2f} to +-{max(halves):.2f}" in row


def test_p1_verdict_row_quotes_its_blocks():
    """The P1 verdict row rounds its generated blocks: each arm's cost (the control's level minus its
    own, so the sign flips), the registered difference and its p, and the descriptive pair table."""
    text = load_script("findings_tables").FINDINGS.read_text()
    block = text.split("<!-- findings:persistence -->")[1].split("<!-- /findings:persistence -->")[0]
    pairs = text.split("<!-- findings:p1-pairs -->")[1].split("<!-- /findings:p1-pairs -->")[0]
    row = next(line for line in text.splitlines() if line.startswith("| P1 (persistence) |"))
    acc = block.split("**accuracy level, evaluations at steps 50-150 (primary)**, arm minus control")[1]

    def cost(arm):
        return _block_cost(acc, arm)

    numbers = _numbers

    persist, p_persist = cost("persist")
    fresh, p_fresh = cost("redraw_1")
    assert f"a run-long direction costs {persist} of accuracy (steps 50-150, Holm p = {p_persist})" in row
    assert f"a fresh direction every step {fresh} (Holm p = {p_fresh})" in row
    rule1 = next(r for r in block.splitlines() if r.startswith("| redraw_1 - persist | +0.9")).split(" | ")
    d, lo, hi = numbers(rule1[2])
    assert f"fresh minus run-long {d:+.3f} [{lo:+.3f}, {hi:+.3f}], p = {rule1[3]}" in row
    costs = ", ".join(cost(a)[0].split()[0] for a in ("persist", "redraw_25", "redraw_5", "redraw_1"))
    assert f"By persistence (150, 25, 5, 1 steps): {costs}" in row
    r25 = next(r for r in pairs.splitlines() if r.startswith("| redraw_25 |")).split(" | ")
    d, lo, hi = numbers(r25[2])
    assert f"R lasting 25 steps still cost {d:.4f} [{lo:.3f}, {hi:.3f}] more than 1 step (p = {r25[3].rstrip(' |')}" in row
    mag = next(r for r in pairs.splitlines() if r.startswith("| persist |")).split(" | ")[1]
    assert f"magnitude ({mag} vs" in row
    assert "Verdict P1: **the cost follows how long the bias persists**" in block


def test_generic_tables_run_without_tabulate(monkeypatch):
    """The generic mode (any sweep directory) must not need pandas' to_markdown (tabulate)."""
    import pandas as pd

    def refuse(*a, **k):
        raise ImportError("tabulate missing")

    monkeypatch.setattr(pd.DataFrame, "to_markdown", refuse)
    out = load_script("findings_tables").generic([str(REPO / "sweeps" / "threshold_d16")])
    assert "| zero_d16 | 5 | 0 |" in out and "(no by_length data)" in out


# ------------------------------------------------------------------------------- machine-free fits
def test_small_fits_are_plain_python_and_match_numpy():
    import math

    import numpy as np

    from timlab.experiments.stats import least_squares, line_fit

    rng = np.random.default_rng(3)
    for _ in range(50):
        X = np.column_stack([np.ones(9), rng.normal(size=9), rng.normal(size=9)])  # (9, 3)
        y = rng.normal(size=9)
        assert least_squares(X.tolist(), y.tolist()) == pytest.approx(np.linalg.lstsq(X, y, rcond=None)[0], rel=1e-10, abs=1e-12)
        x, z = rng.normal(size=7), rng.normal(size=7)
        assert line_fit(x, z) == pytest.approx(tuple(np.polyfit(x, z, 1)), rel=1e-10, abs=1e-12)
    # hand-computed: y = 2x + 1 exactly; a flat y has a slope of exactly 0 (numpy's lstsq gave +-1e-17 by BLAS kernel)
    assert line_fit([0, 1, 2, 3], [1, 3, 5, 7]) == (2.0, 1.0)
    assert line_fit([10, 20, 30, 40, 50], [0.97] * 5) == (0.0, 0.97)
    assert least_squares([[1, 0], [0, 1], [1, 1]], [1, 2, 3]) == pytest.approx((1.0, 2.0))
    # rank-deficient or underdetermined designs are refused, not solved
    assert least_squares([[1, 2], [2, 4], [3, 6]], [1, 2, 3]) is None
    assert least_squares([[1, 2, 3]], [1]) is None
    assert all(math.isnan(v) for v in line_fit([1, 1, 1], [1, 2, 3]))


def test_e3_extrapolations_print_unbounded_not_digits():
    from timlab.experiments.study import load_study
    from timlab.experiments.study.fits import fmt_loss

    studies = REPO / "docs" / "examples" / "studies"
    bound = load_study(studies / "e3.yaml").fits[0].unbounded
    assert bound == 10.0 == load_study(studies / "e3c.yaml").fits[0].unbounded  # E3c's predictions print the same way
    assert fmt_loss(40605.674, bound) == "unbounded" and fmt_loss(bound * 1.01, bound) == "unbounded"
    assert fmt_loss(2.064, bound) == "2.064" and fmt_loss(2.6e-3, bound) == "2.6e-03"


def test_harm_blocks_match_the_study():
    # Study H's blocks (a predictor study: docs/examples/studies/harm.yaml) as its analysis renders them now
    from timlab.experiments.study import oos as O
    from timlab.experiments.study import predictor as P

    st = P.load_predictor(REPO / "docs/examples/studies/harm.yaml")
    text = (REPO / "docs/FINDINGS.md").read_text()
    for name, body in O.blocks(st).items():
        assert f"<!-- findings:{name} -->\n{body}\n<!-- /findings:{name} -->" in text, name


@functools.cache
def _h1():
    """Study H1's study file (its labels and family notes head the held-k3 block's tables)."""
    from timlab.experiments.study import load_study

    return load_study(REPO / "docs" / "examples" / "studies" / "h1.yaml")


def _h1_table(block: str, endpoint: str, family: str) -> dict[str, list[str]]:
    """{arm: its cells} of one comparison table of the held-k3 block: the table headed by the study
    file's label of ``endpoint`` and the note of ``family``."""
    h1 = _h1()
    note = next(f.note for f in h1.families if f.name == family)
    part = block.split(f"**{h1.label(endpoint)}**{note}\n")[1].lstrip("\n").split("\n\n")[0]
    return {r.split(" | ")[0].lstrip("| "): [c.strip() for c in r.strip("| ").split(" | ")]
            for r in part.splitlines() if r.startswith("| ") and not r.startswith("| arm")}


def h1_rule4(block: str, profile: str, endpoint: str) -> str:
    """Study H1's rule 4 ("does TIS stop it"), read off rules 2 and 3 as registered: the non-TIS
    arm's erosion, TIS's gain over it, and the TIS arm's own erosion, on one endpoint."""
    def holds(family: str, arm: str) -> bool:
        return _h1_table(block, endpoint, family)[arm][-1] == "**yes**"
    if not holds("erosion", profile):
        return "nothing to stop"
    if not holds(f"tis_{profile}", f"{profile}_tis"):
        return "not shown to help"
    return "reduces it" if holds("erosion_tis", f"{profile}_tis") else "stops it"


def test_h1_verdict_row_quotes_its_block():
    """The H1 verdict row rounds the held-k3 block: each arm's late-accuracy difference with its
    interval, TIS's gain and the TIS arms' remaining cost, and rule 4's reading ("reduces it") read
    off the block's rule columns as registered."""
    text = load_script("findings_tables").FINDINGS.read_text()
    block = text.split("<!-- findings:held-k3 -->")[1].split("<!-- /findings:held-k3 -->")[0]
    row = next(line for line in text.splitlines() if line.startswith("| H1 |"))
    erosion = _h1_table(block, "acc_late", "erosion")
    for arm in ("hold_3e-3", "hold_1e-2", "grow"):
        d, lo, hi = _numbers(erosion[arm][3])  # the excess over the control [95% bootstrap]
        assert f"{arm} {d:.3f} [{lo:.3f}, {hi:.3f}]" in row and erosion[arm][5] == "0.0012", arm
    gains = [_numbers(_h1_table(block, "acc_late", f"tis_{p}")[f"{p}_tis"][3])[0] for p in ("hold_3e-3", "hold_1e-2", "grow")]
    assert "TIS raises it by " + ", ".join(f"{g:+.3f}" for g in gains) in row
    left = [_numbers(_h1_table(block, "acc_late", "erosion_tis")[f"{p}_tis"][3])[0] for p in ("hold_3e-3", "hold_1e-2", "grow")]
    assert "the TIS arms still erode: " + ", ".join(f"{x:.3f}" for x in left) in row
    assert [h1_rule4(block, p, "acc_late") for p in ("hold_3e-3", "hold_1e-2", "grow")] == ["reduces it"] * 3
    assert "**token TIS reduces it, does not stop it**" in row
    assert [h1_rule4(block, p, "gold_drift") for p in ("hold_3e-3", "hold_1e-2", "grow")] == \
        ["stops it", "not shown to help", "reduces it"]
    assert "Verdict grow: **erodes, still falling at step 2000**" in block
    ew = text.split("<!-- findings:early-warning-h1 -->\n")[1].split("<!-- /findings:early-warning-h1 -->")[0]
    assert "**grad_norm_change**: **cries wolf on long runs**, false alarms 56/56" in ew and "fired in 56/56 runs" in row
