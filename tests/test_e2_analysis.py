"""Study E2's pre-registered analysis (scripts/e2_tables.py), checked before any of its data exist
on a synthetic sweep of all 120 runs with planted effects: run directories written as the trainer
writes them (metrics.parquet: step 0 holds the start's evaluation, steps 1-400 a training row each,
evaluations every 20 steps; status.json; the sweep's index.parquet)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from script_loader import load_script
from study_sweep import write_sweep
from timlab.experiments.stats import clopper_pearson

E2 = load_script("e2_tables")

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


def _metrics(arm: str, lr: str, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng([E2.ARMS.index(arm), E2.LRS.index(lr), seed])
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


def _sweep(root, names, *, states: dict | None = None):
    """A sweep directory holding the runs ``names`` (finished at step 400 unless ``states`` says
    otherwise: name -> (state, last step))."""
    return write_sweep(root, names, lambda name: _metrics(*E2.parse(name)), STEPS, states=states)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    runs = E2.collect(str(_sweep(tmp_path_factory.mktemp("e2"), E2.expected())))
    return runs, E2.per_condition(runs), E2.analyse(runs, E2.expected())


def _rows(text: str, start: str, end: str) -> dict[str, str]:
    part = text.split(start)[1].split(end)[0]
    return {line.split(" | ")[0][2:]: line for line in part.splitlines() if line.startswith("| ")}


# ------------------------------------------------------------------------------ one run
def test_rise_step_hand_counted():
    s = pd.Series(np.ones(200), index=np.arange(1, 201))
    s[s.index >= 150] = 3.0  # 10-step means: 1.4 at 151, 1.6 at 152 > 1.5 x median 1
    assert E2.rise_step(s, 1.5) == 152
    s[s.index == 61] = 100.0  # one spike: its trailing mean 10.9 already at step 61
    assert E2.rise_step(s, 1.5) == 61
    assert E2.rise_step(pd.Series(np.zeros(200), index=np.arange(1, 201)), 1.5) is None  # a control's k3
    assert E2.rise_step(pd.Series(np.ones(200), index=np.arange(1, 201)), 1.2) is None
    assert E2.vs_start(s, 61) == pytest.approx((9 + 100) / 10)  # steps 52-61 over steps 1-5


def test_run_record_of_a_late_fall():
    r = E2.run_record(_metrics("ramp", "lr2e-4", 0))
    assert r["fall"] == 260 and r["rise"]["grad norm"] == 220  # lead 40
    assert r["rise"]["response length"] is None and r["rise"][E2.SCHEDULED] is None  # flat against its schedule
    assert r["rise"]["k3"] is not None and r["rise"]["k3"] < 120  # k3 itself rises by design
    # log k3 grows as 2 ln(0.6 / 0.135) over 399 steps: 0.748 per 100 steps
    assert r["k3_trend"] == pytest.approx(200 * math.log(RAMP1 / RAMP0) / 399, abs=0.02)
    assert r["late_acc_level"] == pytest.approx((3 * 0.965 + 8 * 0.2) / 11, abs=0.003)
    stale = E2.run_record(_metrics("stale_2", "lr1e-4", 0))
    assert abs(stale["k3_trend"]) < 0.05 and math.isfinite(stale["k3_trend"])  # step 1's k3 = 0 left out
    assert stale["fall"] is None and stale["k3"] == pytest.approx(1e-3, rel=0.2)


# ------------------------------------------------------------------------------ the analysis
def test_valid_study_and_primary_endpoints(study):
    runs, per, text = study
    assert len(runs) == 120
    assert text.splitlines()[0] == ("Validity: control guard (k3 exactly 0, every token bitwise equal, at each of the "
                                    "400 steps of all 24 control runs) held; control step-0 accuracy 0.965 (bar 0.95): VALID.")
    prim = E2.primary(per)
    cmp, dropped = prim["acc_level"]
    assert len(cmp) == 12 and not dropped
    floor = 2 / math.comb(16, 8)
    assert cmp["stale_4_lr2e-4"].below() and cmp["stale_4_lr2e-4"].diff == pytest.approx(-0.665, abs=0.01)
    assert cmp["stale_4_lr2e-4"].p == pytest.approx(floor)
    assert cmp["stale_2_lr2e-4"].below() and cmp["stale_2_lr2e-4"].diff == pytest.approx(-0.03, abs=0.003)
    assert not cmp["const_lr1e-4"].below() and not cmp["stale_4_lr1e-4"].below()
    rows = _rows(text, "**mean accuracy, steps 60-400**", "**accuracy slope")
    assert rows["stale_4_lr2e-4"].endswith("| **yes** |") and "| no (costs at most" in rows["const_lr2e-4"]
    assert rows["control_ld"].endswith("| - | - | - | - |") and len(rows) == 16  # header + 15 conditions


def test_q1_a_late_fall_in_the_growing_arm_only(study):
    _, per, text = study
    fl = E2.falls(per)
    assert fl["ramp_lr2e-4"]["k"] == 5 and fl["ramp_lr2e-4"]["steps"] == {s: 260 for s in range(5)}
    assert fl["ramp_lr2e-4"]["ci"] == clopper_pearson(5, 8)
    assert all(fl[f"const_{lr}"]["k"] == 0 for lr in E2.LRS) and fl["stale_4_lr2e-4"]["steps"] == {s: 20 for s in range(8)}
    lat = E2.late(per)
    g = E2.growth(per, lat, fl)
    assert g["lr2e-4"]["falls"] and g["lr2e-4"]["verdict"] == "yes"
    assert g["lr1e-4"]["within"] and g["lr1e-4"]["verdict"] == "no"  # ramp and constant flat: equivalent
    assert g["ld"]["verdict"] == "undecided" and not g["ld"]["within"]  # -0.02 on average, too noisy to call
    # planted realized k3 (steps 1-400): ramp 9.9e-4 x (19.75 - 1) / ln 19.75 = 6.2e-3 against 8.7e-3
    assert g["lr2e-4"]["k3_ratio"] == pytest.approx(9.9e-4 * (19.75 - 1) / math.log(19.75) / 8.7e-3, rel=0.1)
    assert all(x["matched"] for x in g.values())
    skew = {c: [{**r, "k3_all": 3 * r["k3_all"]} for r in recs] if c == "const_ld" else recs for c, recs in per.items()}
    assert [x["matched"] for x in E2.growth(skew, lat, fl).values()] == [True, True, False]  # 0.7 / 3: more than 2x apart
    cmp, _ = lat["acc_slope"]
    assert cmp["lr2e-4"].diff < -0.2 and cmp["lr1e-4"].p_holm > 0.05
    assert "| ramp_lr2e-4 | 5/8 [0.24, 0.91] | s0: 260, s1: 260, s2: 260, s3: 260, s4: 260 |" in text
    assert "| length decay | " in text and "| **undecided** |" in text and "| **no** |" in text


def test_q2_a_lower_lr_shrinks_the_stale_mismatch(study):
    _, per, text = study
    cmp, dropped = E2.shrink(per)
    assert len(cmp) == 8 and not dropped
    ratio = {p: math.exp(c.diff) for p, c in cmp.items()}
    hi = {p: math.exp(c.diff_ci[1]) for p, c in cmp.items()}
    assert ratio["stale_2", "lr1e-4"] == pytest.approx(1 / 6, rel=0.15) and hi["stale_2", "lr1e-4"] < 0.25
    assert cmp["stale_2", "lr1e-4"].below() and cmp["stale_2", "lr1e-4"].p_holm == pytest.approx(8 * 2 / math.comb(16, 8))
    assert ratio["stale_2", "ld"] == pytest.approx(1 / 3, rel=0.15) and cmp["stale_2", "ld"].below()
    assert hi["stale_2", "ld"] > 0.22  # shrinks, but not below length decay's squared LR ratio
    assert not cmp["ramp", "lr1e-4"].below() and not cmp["const", "ld"].below()  # head_perturb: the LR cannot touch it
    rows = [line for line in text.split("**Q2")[1].split("**Q3")[0].splitlines() if line.startswith("| stale_2 |")]
    assert rows[1].endswith("| **yes** | **yes** (bar 0.25) |") and rows[2].endswith("| **yes** | no (bar 0.22) |")


def test_q3_a_signal_that_rises_before_the_falls(study):
    _, per, text = study
    sg = E2.signals(per)
    assert len(sg["late"]) == 8 and len(sg["early"]) == 8
    assert sg["conditions"] == ["ramp_lr2e-4", "stale_2_ld"]
    g = sg["rows"]["grad norm"]
    assert g["leads"] == [20, 20, 20, 40, 40, 40, 40, 40] and g["warned"] == 8 and g["falls"] == 8
    assert g["stayed"] == 8 and g["alarms"] == 0 and g["useful"]  # 8/8 [0.63, 1] against 0/8 [0, 0.37]
    k3 = sg["rows"]["k3"]  # rises by design in every ramp run: warns the ramp's falls, and alarms in its survivors
    assert k3["warned"] == 5 and k3["alarms"] == 3 and not k3["useful"]
    sched = sg["rows"][E2.SCHEDULED]  # ramp arms only; flat against its schedule
    assert sched["falls"] == 5 and sched["warned"] == 0 and sched["stayed"] == 3 and sched["alarms"] == 0
    assert sg["rows"]["response length"]["warned"] == 0
    assert "| grad norm | 8/8 [0.63, 1.00] | +40 (+20 to +40) | 0/8 [0.00, 0.37] | **yes** |" in text
    early = [line for line in text.split("Early falls")[1].splitlines() if line.startswith("| stale_4_lr2e-4 |")]
    assert len(early) == 8 and all(line.split(" | ")[2] == "20" for line in early)
    assert all(float(line.split(" | ")[5][:-1]) == pytest.approx(4, abs=0.05) for line in early)  # grad norm x4 at F vs steps 1-5


def test_few_falls_are_listed_one_by_one(study):
    _, per, _ = study
    runs = {f"{c}_s{s}": r for c, recs in per.items() for s, r in enumerate(recs)}
    for s in range(2, 5):  # keep 2 late falls of the ramp and drop the others
        runs[f"ramp_lr2e-4_s{s}"] = {**runs[f"ramp_lr2e-4_s{s}"], "fall": None}
    for s in range(3):
        runs[f"stale_2_ld_s{s}"] = {**runs[f"stale_2_ld_s{s}"], "fall": None}
    text = E2.analyse(runs, E2.expected())
    q3 = text.split("**Q3")[1]
    assert "Fewer than 3 falls at F > 80: listed one by one, no rate computed." in q3
    assert "| ramp_lr2e-4 | 0 | 260 | " in q3 and "| 220 (+40) |" in q3 and "falls warned" not in q3


def test_incomplete_sweeps_are_refused(tmp_path):
    names = E2.expected()
    assert E2.study(str(tmp_path / "not_started")) == (
        "INCOMPLETE: 0 of 120 runs finished at step 400 (missing: seeds 0-7 of all 15 conditions); no endpoint is "
        "computed before the study is complete (no interim analysis).")
    # a run still running and one that failed do not count; one that diverged does (a fall, never excluded)
    states = {"stale_2_lr2e-4_s0": ("running", 200), "ramp_lr2e-4_s0": ("failed", 150),
              "stale_4_lr2e-4_s0": ("diverged", 120)}
    part = _sweep(tmp_path / "part", ["control_lr2e-4_s0", *states], states=states)
    text = E2.study(str(part))
    assert text.startswith("INCOMPLETE: 2 of 120 runs finished at step 400 (missing: seeds 0-7 of stale_2_lr2e-4, "
                           "ramp_lr2e-4, const_lr2e-4, control_lr1e-4, ") and len(text.splitlines()) == 1
    assert text.endswith("; seeds 1-7 of control_lr2e-4, stale_4_lr2e-4); no endpoint is computed before the study "
                         "is complete (no interim analysis).")
    assert set(E2.collect(str(part))) == {"control_lr2e-4_s0", "stale_4_lr2e-4_s0"}
    # the first 7 seeds in but for one: the line names what is missing, compactly
    assert E2.analyse({n: {} for n in names if not n.endswith("_s7")}, names) == (
        "INCOMPLETE: 105 of 120 runs finished at step 400 (missing: seed 7 of all 15 conditions); "
        "no endpoint is computed before the study is complete (no interim analysis).")
    assert "(missing: seeds 3, 7 of control_lr1e-4; seed 7 of control_lr2e-4, stale_2_lr2e-4, " in E2.analyse(
        {n: {} for n in names if n != "control_lr1e-4_s3" and not n.endswith("_s7")}, names)
    with pytest.raises(ValueError, match="not an E2 run name"):
        E2.parse("control_lr3e-4_s0")


def test_a_broken_control_voids_the_study(study):
    runs = dict(study[0])
    runs["control_ld_s4"] = {**runs["control_ld_s4"], "guard": False}  # one step with k3 > 0 or a token not equal
    assert E2.analyse(runs, E2.expected()).endswith("BROKEN; control step-0 accuracy 0.965 (bar 0.95): VOID (re-run, do not analyse).")
    runs = dict(study[0])
    runs["control_lr1e-4_s0"] = {**runs["control_lr1e-4_s0"], "start_acc": 0.94}  # not the learned start
    text = E2.analyse(runs, E2.expected())
    assert "VOID" in text and len(text.splitlines()) == 1
