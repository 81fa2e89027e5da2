"""Study E3's pre-registered analysis (the study file docs/examples/studies/e3.yaml, a grouped
study: one group per level) and E3c's out-of-sample test (docs/examples/studies/e3c.yaml),
checked on synthetic sweeps with planted effects: the registered spec's 75 runs
(docs/examples/e3.yaml), each a run directory as the trainer leaves it (metrics.parquet: step 0
holds the start's evaluation, steps 1-150 a training row each, evaluations every 25 steps;
status.json; the sweep's index.parquet)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from script_loader import REPO, load_script
from study_sweep import write_sweep
from timlab.experiments.studies.engine import analyze, figure, planned_runs, predictions
from timlab.experiments.studies.registration import StudyError, freeze, load_study, study_from_dict
from timlab.experiments.studies.fits import fit_length, threshold_k3, threshold_section
from timlab.experiments.studies.text import fmt
from timlab.experiments.sweeps.runner import load_spec

E3 = load_script("e3_tables")
STUDIES = REPO / "docs" / "examples" / "studies"
E3_STUDY = load_study(STUDIES / "e3.yaml")
E3B_STUDY = load_study(STUDIES / "e3b.yaml")
SPEC = REPO / "docs" / "examples" / "e3.yaml"
WANT = [c.name for c in load_spec(SPEC).conditions]
STEPS, EVERY = E3_STUDY.steps, 25
LENGTH = {0: 23.0, 1: 62.0, 2: 150.0, 3: 300.0}
"""Planted mean sampled response length per level (the fit's T)."""
K3 = {"fp8": 3e-4, "stale_1": 6e-4, "head_0.175": 1e-3, "head_0.49": 1e-2}
"""Planted realized k3 per arm, scaled per level by ``K3_LEVEL`` so that k3 and T are not collinear."""
K3_B = {"head_0.52": 1e-3, "head_0.72": 3e-3, "head_0.95": 1e-2}
"""The same for E3b's and E3c's arms."""
K3_LEVEL = {0: 1.0, 1: 0.6, 2: 1.5, 3: 0.8}
C = 4.0
"""Planted level loss: C * k3 * (T / 100)^RHO of accuracy over steps 25-150 (rho planted)."""


def loss(level: int, arm: str, rho: float, k3s: dict = K3) -> float:
    k3 = k3s[arm] * K3_LEVEL[level]
    return C * k3 * (LENGTH[level] / 100) ** rho


def _metrics(level: int, arm: str, seed: int, *, rho: float = 2.0, start=(0.99, -0.05), k3s: dict = K3,
             acc_sd: float = 1e-5, cost: float = 1.0) -> pd.DataFrame:
    rng = np.random.default_rng([level, list(k3s).index(arm) + 1 if arm in k3s else 0, seed])
    steps = np.arange(1, STEPS + 1)  # (150,)
    ev = np.arange(0, STEPS + 1, EVERY)  # (7,)
    acc = 0.99 + rng.normal(0, acc_sd, ev.size)
    gold = -0.05 + rng.normal(0, 1e-3, ev.size)
    if arm != "control":
        acc[ev >= 25] -= cost * loss(level, arm, rho, k3s)
        gold[ev >= 25] -= cost * 10 * loss(level, arm, rho, k3s)
    acc[0], gold[0] = start
    k3 = np.zeros(steps.size) if arm == "control" else \
        k3s[arm] * K3_LEVEL[level] * np.exp(rng.normal(0, 0.02, steps.size))
    train = pd.DataFrame({"step": steps, "rollout_corr/k3_kl": k3,
                          "mismatch/frac_bitwise_equal": 1.0 if arm == "control" else 0.2,
                          "train/response_length_mean": LENGTH[level] * np.exp(rng.normal(0, 0.01, steps.size)),
                          "train/step_time_s": 0.3})
    val = pd.DataFrame({"step": ev, "val/accuracy": acc, "val/gold_logprob": gold})
    m = val.merge(train, on="step", how="outer").sort_values("step")
    return m[["step"] + sorted(c for c in m.columns if c != "step")]  # the column order MetricsLog writes


RUN_IDS = {p.name: p.run_id for s in (E3_STUDY, E3B_STUDY) for p in planned_runs(s)}
"""Each condition's run directory as the study files' specs expand it (E3c's: the script's default)."""


def _sweep(root, names=WANT, *, states: dict | None = None, metrics=_metrics):
    """A sweep directory holding the runs ``names`` (finished at step 150 unless ``states`` says
    otherwise: name -> (state, last step))."""
    return write_sweep(root, names, lambda name: metrics(*cell(name), int(name.rsplit("_s", 1)[1])), STEPS,
                       states=states, run_ids=RUN_IDS)


def _study(root, study=E3_STUDY) -> str:
    """The study file's analysis of the sweep at ``root``."""
    return analyze(study, root).text


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return _sweep(tmp_path_factory.mktemp("e3"))


@pytest.fixture(scope="module")
def analysis(sweep):
    return _study(sweep)


def _row(text: str, section: str, level: int, arm: str) -> str:
    part = text.split(f"**{section}")[1].split("\n\n", 2)[1]
    return next(line for line in part.splitlines() if line.startswith(f"| {level} | {arm} |"))


def cell(condition: str) -> tuple[int, str]:
    """``v2_head_0.49_s3`` -> (2, 'head_0.49'): the (level, arm) of a condition, as the study files'
    ``arm_pattern`` reads it."""
    m = re.fullmatch(E3_STUDY.arm_pattern, condition)
    if m is None:
        raise ValueError(f"condition {condition!r}: expected v<level>_<arm>_s<seed>")
    return int(m["group"]), m["arm"]


def test_the_spec_is_the_registered_design():
    assert len(WANT) == 75 and {cell(c) for c in WANT} == {(lv, a) for lv in range(3) for a in ("control", *K3)}
    assert cell("v2_head_0.49_s3") == (2, "head_0.49")
    with pytest.raises(ValueError, match="v<level>_<arm>_s<seed>"):
        cell("control_s0")


def test_threshold_fit_values_as_registered():
    # FINDINGS: "0.28, 0.043, 8.2e-3 and 2.2e-3 at T = 22, 61, 149, 302"
    got = [threshold_k3(E3.ANSWER_TOKENS[lv]) for lv in range(4)]
    assert got == pytest.approx([0.28, 0.043, 8.2e-3, 2.2e-3], rel=0.03)
    assert threshold_k3(465) == pytest.approx(1e-3)
    fit = next(f for f in E3_STUDY.fits if f.kind == "threshold")  # the study file registers the same law
    assert (fit.k3_star, fit.t_star, fit.exponent) == (1e-3, 465.0, -1.85)
    assert dict(fit.tokens) == {str(lv): float(E3.ANSWER_TOKENS[lv]) for lv in range(3)}


def test_fit_length_recovers_planted_exponents():
    rng = np.random.default_rng(0)
    k3 = np.exp(rng.uniform(-9, -4, 9))
    T = np.repeat([22.0, 61.0, 149.0], 3)
    ex = -0.7 * k3 ** 0.8 * T ** 1.6
    a, alpha, beta = fit_length(k3, T, ex, np.repeat([0, 1, 2], 3))
    assert (a, alpha, beta) == pytest.approx((math.log(0.7), 0.8, 1.6), abs=1e-9)
    # too few negative cells, one level only, or k3 and T collinear: no fit
    assert fit_length(k3, T, np.where(np.arange(9) < 6, 1.0, ex), np.repeat([0, 1, 2], 3)) is None
    assert fit_length(k3[:3], T[:3], ex[:3], np.zeros(3)) is None
    assert fit_length(k3[6:], np.full(3, 149.0), ex[6:], np.array([2, 2, 2])) is None
    T2 = np.repeat([22.0, 61.0], 3)
    assert fit_length(T2 * 1e-5, T2, -(T2 * 1e-5) * T2, np.repeat([0, 1], 3)) is None  # log k3 = log T + const


def test_valid_study_erodes_where_planted(analysis):
    for lv in range(3):
        assert f"Validity, level {lv}: control guard (k3 exactly 0, every token bitwise equal, every step) held" in analysis
        assert f"level {lv}" in analysis and "VOID" not in analysis
    # the largest planted loss (level 2, head 0.49: 4 * 1.5e-2 * 2.25 = 0.135) erodes the accuracy level
    r = _row(analysis, "mean accuracy, evaluations", 2, "head_0.49")
    assert "**erodes**" in r and f"{-loss(2, 'head_0.49', 2.0):+.4f}" in r
    # the smallest (level 1, fp8: 4 * 1.8e-4 * 0.384 = 2.8e-4) is still separable with this little noise
    assert "| 1 | fp8 |" in analysis
    # realized k3 and T as planted
    k = _row(analysis, "Realized mismatch", 2, "head_0.49")
    assert "| 0.015 [" in k and "| 150.0 |" in k


def test_length_fit_decides_the_planted_shape(analysis):
    fit = analysis.split("**Length fit, mean accuracy (primary)**: ")[1].split("\n")[0]
    assert "over 12 cells" in fit and "**T^2 * k3**" in fit
    alpha = float(fit.split("alpha = ")[1].split(",")[0])
    beta = float(fit.split("beta = ")[1].split(",")[0])
    assert alpha == pytest.approx(1.0, abs=0.05) and beta == pytest.approx(2.0, abs=0.1)
    # extrapolation at k3 1e-3: C * 1e-3 * (T / 100)^2 -> 0.4 at T = 1,000
    assert "| 1,000 | 0.39" in analysis and "| 8,000 |" in analysis


def test_planted_linear_length_decides_t_k3(tmp_path):
    root = _sweep(tmp_path / "lin", metrics=lambda lv, a, s: _metrics(lv, a, s, rho=1.0))
    text = _study(root)
    fit = text.split("**Length fit, mean accuracy (primary)**: ")[1].split("\n")[0]
    assert "**T * k3**" in fit, fit


def test_no_fit_without_enough_negative_cells(tmp_path):
    flat = _sweep(tmp_path / "flat", metrics=lambda lv, a, s: _metrics(lv, a, s, cost=-1.0))  # every arm gains
    text = _study(flat)
    assert "0 cells with a negative mean excess over 0 levels (needs 4 over 2" in text
    assert "no detectable erosion (costs none: the interval [" in text and "**erodes**" not in text


def test_threshold_test_counts_agreeing_cells():
    # plant falls: level 2 head 0.49 (k3 1.5e-2 > k3*(149) = 8.2e-3) falls in 3 of 5 seeds, level 0
    # fp8 (3e-4 < 0.28) in 4 of 5 (disagrees); every other cell none (agrees when below)
    fell = {(2, "head_0.49"): 3, (0, "fp8"): 4}
    col = {(lv, a): {"k3": np.full(5, K3[a] * K3_LEVEL[lv]), "fell": (np.arange(5) < fell.get((lv, a), 0)) * 1.0}
           for lv in range(3) for a in K3}
    text = "\n".join(threshold_section(col, list(col), E3.ANSWER_TOKENS, title="T", note=" (n)"))
    assert text.startswith("**T** (n)\n\n| level | T | k3*(T) | arm | realized k3 | above k3* | falls | agrees |")
    assert "| 2 | 149 | 8.2e-03 | head_0.49 | 0.015 | yes | 3/5 | yes |" in text
    assert "| 0 | 22 | 0.283 | fp8 | 3.0e-04 | no | 4/5 | no |" in text
    assert "| 1 | 61 | 0.043 | head_0.49 | 6.0e-03 | no | 0/5 | yes |" in text
    assert "Cells that agree with the threshold fit: 11 of 12." in text


def test_incomplete_sweeps_are_refused(tmp_path):
    root = _sweep(tmp_path / "part", WANT[:40], states={WANT[39]: ("running", 60)})
    text = _study(root)
    assert text.startswith("INCOMPLETE: 39 of 75 runs finished at step 150") and "no interim analysis" in text
    assert "v2_head_0.49 seeds 2-4" in text


def test_a_guard_trip_voids_the_study_and_a_differing_start_voids_its_level(tmp_path):
    root = _sweep(tmp_path / "trip", WANT[:5], states={"v0_control_s0": ("guard_failed", 12)})
    assert _study(root).startswith("VOID: the zero-mismatch guard stopped v0_control_s0")
    odd = lambda lv, a, s: _metrics(lv, a, s, start=(0.5, -0.05) if (lv, a, s) == (1, "fp8", 2) else (0.99, -0.05))  # noqa: E731
    text = _study(_sweep(tmp_path / "odd", metrics=odd))
    assert "Validity, level 1:" in text and "DIFFERS between its runs (2 distinct): VOID" in text
    assert "| 1 | fp8 |" not in text and "over 8 cells" in text  # level 1 left out of the tables and the fit
    low = lambda lv, a, s: _metrics(lv, a, s, start=(0.93, -0.05) if lv == 2 else (0.99, -0.05))  # noqa: E731
    text = _study(_sweep(tmp_path / "low", metrics=low))
    assert "Validity, level 2:" in text and "(accuracy 0.930, gold log-prob -0.050), below the bar 0.95: VOID" in text
    assert "Validity, level 0:" in text and text.count(": VALID.") == 2 and "| 2 | head_0.49 |" not in text
    none = _sweep(tmp_path / "none", metrics=lambda lv, a, s: _metrics(lv, a, s, start=(0.5, -0.05)))
    text = _study(none)  # every level void: tables empty, no fit
    assert text.count("below the bar 0.95: VOID") == 3 and "0 cells with a negative mean excess over 0 levels" in text


def test_figure_of_a_complete_sweep_and_refusal_of_an_incomplete_one(sweep, tmp_path):
    out = figure(E3_STUDY, tmp_path / "e3.png", sweep)  # the length fit's cells against k3, T * k3, T^2 * k3
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    part = _sweep(tmp_path / "part", WANT[:3])
    with pytest.raises(StudyError, match="no figure: INCOMPLETE: 3 of 75"):
        figure(E3_STUDY, tmp_path / "no.png", part)
    d = yaml.safe_load((STUDIES / "e3.yaml").read_text())
    d["fits"] = d["fits"][2:]  # the threshold test alone: no length fit to plot
    with pytest.raises(StudyError, match="a grouped study's figure plots its length fit, and it has none"):
        figure(study_from_dict(d, root=STUDIES, source="e3.yaml"), tmp_path / "no.png", sweep)


def test_e3b_spec_is_analysed_by_the_same_code(tmp_path):
    spec = REPO / "docs" / "examples" / "e3b.yaml"
    want = [c.name for c in load_spec(spec).conditions]
    assert len(want) == 96 and {cell(c) for c in want} == {
        (lv, a) for lv in range(3) for a in ("control", "head_0.52", "head_0.72", "head_0.95")}
    assert [int(c.rsplit("_s", 1)[1]) for c in want[:12]] == [0] * 12  # seed by seed
    assert _study(tmp_path / "not_started", E3B_STUDY).startswith("INCOMPLETE: 0 of 96 runs finished at step 150")


def test_study_check_names_the_levels(tmp_path, capsys):
    from timlab import cli

    path = REPO / "docs" / "examples" / "studies" / "e3b.yaml"
    assert cli.main(["study", "check", str(path), "--out", str(tmp_path / "none")]) == 0
    text = capsys.readouterr().out
    assert "sweep: 96 runs, 150 steps each; arms: control (24), head_0.52 (24), head_0.72 (24), head_0.95 (24)" in text
    assert "  levels: 0, 1, 2 (each with its own control, validity check and Holm families)" in text


E3B_SPEC, E3C_SPEC = REPO / "docs" / "examples" / "e3b.yaml", REPO / "docs" / "examples" / "e3c.yaml"
E3B_WANT = [c.name for c in load_spec(E3B_SPEC).conditions]
E3C_WANT = [c.name for c in load_spec(E3C_SPEC).conditions]
E3C_STUDY = load_study(STUDIES / "e3c.yaml")
RUN_IDS.update({p.name: p.run_id for p in planned_runs(E3C_STUDY)})


def _planted(root, names, rho: float):
    """E3b's or E3c's runs with the loss C * k3 * (T / 100)^rho planted, accuracy noise 2e-3 per evaluation."""
    return _sweep(root, names, metrics=lambda lv, a, s: _metrics(lv, a, s, rho=rho, k3s=K3_B, acc_sd=2e-3))


@pytest.fixture(scope="module")
def fit_linear(tmp_path_factory):
    return _planted(tmp_path_factory.mktemp("e3b_lin") / "sweeps" / "e3b", E3B_WANT, 1.0)


def _e3c(root, fit, names=E3C_WANT, rho: float = 1.0) -> str:
    """E3c's analysis (its study file) with its sweep planted at ``root``/sweeps/e3c and E3b's (the
    fit's) at ``fit``, linked as ``root``/sweeps/e3b."""
    (root / "sweeps").mkdir(parents=True)
    (root / "sweeps" / "e3b").symlink_to(fit, target_is_directory=True)
    freeze(E3C_STUDY, root / "sweeps" / "e3c")  # E3c has no runs: its first run freezes it
    _planted(root / "sweeps" / "e3c", names, rho)
    return analyze(E3C_STUDY, root=root).text


def _decision(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("Level 3, head_0.72: "))


def test_e3c_spec_is_level_3_at_e3bs_middle_dose():
    assert len(E3C_WANT) == 16 and {cell(c) for c in E3C_WANT} == {(3, "control"), (3, "head_0.72")}
    assert [int(c.rsplit("_s", 1)[1]) for c in E3C_WANT] == [s for s in range(8) for _ in range(2)]
    fit = next(f for f in E3C_STUDY.fits if f.kind == "predict")  # the registered predictions' table
    assert (fit.at_T, fit.at_k3, fit.rho, Path(fit.study).name) == (300.0, (1e-3, 1.3e-3, 1.6e-3), (1.0, 2.0), "e3b.yaml")


def test_out_of_sample_confirms_the_planted_linear_law(fit_linear, tmp_path):
    text = _e3c(tmp_path, fit_linear)
    assert text.count("VALID.") == 4 and text.startswith("Validity, level 3:")
    assert "The fit's validity, level 0: control guard" in text
    assert _decision(text) == ("Level 3, head_0.72: **T * k3** holds out of sample; "
                               "the registered fit's extrapolation: **holds**.")
    row = next(line for line in text.splitlines() if line.startswith("| 3 | head_0.72 |") and "| T * k3 |" in line)
    # planted loss at level 3: 4 * 3e-3 * 0.8 * 3 = 0.0288; the prediction is within the noise of it
    measured = float(row.split("| 300.0 | ")[1].split(" [")[0])
    assert measured == pytest.approx(loss(3, "head_0.72", 1.0, K3_B), abs=2e-3) and row.endswith("| consistent |")
    predicted = float(row.split("| T * k3 | ")[1].split(" [")[0])
    assert predicted == pytest.approx(loss(3, "head_0.72", 1.0, K3_B), rel=0.05)
    assert "**Length fit, mean accuracy over the fit's and the test's levels (descriptive)**" in text
    assert "over 10 cells" in text and "**T * k3**" in text.split("levels (descriptive)**")[1]
    assert "| 3 | 302 | 2.2e-03 | head_0.72 |" in text  # the threshold test at level 3's worked answer


def test_prediction_figure_draws_the_numbers_the_test_prints(fit_linear, tmp_path, monkeypatch):
    """``timlab study figure`` on E3c: the fitted cells and the test cell against each dose, and the
    test's measured and predicted losses, the same numbers as the analysis' table."""
    from timlab.experiments.studies.engine import _cells, _fitted_study, valid_columns
    from timlab.experiments.studies.fits import FREE
    from timlab.experiments.studies.prediction_figure import draw, prediction_panels

    text = _e3c(tmp_path, fit_linear)
    monkeypatch.chdir(tmp_path)
    f = next(f for f in E3C_STUDY.fits if f.kind == "predict")
    other, _, ocols = _fitted_study(f, Path("."))
    (p,) = prediction_panels(E3C_STUDY, *_cells(E3C_STUDY, valid_columns(E3C_STUDY)), [(f, other.name, *_cells(other, ocols))])
    assert len(p.fitted) == 9 and all(c.loss > 0 and c.lo < c.loss < c.hi for c in p.fitted)
    assert [r for r, _ in p.doses] == [1.0, 2.0] and p.doses[0][1][1] == pytest.approx(1.0, abs=0.1)  # T * k3's exponent
    (c,) = p.tested
    assert (c.group, c.arm, round(c.T, 1)) == ("3", "head_0.72", 300.0)
    for q in c.predicted:  # each hypothesis' row of the printed table holds the figure's numbers
        row = next(line for line in text.splitlines() if line.startswith("| 3 | head_0.72 |") and f"| {q.hypothesis} |" in line)
        assert f"| {fmt(c.loss)} [{fmt(c.lo)}, {fmt(c.hi)}] |" in row
        assert f"| {fmt(q.point)} [{fmt(q.lo)}, {fmt(q.hi)}] | {q.d:+.4f} [{q.d_lo:+.4f}, {q.d_hi:+.4f}] | {q.verdict} |" in row
    assert {q.hypothesis: q.verdict for q in c.predicted} == {FREE: "consistent", "T * k3": "consistent",
                                                              "T^2 * k3": "over-predicts (the cost is smaller)"}
    fig = draw(E3C_STUDY, [p])
    assert len(fig.axes) == 3 and "T^2 * k3: over-predicts" in [t.get_text() for t in fig.axes[2].get_yticklabels()]
    out = figure(E3C_STUDY, tmp_path / "e3c.png")
    assert out.stat().st_size > 10_000


def test_prediction_figure_refuses_an_incomplete_fit(fit_linear, tmp_path, monkeypatch):
    fit_part = _planted(tmp_path / "fit_part" / "e3b", E3B_WANT[:90], 1.0)
    _e3c(tmp_path / "b", fit_part)
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(StudyError, match="e3c.yaml: no figure: The fit's study e3b is not complete \\(90 of 96 runs"):
        figure(E3C_STUDY, tmp_path / "x.png")


def test_prediction_table_of_a_planted_linear_law(fit_linear, tmp_path):
    d = yaml.safe_load((STUDIES / "e3c.yaml").read_text())
    d["fits"][0]["at_k3"] = [0.001, 0.002]
    study = study_from_dict(d, root=STUDIES, source="e3c.yaml")
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "e3b").symlink_to(fit_linear, target_is_directory=True)
    rows = predictions(study, root=tmp_path).splitlines()
    assert rows[0] == "| hypothesis fitted on the 9 cells | k3 1.0e-03 | k3 2.0e-03 |"
    lin = next(r for r in rows if r.startswith("| one power of T * k3 (exponent "))
    sq = next(r for r in rows if r.startswith("| one power of T^2 * k3 (exponent "))
    assert float(lin.split("(exponent ")[1].split(")")[0]) == pytest.approx(1.0, abs=0.1)
    # planted loss C * k3 * T / 100 = 4 * 1e-3 * 3 = 0.012 at T = 300; the square law over-predicts it
    assert float(lin.split("| ")[2].split(" [")[0]) == pytest.approx(0.012, rel=0.1)
    assert float(sq.split("| ")[2].split(" [")[0]) > 0.02
    assert predictions(study, root=tmp_path / "none") == ("The fit's study e3b is not complete (0 of 96 runs finished "
                                                          "at step 150): no prediction is tested (no interim analysis).")


def test_out_of_sample_catches_a_cost_larger_than_the_law(fit_linear, tmp_path):
    text = _e3c(tmp_path, fit_linear, rho=2.0)  # level 3 pays (T / 100)^2, 3x the linear law
    d = _decision(text)
    assert "the registered fit's extrapolation: **under-predicts (the cost is larger)**" in d
    row = next(line for line in text.splitlines() if line.startswith("| 3 | head_0.72 |") and "| T * k3 |" in line)
    assert row.endswith("| under-predicts (the cost is larger) |") and "| 0.086 [" in row


def test_out_of_sample_decides_a_planted_square_law(tmp_path):
    fit = _planted(tmp_path / "fit" / "e3b", E3B_WANT, 2.0)
    text = _e3c(tmp_path / "test", fit, rho=2.0)
    assert _decision(text) == ("Level 3, head_0.72: **T^2 * k3** holds out of sample; "
                               "the registered fit's extrapolation: **holds**.")


def test_out_of_sample_refuses_incomplete_sweeps_and_a_seen_level(fit_linear, tmp_path):
    text = _e3c(tmp_path / "a", fit_linear, names=E3C_WANT[:5])
    assert text.startswith("INCOMPLETE: 5 of 16 runs finished at step 150") and "no interim analysis" in text
    fit_part = _planted(tmp_path / "fit_part" / "e3b", E3B_WANT[:90], 1.0)
    text = _e3c(tmp_path / "b", fit_part)
    assert "The fit's study e3b is not complete (90 of 96 runs finished at step 150): no prediction is tested" in text
    assert "**The out-of-sample test**" not in text and "| 3 | head_0.72 |" in text  # the test level's own tables stand
    fit_void = _sweep(tmp_path / "fit_void" / "e3b", E3B_WANT, states={"v1_control_s4": ("guard_failed", 30)},
                      metrics=lambda lv, a, s: _metrics(lv, a, s, rho=1.0, k3s=K3_B))
    text = _e3c(tmp_path / "v", fit_void)
    assert "The fit's study e3b is void: the zero-mismatch guard stopped v1_control_s4; no prediction is tested." in text
    d = yaml.safe_load((STUDIES / "e3b.yaml").read_text())  # E3b "predicting" its own levels
    d["fits"] = [dict(E3C_FIT, study="e3b.yaml")]
    d["frozen"] = study_from_dict({k: v for k, v in d.items() if k != "frozen"}, root=STUDIES).hash
    (tmp_path / "c" / "sweeps").mkdir(parents=True)
    (tmp_path / "c" / "sweeps" / "e3b").symlink_to(fit_linear, target_is_directory=True)
    with pytest.raises(StudyError, match="the test's levels must be levels e3b did not see \\(both have 0, 1, 2\\)"):
        analyze(study_from_dict(d, root=STUDIES, source="self.yaml"), root=tmp_path / "c")


E3C_FIT = yaml.safe_load((STUDIES / "e3c.yaml").read_text())["fits"][0]
"""E3c's registered ``predict`` fit, as the file writes it."""


E3D_SPEC = REPO / "docs" / "examples" / "e3d.yaml"
E3D_WANT = [c.name for c in load_spec(E3D_SPEC).conditions]
"""Study E3d's runs (its analysis is a study file: tests/test_study.py)."""


def test_e3d_spec_extends_e3bs_level_1_largest_dose():
    assert len(E3D_WANT) == 16 and {cell(c) for c in E3D_WANT} == {(1, "control"), (1, "head_0.95")}
    assert set(E3D_WANT) <= set(E3B_WANT)  # the same names as E3b's runs, for the repeat check
    assert [int(c.rsplit("_s", 1)[1]) for c in E3D_WANT] == [s for s in range(8) for _ in range(2)]
