"""Study E2's study file (docs/examples/studies/e2.yaml) on a synthetic sweep of all 120 runs with
planted effects: run directories written as the trainer writes them (metrics.parquet: step 0 holds
the start's evaluation, steps 1-400 a training row each, evaluations every 20 steps; status.json;
the sweep's index.parquet). It plants what each feature E2 added to the engine must find: explicit
comparisons against each LR arm's own control with every reference's row (``reference_row:
each``), several controls in the validity check, a per-comparison name, a ``log`` endpoint compared
as a ratio of geometric means with a ratio bar (``ratio_bound``), the ``log_slope`` and
``fall_step`` statistics, the ``seeds`` column, the ``growth`` decision and the ``signals`` fit."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import re
import shutil
from pathlib import Path

from study_sweep import write_sweep
from timlab.experiments.studies.engine import analyze, planned_runs
from timlab.experiments.studies.registration import load_study
from timlab.experiments.studies import blocks, engine
from timlab.experiments.studies.signals import rise_step, run_signals, signals_section, vs_start

E2 = load_study(Path(__file__).resolve().parents[1] / "docs" / "examples" / "studies" / "e2.yaml")
ARMS = ("control", "stale_2", "stale_4", "ramp", "const")
LRS = ("lr2e-4", "lr1e-4", "ld")
NAME = re.compile(r"(?P<arm>.+)_(?P<lr>lr2e-4|lr1e-4|ld)_s(?P<seed>\d+)")

STEPS, EVERY = 400, 20
K3 = {("stale_2", "lr2e-4"): 6e-3, ("stale_2", "lr1e-4"): 1e-3, ("stale_2", "ld"): 2e-3,
      ("stale_4", "lr2e-4"): 0.03, ("stale_4", "lr1e-4"): 5e-3, ("stale_4", "ld"): 7.5e-3}
"""Planted realized k3: halving the LR cuts stale 2 and 4 six-fold (below the LR's square, 0.25),
length decay three- and four-fold (below 1, not below its square 0.22)."""
RAMP0, RAMP1, CONST_DOSE, CONST_K3 = 0.135, 0.6, 0.37, 8.7e-3
LATE_FALL = {("ramp", "lr2e-4"): (range(5), 260, 40), ("stale_2", "ld"): (range(3), 300, 20)}
"""(seeds, fall step F, the lead N at which grad norm rises before it): the planted late falls."""
EARLY_FALL = ("stale_4", "lr2e-4")
"""Falls at step 20 in every seed (as the probe's stale 4 at lr 2e-4), grad norm x4 from step 11."""
RAMP_LD_SLOPES = (-0.08, 0.04)
"""Per 100 steps after step 200, alternating over the seeds of ramp at length decay: a mean of
-0.02 with seed noise too large to call (Q1 undecided there)."""


def parse(name: str) -> tuple[str, str, int]:
    m = NAME.fullmatch(name)
    return m["arm"], m["lr"], int(m["seed"])


def _metrics(arm: str, lr: str, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng([ARMS.index(arm), LRS.index(lr), seed])
    steps = np.arange(1, STEPS + 1)  # (400,)
    ev = np.arange(0, STEPS + 1, EVERY)  # (21,)
    acc = 0.965 + rng.normal(0, 0.003, ev.size)
    acc[0] = 0.965  # step 0: the export's score, the same in every run
    gold = -0.32 + rng.normal(0, 0.005, ev.size)
    grad = np.exp(rng.normal(0, 0.01, steps.size))
    length = 23 * np.exp(rng.normal(0, 0.01, steps.size))
    noise = np.exp(rng.normal(0, 0.1) + rng.normal(0, 0.05, steps.size))
    mag = np.zeros(steps.size)
    if arm == "control":
        k3 = np.zeros(steps.size)
    elif arm == "ramp":  # geometric schedule; k3 planted proportional to magnitude^2
        mag = RAMP0 * (RAMP1 / RAMP0) ** ((steps - 1) / (STEPS - 1))
        k3 = 9.9e-4 * (mag / RAMP0) ** 2 * noise
    elif arm == "const":
        mag[:], k3 = CONST_DOSE, CONST_K3 * noise
    else:
        mag[:], k3 = float(arm.split("_")[1]), K3[arm, lr] * noise
        k3[0] = 0.0  # step 1 of a stale run: the weights have not moved yet
    if (arm, lr) == ("stale_2", "lr2e-4"):
        acc[ev >= 20] -= 0.03  # a level loss
    if (arm, lr) == ("ramp", "ld"):
        acc += RAMP_LD_SLOPES[seed % 2] * np.clip(ev - 200, 0, None) / 100
    if (arm, lr) in LATE_FALL and seed in LATE_FALL[arm, lr][0]:
        _, f, lead = LATE_FALL[arm, lr]
        acc[ev >= f], gold[ev >= f] = 0.2, -3.0
        grad[steps >= f - lead - 2] *= 3  # the 10-step trailing mean passes 1.5x two steps later
    if (arm, lr) == EARLY_FALL:
        acc[ev >= 20], gold[ev >= 20] = 0.3, -3.0
        grad[steps >= 11] *= 4
    train = pd.DataFrame({"step": steps, "rollout_corr/k3_kl": k3, "rollout_corr/log_ppl_abs_diff": 0.1 * np.sqrt(k3),
                          "mismatch/frac_bitwise_equal": 1.0 if arm == "control" else 0.01, "mismatch/magnitude": mag,
                          "train/grad_norm": grad, "train/response_length_mean": length, "train/loss": 0.0,
                          "train/lr": 2e-4, "train/step_time_s": 0.3})
    val = pd.DataFrame({"step": ev, "val/accuracy": acc, "val/gold_logprob": gold})
    m = val.merge(train, on="step", how="outer").sort_values("step")
    return m[["step"] + sorted(c for c in m.columns if c != "step")]  # the column order MetricsLog writes


def _sweep(root, names=None, *, states: dict | None = None):
    """A sweep directory holding the runs ``names`` (default: all 120; finished at step 400 unless
    ``states`` says otherwise: name -> (state, last step)), under the run ids the spec expands to."""
    ids = {p.name: p.run_id for p in planned_runs(E2)}
    return write_sweep(root, names or list(ids), lambda name: _metrics(*parse(name)), STEPS, states=states,
                       run_ids=ids)


def _columns(out) -> dict:
    """{condition: {endpoint or signal key: values over its 8 seeds}}: what the engine's tables read."""
    dirs = blocks.block_dirs(E2, out)
    return engine._columns(E2, engine._records(E2, dirs, planned_runs(E2), blocks.study_states(planned_runs(E2), dirs))[""])


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = _sweep(tmp_path_factory.mktemp("e2") / "sweep")
    return out, _columns(out), analyze(E2, out)


def _rows(text: str, start: str, end: str) -> dict[str, str]:
    part = text.split(start)[1].split(end)[0]
    return {line.split(" | ")[0][2:]: line for line in part.splitlines() if line.startswith("| ")}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.split("|")[1:-1]]


# ------------------------------------------------------------------------------ one run
def test_rise_step_hand_counted():
    s = pd.Series(np.ones(200), index=np.arange(1, 201))
    s[s.index >= 150] = 3.0  # 10-step means: 1.4 at 151, 1.6 at 152 > 1.5 x median 1
    assert rise_step(s, 1.5) == 152
    s[s.index == 61] = 100.0  # one spike: its trailing mean 10.9 already at step 61
    assert rise_step(s, 1.5) == 61
    assert rise_step(pd.Series(np.zeros(200), index=np.arange(1, 201)), 1.5) is None  # a control's k3
    assert rise_step(pd.Series(np.ones(200), index=np.arange(1, 201)), 1.2) is None
    assert vs_start(s, 61) == pytest.approx((9 + 100) / 10)  # steps 52-61 over steps 1-5


def test_run_record_of_a_late_fall():
    r = engine.run_record(E2, _metrics("ramp", "lr2e-4", 0), diverged=False)
    assert r["fall_step"] == 260 and r["fell"] == 1 and r["rise:grad norm"] == 220  # lead 40
    # flat against its schedule, and no rise in length
    assert math.isnan(r["rise:response length"]) and math.isnan(r["rise:k3 / magnitude^2"])
    assert r["rise:k3"] < 120  # k3 itself rises by design
    # log k3 grows as 2 ln(0.6 / 0.135) over 399 steps: 0.748 per 100 steps (log_slope)
    assert r["k3_trend"] == pytest.approx(200 * math.log(RAMP1 / RAMP0) / 399, abs=0.02)
    assert r["late_acc_level"] == pytest.approx((3 * 0.965 + 8 * 0.2) / 11, abs=0.003)
    assert r["log_k3"] == math.log(r["k3"])
    stale = engine.run_record(E2, _metrics("stale_2", "lr1e-4", 0), diverged=False)
    assert abs(stale["k3_trend"]) < 0.05 and math.isfinite(stale["k3_trend"])  # step 1's k3 = 0 left out
    assert math.isnan(stale["fall_step"]) and stale["k3"] == pytest.approx(1e-3, rel=0.2)
    assert math.isnan(stale["at_fall:grad norm"])  # no fall, no value at it


# ------------------------------------------------------------------------------ the analysis
def test_valid_study_and_primary_endpoints(study):
    _, col, res = study
    text = res.text
    assert res.status == "complete" and len(col) == 15 and all(len(c["acc_level"]) == 8 for c in col.values())
    # validity over the 24 runs of the 3 controls (validity: controls)
    assert text.splitlines()[0] == ("Validity: control guard (k3 exactly 0, every token bitwise equal, at each of the "
                                    "400 steps of all 24 control runs) held; control step-0 accuracy 0.965 (bar 0.95): VALID.")
    rows = _rows(text, "**mean accuracy, steps 60-400**", "**accuracy slope")
    assert len(rows) == 16  # header + 15 conditions: every LR arm's control row before its arms (reference_row: each)
    assert list(rows)[1:7] == ["control_lr2e-4", "stale_2_lr2e-4", "stale_4_lr2e-4", "ramp_lr2e-4", "const_lr2e-4",
                               "control_lr1e-4"]
    assert rows["control_ld"].startswith("| control_ld | 0.000 | +0.9") and rows["control_ld"].endswith("| - | - | - | - |")
    floor = 2 / math.comb(16, 8)
    c = _cells(rows["stale_4_lr2e-4"])  # against its own LR arm's control, Holm over the 12
    assert float(c[3].split()[0]) == pytest.approx(-0.665, abs=0.01) and c[4] == f"{floor:.4f}" and c[6] == "**yes**"
    assert float(_cells(rows["stale_2_lr2e-4"])[3].split()[0]) == pytest.approx(-0.03, abs=0.003)
    assert "| no (costs at most" in rows["const_lr2e-4"]
    v = res.verdicts
    assert v["primary", "acc_level", "stale_4_lr2e-4"] is True  # against the family's own reference: its name
    assert v["primary", "acc_level", "const_lr1e-4 - control_lr1e-4"] is False
    assert v["primary", "acc_level", "stale_4_lr1e-4 - control_lr1e-4"] is False


def test_q1_a_late_fall_in_the_growing_arm_only(study):
    _, col, res = study
    text = res.text
    # the falls table (no title, arm_header condition) and the seeds column of a fall_step endpoint
    assert "| condition | falls (plateau rule) [95% Clopper-Pearson] | fall steps (seed: step) |\n|---|---:|---|" in text
    assert "| ramp_lr2e-4 | 5/8 [0.24, 0.91] | s0: 260, s1: 260, s2: 260, s3: 260, s4: 260 |" in text
    assert "| stale_4_lr2e-4 | 8/8 [0.63, 1.00] | " + ", ".join(f"s{s}: 20" for s in range(8)) + " |" in text
    assert "| const_ld | 0/8 [0.00, 0.37] | - |" in text
    # Q1's family: the ramp against the constant arm, rows named by LR arm (names)
    q1 = [x for x in text.split("**Q1")[1].split("| condition |")[0].splitlines() if x.startswith("| accuracy slope")]
    assert [_cells(x)[1] for x in q1] == ["lr 2e-4", "lr 1e-4", "length decay"]
    assert float(_cells(q1[0])[3].split()[0]) < -0.2 and float(_cells(q1[1])[5]) > 0.05
    # the growth decision: by falls at lr 2e-4, equivalent (within +-0.02) at lr 1e-4, too noisy at length decay
    growth = {_cells(x)[0]: _cells(x) for x in text.split("| growth matters (Q1) |")[1].split("**Q2")[0].splitlines()[2:]
              if x.startswith("| ")}
    assert growth["lr 2e-4"][3:] == ["yes", "no", "**yes**"]
    assert growth["lr 1e-4"][4:] == ["yes", "**no**"] and growth["length decay"][4:] == ["no", "**undecided**"]
    # planted realized k3 (steps 1-400): ramp 9.9e-4 x (19.75 - 1) / ln 19.75 = 6.2e-3 against 8.7e-3
    ratio = float(growth["lr 2e-4"][1].split("(")[1].rstrip(")"))
    assert ratio == pytest.approx(9.9e-4 * (19.75 - 1) / math.log(19.75) / 8.7e-3, rel=0.1)
    assert "UNMATCHED" not in text
    # the same decision with the constant arm's k3 three times higher: more than 2x apart, flagged
    skew = {a: ({**c, "k3_all": 3 * c["k3_all"]} if a == "const_ld" else c) for a, c in col.items()}
    cmps = {}
    engine._family(E2, next(f for f in E2.families if f.name == "q1"), {"": skew}, {}, cmps)
    rows = engine._growth(E2, next(f for f in E2.fits if f.kind == "growth"), skew, cmps)
    assert ["UNMATCHED" in x for x in rows[2:5]] == [False, False, True]


def test_q2_a_lower_lr_shrinks_the_stale_mismatch(study):
    _, _, res = study
    q2 = res.text.split("**Q2")[1].split("**Q3")[0]
    assert "| mismatch arm | LR arm | geometric-mean k3 [95% bootstrap] |" in q2
    assert "|---|---|---:|---:|---:|---:|---:|---|---|" in q2  # the comparison's name fills two columns
    rows = [_cells(x) for x in q2.splitlines() if x.startswith("| stale_2 |")]
    assert [r[1] for r in rows] == ["lr 2e-4", "lr 1e-4", "length decay"]  # the reference's row first
    assert rows[0][4:] == ["-"] * 5 and float(rows[0][2].split()[0]) == pytest.approx(6e-3, rel=0.15)
    ratio = {r[1]: [float(x.strip("[],")) for x in r[4].split()] for r in rows[1:]}
    assert ratio["lr 1e-4"][0] == pytest.approx(1 / 6, rel=0.15) and ratio["lr 1e-4"][2] < 0.25
    assert float(rows[1][6]) == pytest.approx(8 * 2 / math.comb(16, 8), abs=1e-4)  # Holm over 8 at the floor
    assert ratio["length decay"][0] == pytest.approx(1 / 3, rel=0.15) and ratio["length decay"][2] > 0.22
    # shrinks at both; below the squared LR ratio only at lr 1e-4 (ratio_bound, each comparison's bound)
    assert rows[1][7:] == ["**yes**", "**yes** (bar 0.25)"] and rows[2][7:] == ["**yes**", "no (bar 0.22)"]
    assert res.verdicts["q2", "log_k3", "ramp_lr1e-4 - ramp_lr2e-4"] is False  # head_perturb: the LR cannot touch it
    trend = next(r for r in (_cells(x) for x in q2.splitlines()) if r[:2] == ["ramp", "lr 2e-4"])[3]
    assert float(trend.split()[0]) == pytest.approx(200 * math.log(RAMP1 / RAMP0) / 399, abs=0.02)  # show_t


def test_q3_a_signal_that_rises_before_the_falls(study):
    _, _, res = study
    q3 = res.text.split("**Q3")[1]
    assert q3.startswith(": signals before falls.** Falls at F > 80: 8; early falls (F <= 80): 8. A signal rises at "
                         "the first step t > 60 whose 10-step trailing mean exceeds 1.5x its median over steps 21-60 "
                         "(1.2x for response length); lead = F - t.")
    assert "Conditions with a fall at F > 80: ramp_lr2e-4, stale_2_ld (false alarms are counted among their runs " \
           "that did not fall; k3 / magnitude^2: ramp arms only)." in q3
    rows = {_cells(x)[0]: _cells(x) for x in q3.split("| warns usefully |")[1].split("Early")[0].splitlines()[2:]
            if x.startswith("| ")}
    # grad norm warns all 8 late falls (leads 20 and 40) and never rises in the 8 runs that stay up
    assert rows["grad norm"] == ["grad norm", "8/8 [0.63, 1.00]", "+40 (+20 to +40)", "0/8 [0.00, 0.37]", "**yes**"]
    # k3 rises by design in every ramp run: warns the ramp's 5 falls, and alarms in its 3 survivors
    assert rows["k3"][1].startswith("5/8 ") and rows["k3"][3].startswith("3/8 ") and rows["k3"][4] == "no"
    assert rows["k3 / magnitude^2"][1].startswith("0/5 ") and rows["k3 / magnitude^2"][3].startswith("0/3 ")
    assert rows["response length"][1].startswith("0/8 ")
    early = [x for x in q3.split("Early falls")[1].splitlines() if x.startswith("| stale_4_lr2e-4 |")]
    assert len(early) == 8 and all(_cells(x)[2] == "20" and _cells(x)[7] == "n/a" for x in early)
    assert all(float(_cells(x)[5][:-1]) == pytest.approx(4, abs=0.05) for x in early)  # grad norm x4 at F vs steps 1-5


def test_few_falls_are_listed_one_by_one(study):
    _, col, _ = study
    fit = next(f for f in E2.fits if f.kind == "signals")
    col = {a: dict(c) for a, c in col.items()}
    col["ramp_lr2e-4"]["fall_step"] = np.array([260, 260] + [math.nan] * 6)  # 2 late falls kept, the others dropped
    col["stale_2_ld"]["fall_step"] = np.full(8, math.nan)
    text = "\n".join(signals_section(col, fit))
    assert "Fewer than 3 falls at F > 80: listed one by one, no rate computed." in text
    assert "| ramp_lr2e-4 | 0 | 260 | " in text and "| 220 (+40) |" in text and "falls warned" not in text


def test_incomplete_sweeps_are_refused(tmp_path):
    text = analyze(E2, tmp_path / "not_started").text
    assert text.startswith("INCOMPLETE: 0 of 120 runs finished at step 400 (missing: control_lr2e-4 seeds 0-7, ")
    assert text.endswith(", const_ld seeds 0-7); no endpoint is computed before the study is complete (no interim "
                         "analysis).")
    # a run still running and one that failed do not count; one that diverged does (a fall, never excluded)
    states = {"stale_2_lr2e-4_s0": ("running", 200), "ramp_lr2e-4_s0": ("failed", 150),
              "stale_4_lr2e-4_s0": ("diverged", 120)}
    text = analyze(E2, _sweep(tmp_path / "part", ["control_lr2e-4_s0", *states], states=states)).text
    assert text.startswith("INCOMPLETE: 2 of 120 runs finished at step 400 (missing: stale_2_lr2e-4 seeds 0-7, "
                           "ramp_lr2e-4 seeds 0-7, const_lr2e-4 seeds 0-7, ")
    assert text.endswith(", control_lr2e-4 seeds 1-7, stale_4_lr2e-4 seeds 1-7); no endpoint is computed before the "
                         "study is complete (no interim analysis).") and len(text.splitlines()) == 1


def test_a_broken_control_voids_the_study(study, tmp_path):
    out = tmp_path / "sweep"
    shutil.copytree(study[0], out)
    run = out / next(p.run_id for p in planned_runs(E2) if p.name == "control_ld_s4")
    m = pd.read_parquet(run / "metrics.parquet")
    m.loc[m["step"] == 300, "rollout_corr/k3_kl"] = 1e-9  # one step with k3 > 0
    m.to_parquet(run / "metrics.parquet", index=False)
    res = analyze(E2, out)
    assert res.status == "void" and res.text.endswith(
        "BROKEN; control step-0 accuracy 0.965 (bar 0.95): VOID (re-run, do not analyse).")
