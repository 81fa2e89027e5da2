"""Study H1's registration (docs/examples/studies/h1.yaml, docs/FINDINGS.md "Study H1"), tested
before its data exist: the sweep it registers (arms, seeds, the order that keeps partial sweeps to
whole seeds, the controller's targets), and its analysis on a planted 2,000-step sweep, where each
registered verdict must find the effect planted for it and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from study_sweep import assert_registered_in_findings, planted_run, write_blocks, write_sweep
from timlab.experiments.studies.engine import analyze, planned_runs
from timlab.experiments.studies.registration import freeze, load_study
from timlab.experiments.sweeps.spec import expand, spec_from_dict
from timlab.findings import block_file
from timlab.injectors.schedule import scheduled_magnitude

REPO = Path(__file__).resolve().parents[1]
H1 = load_study(REPO / "docs" / "examples" / "studies" / "h1.yaml")
ARMS = ["control", "hold_3e-3", "hold_3e-3_tis", "hold_1e-2", "hold_1e-2_tis", "grow", "grow_tis"]
TIS = {"correction.mode": "truncate", "correction.level": "token", "correction.threshold": 2.0}


def test_h1_registers_seven_arms_of_eight_seeds_listed_seed_by_seed():
    spec = spec_from_dict(H1.sweep, root=H1.sweep_root, source=H1.sweep_source)
    runs = expand(spec)
    assert [r.spec_condition for r in runs] == [f"{a}_s{s}" for s in range(8) for a in ARMS]
    assert [p.arm for p in planned_runs(H1)][:7] == ARMS and H1.steps == 2000 and spec.isa == "avx2"
    for r in runs:
        seed = int(r.spec_condition.rsplit("_s", 1)[1])
        assert r.overrides["run.seed"] == r.overrides["mismatch.seed"] == seed
        assert r.config.model.path == "runs/erosion_start" and r.config.run.steps == 2000
        assert r.config.task.n_val == 512 and r.config.run.eval_every == 25
        tis = r.spec_condition.split("_s")[0].endswith("_tis")
        assert (r.config.correction.mode, r.config.correction.level, r.config.correction.threshold) == \
            (("truncate", "token", 2.0) if tis else ("none", "token", 2.0))
    by = {r.spec_condition: r.config.mismatch for r in runs}
    assert by["control_s3"].injector == "none" and by["control_s3"].target_k3 == 0
    assert (by["hold_3e-3_s0"].target_k3, by["hold_1e-2_s0"].target_k3) == (0.003, 0.01)
    assert by["hold_1e-2_tis_s5"] == by["hold_1e-2_s5"] and by["grow_tis_s7"] == by["grow_s7"]
    g = by["grow_s0"]
    target = [scheduled_magnitude(t, schedule=g.schedule, magnitude=g.target_k3, magnitude_end=g.target_k3_end,
                                  start_step=g.start_step, ramp_steps=g.ramp_steps) for t in (1, 1000, 2000)]
    assert target[0] == pytest.approx(1e-3) and target[2] == pytest.approx(3e-2)
    assert target[1] == pytest.approx(1e-3 * 30 ** (999 / 1999))  # geometric over the whole run


def test_findings_names_the_registration_hash_and_the_block():
    assert H1.findings[1] == "held-k3"
    assert_registered_in_findings(H1, "Study H1")


def test_amendment_1_puts_seeds_0_2_on_amd_and_3_7_on_intel():
    """FINDINGS, Study H1, Amendment 1: two machine blocks, every seed in one, recorded as the
    amendment's hash (the frozen registration of sweeps/h1 stays the first one)."""
    assert [(b.name, b.isa, b.seeds, b.out, b.fingerprint) for b in H1.blocks] == [
        ("amd", "avx2", (0, 1, 2), "", ""),
        ("intel", "avx2-intel", (3, 4, 5, 6, 7), "sweeps/h1_intel", "0220b5990add")]
    assert H1.amendments[-1].hash == H1.hash and H1.amendments[-1].date == "2026-11-27"
    blocks = [p.block for p in planned_runs(H1)]
    assert blocks == ["amd"] * 21 + ["intel"] * 35
    text = block_file(*H1.findings).read_text()  # docs/findings/h1.md
    assert f"**Amendment 1 (2026-11-27, before any run of seeds 3-7 on the new machines; hash\n{H1.hash})" in text


# ------------------------------------------------------------------------------- a planted sweep
def planted(name: str) -> pd.DataFrame:
    """A 2,000-step run: accuracy 0.97 (seed offset sd 2e-3, evaluation noise sd 2e-3, every 25
    steps), gold log-prob -0.10; planted: hold_3e-3 and grow lose gold log-prob in proportion to
    the step (0.2 nats by step 2,000), hold_1e-2 loses 0.05 accuracy from step 25 on and 0.5 nats,
    grow loses accuracy in proportion to the step (0.04 by step 2,000); TIS stops the hold arms'
    losses and not grow's; the same step-0 evaluation everywhere."""
    arm, seed = name.rsplit("_s", 1)
    rng = np.random.default_rng([ARMS.index(arm), int(seed)])
    ev = np.arange(0, 2001, 25)
    acc = 0.97 + rng.normal(0, 2e-3) + rng.normal(0, 2e-3, ev.size)
    gold = -0.10 + rng.normal(0, 1e-3, ev.size)
    frac = ev / 2000
    if arm == "hold_3e-3":
        gold = gold - 0.2 * frac
    if arm == "hold_1e-2":
        acc, gold = acc - 0.05 * (ev >= 25), gold - 0.5 * (ev >= 25)
    if arm in ("grow", "grow_tis"):
        acc, gold = acc - 0.04 * frac, gold - 0.2 * frac
    acc[0], gold[0] = 0.965, -0.32
    return planted_run(rng, control=arm == "control", steps=2000, ev=ev, acc=acc, gold=gold, k3=3e-3, magnitude=0.3,
                       length=30.0)


INTEL_SHIFT = -0.012
"""Planted in every run of block intel (seeds 3-7): accuracy 0.012 lower, gold log-prob 0.03 lower,
and another step-0 evaluation (another start): common to all arms, so no comparison may move."""


def planted_blocked(name: str) -> pd.DataFrame:
    """``planted``, with block intel's shift and its own step-0 evaluation."""
    m = planted(name)
    if int(name.rsplit("_s", 1)[1]) >= 3:
        ev = m["val/accuracy"].notna()
        m.loc[ev, "val/accuracy"] += INTEL_SHIFT
        m.loc[ev, "val/gold_logprob"] -= 0.03
        m.loc[m["step"] == 0, ["val/accuracy", "val/gold_logprob"]] = [0.982, -0.25]
    return m


def test_h1_analysis_finds_each_planted_effect(tmp_path):
    planned = planned_runs(H1)
    dirs = write_blocks(H1, tmp_path, planted_blocked, names=[p.name for p in planned if p.block == "intel"])
    assert dirs == {"amd": tmp_path / "sweeps" / "h1", "intel": tmp_path / "sweeps" / "h1_intel"}
    # block amd's directory also holds seed 3's runs made on AMD before the amendment, outside the
    # study: their wild values must change nothing
    amd = [p.name for p in planned if p.block == "amd"] + [p.name for p in planned if p.name.endswith("_s3")]
    write_sweep(dirs["amd"], amd, lambda n: planted(n).assign(**{"val/accuracy": 0.2}) if n.endswith("_s3") else
                planted_blocked(n), 2000, run_ids={p.name: p.run_id for p in planned})
    res = analyze(H1, root=tmp_path)
    assert res.status == "complete", res.text
    lines = res.text.splitlines()
    assert lines[0] == ("Validity: control guard (k3 exactly 0, every token bitwise equal, every step) held; step-0 "
                        "evaluation the same in all 21 runs of block amd (accuracy 0.965, gold log-prob -0.320); "
                        "step-0 evaluation the same in all 35 runs of block intel (accuracy 0.982, gold log-prob "
                        "-0.250): VALID.")
    assert res.decisions == {
        ("erodes", "hold_3e-3"): "**the gold answer drifts** (late accuracy level not shown lower)",
        ("erodes", "hold_1e-2"): "**erodes**",
        ("erodes", "grow"): "**erodes, still falling at step 2000**",
        ("erodes_tis", "hold_3e-3_tis"): "**no erosion shown**",
        ("erodes_tis", "hold_1e-2_tis"): "**no erosion shown**",
        ("erodes_tis", "grow_tis"): "**erodes, still falling at step 2000**",
        ("tis_hold_3e-3", "hold_3e-3_tis"): "**TIS lessens the gold drift** (late accuracy not shown higher)",
        ("tis_hold_1e-2", "hold_1e-2_tis"): "**TIS raises the late accuracy**",
        ("tis_grow", "grow_tis"): "**no gain from TIS shown**"}

    def number(line: str, after: str) -> float:
        return float(re.search(re.escape(after) + r" ([+-]\d\.\d{4})", line).group(1))
    verdict = {x.split(":")[0]: x for x in lines if x.startswith("Verdict")}
    assert number(verdict["Verdict hold_1e-2"], "late accuracy") == pytest.approx(-0.05, abs=4e-3)
    assert number(verdict["Verdict grow"], "late accuracy") == pytest.approx(-0.04 * 0.875, abs=4e-3)
    assert number(verdict["Verdict grow"], "late slope") == pytest.approx(-0.002, abs=5e-4)  # -0.04 per 2000 steps
    assert number(verdict["Verdict hold_3e-3"], "gold drift") == pytest.approx(-0.2 * (0.875 - 0.1375), abs=4e-3)
    assert number(verdict["Verdict TIS, hold_1e-2_tis"], "late accuracy") == pytest.approx(0.05, abs=4e-3)
    # the windows' table: realized k3 and the magnitude beside each arm, falls counted
    row = next(x for x in lines if x.startswith("| hold_1e-2 |"))
    assert "| 0/8 [0.00, 0.37] |" in row
    assert "block amd: frozen registration" in res.freeze and "block intel: frozen registration" in res.freeze
    # the within-block table (Amendment 1, descriptive): the planted cost in each block, the machine shift in none
    i = lines.index("| comparison | endpoint | block amd (3 seeds) | block intel (5 seeds) | all seeds |")
    rows = {tuple(x.split(" | ")[:2]): [float(v) for v in x.strip(" |").split(" | ")[2:]] for x in lines[i + 2:i + 29]}
    assert len(rows) == 27 and lines[i + 29] == ""
    amd, intel, pooled = rows[("| hold_1e-2 - control", "accuracy level, steps 1500-2000 (primary)")]
    assert amd == pytest.approx(-0.05, abs=6e-3) and intel == pytest.approx(-0.05, abs=6e-3)
    assert pooled == pytest.approx((3 * amd + 5 * intel) / 8, abs=1e-4)
    assert all(abs(r[0] - r[1]) < 0.012 for k, r in rows.items() if "accuracy level" in k[1])


def test_h1_tests_relabel_within_blocks(tmp_path):
    """The registered p of a comparison is the within-block permutation p (5,040 relabelings of 3 + 5
    seeds a side), computed here by brute force from the endpoint values."""
    from itertools import combinations

    from timlab.experiments.studies.engine import endpoint_values

    write_blocks(H1, tmp_path, planted_blocked)
    col = endpoint_values(H1, root=tmp_path)[""]
    a, b = col["hold_3e-3"]["acc_late"], col["control"]["acc_late"]
    assert col["control"]["_block"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    observed, count, hits = a.mean() - b.mean(), 0, 0
    pa, pb = np.concatenate([a[:3], b[:3]]), np.concatenate([a[3:], b[3:]])
    for i in combinations(range(6), 3):
        for j in combinations(range(10), 5):
            sa = pa[list(i)].sum() + pb[list(j)].sum()
            d = sa / 8 - (pa.sum() + pb.sum() - sa) / 8
            count, hits = count + 1, hits + (abs(d) >= abs(observed) - 1e-12)
    erosion = analyze(H1, root=tmp_path).text.split("accuracy level, steps 1500-2000 (primary)")[1]
    row = next(x for x in erosion.splitlines() if x.startswith("| hold_3e-3 |"))
    assert count == 5040
    from timlab.experiments.studies.stats import permutation_test

    t = permutation_test(a, b, strata=(col["hold_3e-3"]["_block"], col["control"]["_block"]))
    assert (t.n_relabelings, t.p, t.floor) == (5040, hits / count, 2 / 5040)
    assert f"| {t.p:.4f} |" in row, row


def test_h1_analysis_refuses_a_sweep_of_two_whole_seeds(tmp_path):
    names = [p.name for p in planned_runs(H1)]
    freeze(H1, tmp_path / "sweeps" / "h1")
    write_sweep(tmp_path / "sweeps" / "h1", names[:14], planted, 2000,
                run_ids={p.name: p.run_id for p in planned_runs(H1)})
    res = analyze(H1, root=tmp_path)
    assert res.status == "incomplete" and res.text == (
        "INCOMPLETE: 14 of 56 runs finished at step 2000 (missing: control seeds 2-7, hold_3e-3 seeds 2-7, "
        "hold_3e-3_tis seeds 2-7, hold_1e-2 seeds 2-7, hold_1e-2_tis seeds 2-7, grow seeds 2-7, grow_tis seeds 2-7); "
        "no endpoint is computed before the study is complete (no interim analysis).")


def test_h1_trajectory_figure_draws_each_arm_from_the_planted_sweep(tmp_path, monkeypatch):
    """`timlab study figure --trajectories`: one panel per metric the endpoints read, each arm's mean
    over its 8 seeds; the planted effects are where they were planted, k3 on a log axis."""
    from timlab.experiments.studies.engine import figure
    from timlab.experiments.studies.trajectory_figure import smoothing, study_metrics, trajectories
    from timlab.rundir import read_metrics

    dirs = write_blocks(H1, tmp_path, planted)
    assert study_metrics(H1) == ["val/accuracy", "val/gold_logprob", "rollout_corr/k3_kl", "mismatch/magnitude",
                                 "train/response_length_mean"]
    runs: dict[str, list] = {}
    for p in planned_runs(H1):
        runs.setdefault(("", p.arm), []).append(read_metrics(dirs[p.block] / p.run_id))
    panels = {p.metric: p for p in trajectories(H1, runs)}
    assert [p.log for p in panels.values()] == [False, False, True, False, False]
    acc = {c.label: c for c in panels["val/accuracy"].curves}
    assert list(acc) == ARMS and {c.runs for c in acc.values()} == {8}
    assert acc["control"].steps.tolist() == list(range(0, 2001, 25))
    assert acc["control"].mean[0] == pytest.approx(0.965) and acc["control"].low[0] == pytest.approx(0.965)
    drop = acc["control"].mean[-20:].mean() - acc["hold_1e-2"].mean[-20:].mean()
    assert drop == pytest.approx(0.05, abs=4e-3)  # planted: hold_1e-2 loses 0.05 from step 25 on
    grow = acc["control"].mean[-1] - acc["grow"].mean[-1]
    assert grow == pytest.approx(0.04, abs=6e-3)  # planted: grow loses 0.04 by step 2,000
    assert (acc["control"].low <= acc["control"].mean).all() and (acc["control"].mean <= acc["control"].high).all()
    k3 = {c.label: c for c in panels["rollout_corr/k3_kl"].curves}
    assert "control" not in k3  # its k3 is 0 everywhere: nothing to draw on a log axis
    assert k3["hold_3e-3"].steps.size == 2000 and smoothing(2000) == 20
    # the geometric mean of 3e-3 * exp(N(0, 0.3)) is 3e-3
    assert np.median(k3["hold_3e-3"].mean[100:]) == pytest.approx(3e-3, rel=0.05)
    monkeypatch.chdir(tmp_path)  # a blocked study's directories are relative to the working directory
    png = figure(H1, tmp_path / "h1_traj.png", trajectories=True)
    assert png.stat().st_size > 20_000


def test_h1_difference_figure_has_one_row_per_family(tmp_path, monkeypatch):
    """`timlab study figure`: the 5 families x 3 endpoints of H1 as a 5 x 3 grid of panels (4.5 x 3.8
    inches each at 100 dpi), not one row of 15."""
    from PIL import Image

    from timlab.experiments.studies.engine import figure

    write_blocks(H1, tmp_path, planted_blocked)
    monkeypatch.chdir(tmp_path)
    png = figure(H1, tmp_path / "h1.png")
    assert Image.open(png).size == (1350, 1900)
