"""docs/FINDINGS.md and its pages (docs/findings/*.md) against the committed sweeps, and the
statistics behind its verdicts.

The generated blocks of the findings (``<!-- findings:NAME -->``, each in the file
``timlab.findings.block_file`` finds) are recomputed from sweeps/ by scripts/findings_tables.py;
the committed text must equal them, so a number that drifts from the data (or data that change
under a number) fails here."""

from __future__ import annotations

import functools
import re
import statistics
from pathlib import Path

import pytest

from script_loader import load_script
from timlab.experiments.studies.stats import binom_cdf, clopper_pearson, permutation_floor, permutation_test
from timlab.findings import opens, read_all

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
def test_blocks_are_found_and_written_across_the_index_and_its_pages(tmp_path):
    """A block lives in the index or in one of its pages (docs/findings/ beside docs/FINDINGS.md):
    ``block_file`` finds it, ``write_blocks`` of the index writes each block into the file holding it
    and leaves the others byte for byte, a block missing everywhere is reported against the index,
    and one opened in two files is refused."""
    from timlab.errors import BadFileError
    from timlab.experiments.studies.text import write_blocks
    from timlab.findings import block_file, block_text, files

    index = tmp_path / "FINDINGS.md"
    index.write_text("# F\nprose that quotes `<!-- findings:x -->` opens no block\n<!-- findings:v -->\nold v\n"
                     "<!-- /findings:v -->\n")
    (tmp_path / "findings").mkdir()
    a, b = tmp_path / "findings" / "a.md", tmp_path / "findings" / "b.md"
    a.write_text("# A\n<!-- findings:x -->\nold x\n<!-- /findings:x -->\ntail\n")
    b.write_text("# B\n<!-- findings:y -->\n<!-- /findings:y -->\n")
    assert files(index) == [index, a, b]
    assert [block_file(index, n) for n in ("v", "x", "y", "z")] == [index, a, b, index]
    assert block_text(index, "x") == "old x\n" and block_text(index, "z") == ""
    write_blocks(index, {"x": "new x", "y": "new y"})
    assert a.read_text() == "# A\n<!-- findings:x -->\nnew x\n<!-- /findings:x -->\ntail\n"
    assert b.read_text() == "# B\n<!-- findings:y -->\nnew y\n<!-- /findings:y -->\n"
    assert "old v" in index.read_text() and "new" not in index.read_text()
    with pytest.raises(BadFileError, match=f"{index}: no block <!-- findings:z -->"):
        write_blocks(index, {"z": "new z"})
    b.write_text(b.read_text() + "<!-- findings:x -->\n<!-- /findings:x -->\n")
    with pytest.raises(BadFileError, match="block x: opened in .*a.md and .*b.md; a block lives in one file"):
        block_file(index, "x")


def test_study_blocks_live_on_their_study_pages():
    """Each study file's blocks are on a page of docs/findings/, not on the index; the index is an
    index (the introduction, the verdicts and a link to every page) of at most 600 lines."""
    from timlab.experiments.studies.registration import load_study
    from timlab.experiments.studies.heldout import load_heldout
    from timlab.experiments.studies.predictor import load_predictor
    from timlab.findings import INDEX, block_file, files

    homes = {}
    for path in sorted((REPO / "docs/examples/studies").glob("*.yaml")):
        st = load_heldout(path) or load_predictor(path) or load_study(path)
        for name in (st.findings or ())[1:]:
            homes[name] = block_file(st.findings[0], name).relative_to(REPO).as_posix()
    assert homes["held-k3"] == "docs/findings/h1.md" and homes["harm2-test"] == "docs/findings/h2.md"
    assert homes["persistence-p2-16"] == "docs/findings/h2.md"  # registered after H2, in its section
    assert all(h.startswith("docs/findings/") for h in homes.values()), homes
    index = INDEX.read_text()
    assert len(index.splitlines()) <= 600 and "<!-- findings:verdict-tests -->" in index
    for page in files()[1:]:
        assert f"](findings/{page.name})" in index, page.name


def test_findings_blocks_match_the_committed_sweeps():
    mod = load_script("findings_tables")
    text = read_all()
    blocks = mod.render()
    for name in mod.BLOCKS:
        assert len(opens(name).findall(text)) == 1, name  # one block of each name across the index and its pages
    for path, (committed, regenerated) in mod.spliced(mod.FINDINGS, blocks).items():
        if regenerated != committed:
            import difflib

            diff = "\n".join(difflib.unified_diff(committed.splitlines(), regenerated.splitlines(), "committed", "data",
                                                  lineterm="", n=0))
            pytest.fail(f"{path.relative_to(REPO)} drifted from sweeps/ (python scripts/findings_tables.py --write):\n"
                        + diff[:4000])
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
    text = read_all()
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
    from timlab.experiments.studies.engine import endpoint_values

    from timlab.experiments.studies.registration import load_study

    text = read_all()
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
    text = read_all()
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
    text = read_all()
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
    text = read_all()
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

    from timlab.experiments.studies.stats import least_squares, line_fit

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
    from timlab.experiments.studies.registration import load_study
    from timlab.experiments.studies.fits import fmt_loss

    studies = REPO / "docs" / "examples" / "studies"
    bound = load_study(studies / "e3.yaml").fits[0].unbounded
    assert bound == 10.0 == load_study(studies / "e3c.yaml").fits[0].unbounded  # E3c's predictions print the same way
    assert fmt_loss(40605.674, bound) == "unbounded" and fmt_loss(bound * 1.01, bound) == "unbounded"
    assert fmt_loss(2.064, bound) == "2.064" and fmt_loss(2.6e-3, bound) == "2.6e-03"


def test_harm_blocks_match_the_study():
    # Study H's blocks (a predictor study: docs/examples/studies/harm.yaml) as its analysis renders them now
    from timlab.experiments.studies import oos as O
    from timlab.experiments.studies import predictor as P

    st = P.load_predictor(REPO / "docs/examples/studies/harm.yaml")
    text = read_all()
    for name, body in O.blocks(st).items():
        assert f"<!-- findings:{name} -->\n{body}\n<!-- /findings:{name} -->" in text, name


@functools.cache
def _h1():
    """Study H1's study file (its labels and family notes head the held-k3 block's tables)."""
    from timlab.experiments.studies.registration import load_study

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
    text = read_all()
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


# ------------------------------------------------------------------------------- the re-analysis' corrections
# An independent re-analysis (issue 56, item 4) found six statements the committed data do not support; the
# corrected prose quotes generated blocks (e3c-reading, l1-e3b, h1-k3-steps, harm-insample, held-k3,
# early-warning-h1) or bench/RESULTS.md, and these tests keep it in step with them.
def _text_and_flat() -> tuple[str, str]:
    """FINDINGS and its pages as committed, and the same with every run of whitespace made one space (prose wraps)."""
    text = read_all()
    return text, " ".join(text.split())


def _block(text: str, name: str) -> str:
    return text.split(f"<!-- findings:{name} -->\n")[1].split(f"<!-- /findings:{name} -->")[0]


def _flat(path: str) -> str:
    return " ".join((REPO / path).read_text().split())


def _page(name: str) -> str:
    """A study's page of the findings (docs/findings/NAME.md), its whitespace made single spaces."""
    return _flat(f"docs/findings/{name}.md")


def _e(x: str) -> str:
    """A block's e-notation as the prose writes it: "6.1e-04" -> "6.1e-4"."""
    return x.replace("e-0", "e-")


def test_e3c_prose_says_what_its_shape_test_turned_on():
    """E3c's "T^2 * k3 over-predicts" is stated with what it rests on (block e3c-reading): the two
    one-dose fits already differ ~2x at E3b's own longest T at E3c's k3, which lay below E3b's cells',
    and E3c's one cell leaves the exponent of T between 160 and 325 wide open."""
    import math
    import re

    text, flat = _text_and_flat()
    block = _block(text, "e3c-reading")
    lo_k3, hi_k3 = re.search(r"E3b's cells realized (\S+) to (\S+)\)", block).groups()
    k3 = re.search(r"At E3c's realized k3 (\S+) ", block).group(1)
    assert float(k3) < float(lo_k3)  # the test extrapolated in k3, below every fitted cell
    r160, r325 = (float(x) for x in re.search(r"(\S+)x at T = 160\.3, (\S+)x at T = 325\.4", block).groups())
    assert math.log(r160) / math.log(r325) > 0.85  # most of the separation is there at an in-sample T
    b, lo, hi = (float(x) for x in re.search(r"b = (\S+) \[95% bootstrap (\S+), (\S+)\]", block).groups())
    assert lo < 0 < 1 < hi  # holds 0 and 1
    laws = dict(re.findall(r"\| (T \* k3|T\^2 \* k3) \| (k3\^\S+ T\^\S+) \|", block))
    row = next(line for line in text.splitlines() if line.startswith("| E3c |"))
    exp = f"{b:.2f} [{lo:.2f}, {hi:.2f}]"
    assert f"differ {r160:.2f}x already at E3b's own T = 160 and {r325:.2f}x at T = 325" in row
    assert f"(cost as {laws['T * k3']} and {laws['T^2 * k3']})" in row and exp in row
    assert f"below every E3b cell's, {_e(lo_k3)} to {_e(hi_k3)}" in row
    for where in (flat.split("## Verdicts")[0], _page("e3c").split("**Verdict E3c**")[1]):
        assert f"{r160:.2f}x" in where and exp in where
    assert "over-predicts 2.6x" not in flat and "over-predicted 2.6x" not in flat
    for page in ("docs/findings-summary.md", "docs/realistic.md"):  # findings in a paragraph each; E3c
        assert _flat(page).count(f"{r160:.2f}x") == 1 and _flat(page).count(exp) == 1, page


def test_l1_prose_sets_e3b_fit_against_both_summaries_of_its_k3():
    """L1's cost matches E3b's fit only on L1's median per-step k3; at its mean k3 (E3b's own summary)
    the fit predicts about 3x the measured cost (block l1-e3b), and the prose says both."""
    import re

    text, flat = _text_and_flat()
    block = _block(text, "l1-e3b")
    med, mean = re.search(r"median (\S+), mean (\S+)\n", block).groups()
    fit = next(r for r in block.splitlines() if r.startswith("| the registered fit")).split(" | ")
    at_med, at_mean = fit[1], fit[2].rstrip(" |")
    measured = re.search(r"steps 10-40\): (\S+ \[\S+ \S+\])\.", block).group(1)
    assert 0.3 < float(measured.split()[0]) / float(at_mean.split()[0]) < 0.4  # "a third"
    row = next(line for line in text.splitlines() if line.startswith("| L1 |"))
    assert (f"E3b's registered fit predicts {at_med} at T = 1,038 and L1's median per-step k3 ({_e(med)}), but "
            f"{at_mean} at its mean k3 ({_e(mean)})") in row
    results = flat.split("**Against E3b's extrapolation**")[1].split("**Verdict L1**")[0]
    assert f"cost {measured} at T = 1,038" in results and at_med in results and at_mean in results
    for where in (flat.split("## Verdicts")[0], _flat("docs/findings-summary.md")):
        assert f"at L1's mean, {_e(mean)}, the same fit predicts {float(at_mean.split()[0]):.2f}" in where or \
            f"at L1's mean k3 ({_e(mean)}) the same fit predicts {float(at_mean.split()[0]):.2f}" in where
    assert "the size E3b's T * k3 fit predicted" not in flat
    assert not any("had predicted for T = 1,000" in _flat(page) for page in ("README.md", "docs/findings-summary.md"))


def test_h_in_sample_prose_says_no_candidate_but_k3_decision_beat_k3_there():
    """Study H in sample: tv and adv_diff had the smallest errors, but neither's paired interval
    against k3 excludes 0; only k3_decision's does (block harm-insample). The prose quotes them."""
    text, flat = _text_and_flat()
    block = _block(text, "harm-insample")
    gain = {r.split(" (")[0].lstrip("| "): _numbers(r.split(" | ")[4]) for r in block.splitlines()
            if r.startswith("| ") and "(`" in r and r.split(" | ")[4] != "-"}
    assert gain["tv"][1] <= 0 and gain["adv_diff"][1] <= 0 < gain["k3_decision"][1]
    row = next(line for line in text.splitlines() if line.startswith("| H |"))

    def ci(k, d):
        return f"{gain[k][0]:+.{d}f} [{gain[k][1]:+.{d}f}, {gain[k][2]:+.{d}f}]".replace("+-", "-")

    assert f"({ci('tv', 3)}, {ci('adv_diff', 3)}); only k3_decision's did ({ci('k3_decision', 3)})" in row
    results = _page("harm").split("### RESULTS of Study H ")[1]
    assert f"({ci('tv', 4)} and {ci('adv_diff', 4)}, block harm-insample" in results
    assert f"only k3_decision's did ({ci('k3_decision', 4)})" in results
    assert f"tv's reached it, {ci('tv', 3)}" in _flat("docs/findings-summary.md")
    assert not any("predicted a held-out kind better than k3" in _flat(page) for page in ("README.md", "docs/findings-summary.md"))


def test_h1_prose_states_the_tails_with_the_dose():
    """H1's held dose is a median: wherever the prose gives the dose it gives the late mean and the
    share of late steps above 1 nat per token (block h1-k3-steps), and hold_3e-3's own accuracy beside
    the control's (block held-k3)."""
    text, flat = _text_and_flat()
    steps = {r.split(" | ")[0].lstrip("| "): r.strip("| ").split(" | ")
             for r in _block(text, "h1-k3-steps").splitlines() if r.startswith("| hold") or r.startswith("| grow")}
    mean, share = steps["hold_3e-3"][3], f"{100 * float(steps['hold_3e-3'][5]):.1f}%"
    shares = [f"{100 * float(steps[a][5]):.1f}%" for a in ("hold_3e-3", "hold_1e-2", "grow")]
    windows = _block(text, "held-k3").split("**Early (steps 50-500) and late (steps 1500-2000) windows**")[1]
    early = {r.split(" | ")[0].lstrip("| "): r.split(" | ") for r in windows.split("\n\n")[1].splitlines()
             if r.startswith("| control |") or r.startswith("| hold_3e-3 |")}
    acc = {a: (float(c[3].split()[0]), float(c[4].split()[0])) for a, c in early.items()}
    row = next(line for line in text.splitlines() if line.startswith("| H1 |"))
    assert f"late mean k3 was {mean} and {share} of late steps exceeded 1 nat per token" in row
    assert f"{shares[0][:-1]}-{shares[2]} of late steps exceeded 1 nat per token" in row
    flat_acc = "stayed flat ({:.3f} over steps 50-500, {:.3f} over 1500-2000) while the control improved ({:.3f} -> {:.3f})"
    assert flat_acc.format(*acc["hold_3e-3"], *acc["control"]) in row
    h1 = _page("h1").split("### RESULTS of Study H1")[1]
    assert f"{', '.join(shares[:2])} and {shares[2]} of the late steps exceed 1 nat per token" in h1
    assert (f"at a median per-token k3 of 3e-3 with heavy tails (a late mean of {mean}, and {share} of late steps "
            f"above 1 nat per token)") in h1
    assert "the real dense range" not in h1 and '"held at 3e-3"' not in h1
    summary = _flat("docs/findings-summary.md")
    assert f"{mean} at the 3e-3 level, where {share} of steps exceeded 1 nat per token" in summary
    assert "stayed flat ({:.3f} -> {:.3f}) while the control improved ({:.3f} -> {:.3f})".format(
        *acc["hold_3e-3"], *acc["control"]) in summary


def test_p1_prose_quotes_the_persistence_of_staleness():
    """P1's "What it means" no longer lets persistence explain staleness's cost: it quotes the
    persistence statistics of one step of staleness, a run-long and a fresh head direction as
    bench/RESULTS.md records them ("Persistence statistics by kind of mismatch")."""
    _, flat = _text_and_flat()
    bench = (REPO / "bench" / "RESULTS.md").read_text().split("## Persistence statistics by kind of mismatch")[1]
    rows = {r.split(" | ")[0].lstrip("| "): [float(x) for x in r.strip("| ").split(" | ")[2:]]
            for r in bench.split("\n\n")[2].splitlines()[3:]}  # past the header and zero mismatch (NaN)
    stale, one, fresh = rows["stale 1"], rows["head_perturb 0.6, one direction"], rows["head_perturb 0.6, redrawn every step"]
    p1 = _page("p1").split("### RESULTS of Study P1")[1].split("**What it means.**")[1]
    assert (f"`mismatch/persistence_lag1` {stale[0]:.2f} and `persistence_ema` {stale[1]:.2f}, near a head direction "
            f"redrawn every step ({fresh[0]:.2f}, {fresh[1]:.2f}) and far from a run-long one ({one[0]:.2f}, "
            f"{one[1]:.2f}), while its bias is plain within a step (`persistence_reliability` {stale[2]:.2f})") in p1
    assert "whose bias follows the policy's own recent updates" not in flat


def test_early_warning_h1_registration_discloses_the_earlier_look():
    """The registration of H1 as the alarm rules' second test set carries a dated disclosure of the
    commit that read one H1 run's k3 before it: the k3 rules' counts it names come from the block,
    and, where the repository's history is at hand, the two commits' times are the ones it states."""
    import subprocess

    text, flat = _text_and_flat()
    part = _page("early-warning").split("### Study H1 as a second test set of the alarm rules")[1].split(" ## ")[0]
    ew = _block(text, "early-warning-h1")
    fired = [next(r for r in ew.splitlines() if r.startswith(f"| {a} |")).split(" | ")[6].split("/")[0]
             for a in ("k3_change", "k3_level")]
    assert f"they fired on {fired[0]} and {fired[1]} of the 56 runs" in part
    assert "commit 1245151 (2026-11-26 09:20 UTC), 10 h 52 min before this registration's commit 3a6eaf6 " \
           "(2026-11-26 20:12 UTC)" in part
    try:
        when = subprocess.run(["git", "-C", str(REPO), "show", "-s", "--format=%at", "1245151", "3a6eaf6"],
                              capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the commits are not in this checkout's history")
    import datetime as dt

    look, reg = (dt.datetime.fromtimestamp(int(t), dt.timezone.utc) for t in when)
    assert look.strftime("%Y-%m-%d %H:%M") == "2026-11-26 09:20" and reg.strftime("%Y-%m-%d %H:%M") == "2026-11-26 20:12"
    assert divmod(int((reg - look).total_seconds() + 30) // 60, 60) == (10, 52)


def _row(prefix: str) -> str:
    return next(line for line in (REPO / "docs/FINDINGS.md").read_text().splitlines() if line.startswith(prefix))


def test_lf_verdict_row_quotes_its_blocks():
    """The LF row rounds its blocks: falls per arm with their intervals, the fall steps' range and
    median, the early and mid accuracy, the k3 range over the 25 steps before the falls, and noise's
    late cost and final accuracy; its decisions follow the registered rule (>= 4 of 8 late falls)."""
    from timlab.findings import INDEX, block_text

    block, k3 = block_text(INDEX, "late-falls"), block_text(INDEX, "late-falls-k3")
    row = _row("| LF |")
    head = next(r for r in block.splitlines() if r.startswith("| head |")).split(" | ")
    noise = next(r for r in block.splitlines() if r.startswith("| noise |")).split(" | ")
    control = next(r for r in block.splitlines() if r.startswith("| control |")).split(" | ")
    steps = sorted(int(x) for x in re.findall(r"s\d: (\d+)", head[2]))
    assert head[1] == "8/8 [0.63, 1.00]" and f"falls {head[1]}, at steps {steps[0]}-{steps[-1]}" in row
    assert f"(median {statistics.median(steps):g})" in row
    assert all(s > 500 for s in steps) and "**head: a reproducible late fall**" in row
    assert noise[1] == "0/8 [0.00, 0.37]" and "noise: 0/8 [0.00, 0.37]" in row and "**noise: no late fall**" in row
    assert control[1] == "0/8 [0.00, 0.37]" and "Controls 0/8" in row
    lvl = lambda cell: f"{float(cell.split()[0]):.3f}"  # noqa: E731
    assert f"at {lvl(head[3])} (steps 25-500; control {lvl(control[3])})" in row
    assert f"accuracy {lvl(head[4])} over steps 500-1000" in row
    assert f"ended at {noise[-1].split()[0]}" in row
    med = [float(r.split(" | ")[2]) for r in k3.splitlines()[2:]]
    mean = [float(r.split(" | ")[3]) for r in k3.splitlines()[2:]]
    assert len(med) == 8 and f"median per-step k3 was {min(med):.3f}-{max(med):.3f} (mean {min(mean):.3f}-{max(mean):.3f})" in row
    cost = next(r for r in block.split("**accuracy level, steps 1500-2000**")[1].splitlines() if r.startswith("| noise |"))
    assert f"it cost {-_numbers(cost.split(' | ')[2])[0]:.3f} over steps 1500-2000" in row


def test_ew2_verdict_row_and_metrics_doc_quote_the_block():
    """The EW2 row and docs/metrics.md round the early-warning-2 block: no rule passes; k3_level's
    detections, Holm p and false-alarm rate; the rule shipped before, counted the same way."""
    from timlab.findings import INDEX, block_text

    block = block_text(INDEX, "early-warning-2")
    row, doc = _row("| EW2 |"), (REPO / "docs/metrics.md").read_text()
    assert "No rule passes the registered rule" in block and "**no rule passes**" in row
    k3 = next(r for r in block.splitlines() if r.startswith("| k3_level |")).split(" | ")
    caught, holm_p, rate = k3[4].split()[0], k3[10], k3[7].split()[0]
    assert f"caught {caught} held-out falls {k3[4].split(' ', 1)[1]}" in row and f"Holm p = {holm_p}" in row
    assert f"at {rate} false alarms per 10,000 watched steps" in row
    assert f"caught {caught.replace('/', ' of ')}" in doc
    assert f"(Holm p = {holm_p}) at {rate} false alarms per 10,000 steps" in doc
    shipped = next(r for r in block.splitlines() if r.startswith("Descriptive"))
    det = re.search(r"falls detected with lead (\d+/\d+)", shipped).group(1)
    fa = re.search(r"non-falling runs ([0-9.]+) \[", shipped).group(1)
    most = re.search(r"at most (\d+) in one control", shipped).group(1)
    assert f"{det} caught, {fa} false alarms per 10,000 watched steps, up to {most} alarms" in row
    assert f"caught {det.replace('/', ' of ')} at {fa} false alarms per 10,000 watched steps" in doc
    assert f"fired up to {most} times in one 2,000-step control" in doc
