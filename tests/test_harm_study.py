"""Predictor studies (Study H): the through-origin fit, leave-one-kind-out error and paired bootstrap on
planted cells; the analysis's refusal and its recovery of a planted slope; the recompute driver on tiny
committed smoke runs (repeat check, resume, kill safety, a planted non-repeat)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from timlab.config import resolve
from timlab.experiments.studies import oos as O
from timlab.experiments.studies import predictor as P
from timlab.experiments.studies.predictor import Cells, StudyError
from timlab.experiments.studies.recompute import recompute
from timlab.rundir import read_metrics
from timlab.trainer.run import train
from study_sweep import write_sweep

REPO = Path(__file__).resolve().parents[1]


def test_fit_origin_and_loko_hand_computed():
    # b = (1*1*1 + 1*2*3) / (1*1 + 1*4) = 7/5
    assert P.fit_origin([1, 2], [1, 3], [1, 1]) == pytest.approx(1.4, abs=1e-15)
    # weights: b = (1*1*1 + 3*2*3) / (1 + 3*4) = 19/13
    assert P.fit_origin([1, 2], [1, 3], [1, 3]) == pytest.approx(19 / 13, abs=1e-15)
    # kinds a (S=1, c=1), b (S=2, c=3), c (S=1, c=2): leaving a out, b = (6+2)/(4+1) = 1.6 -> err 1-1.6;
    # leaving b out, b = 3/2 -> err 3-3; leaving c out, b = 7/5 -> err 2-1.4
    want = math.sqrt(((1 - 1.6) ** 2 + 0.0 + (2 - 1.4) ** 2) / 3)
    assert P.loko_rmse([1, 2, 1], [1, 3, 2], [1, 1, 1], ["a", "b", "c"]) == pytest.approx(want, abs=1e-15)
    pred, lo, hi = P.prediction(2.0, 0.01, 0.03, 0.5)
    assert pred == 1.0 and hi - pred == pytest.approx(1.96 * math.sqrt(0.25 * 0.01 + 0.0009), abs=1e-15)


def planted_cells(noise: float, seed: int = 0) -> Cells:
    """12 cells of 3 kinds whose cost is 0.5 x S_good; k3 is S_good scaled by a kind factor (1, 6, 0.2),
    so k3 mispredicts across kinds and 'good' does not."""
    rng = np.random.default_rng(seed)
    factor = {"head": 1.0, "stale": 6.0, "num": 0.2}
    cells = Cells([], [], [], [], [], [], {"k3": False, "good": False, "signed": True})
    for i, kind in enumerate(["head", "stale", "num"] * 4):
        s = 0.02 * (1 + i)
        ctrl = 0.9 + noise * rng.standard_normal(8)
        arm = 0.9 - 0.5 * s + noise * rng.standard_normal(8)
        cells.names.append(f"c{i}")
        cells.kinds.append(kind)
        cells.control.append(ctrl)
        cells.control_key.append(f"g{i % 2}")
        cells.arm.append(arm)
        g = s * (1 + noise * rng.standard_normal(3))
        cells.values.append({"k3": g / factor[kind], "good": g, "signed": -g})
    # controls shared within a key, as in a study
    for i in range(len(cells.names)):
        cells.control[i] = cells.control[i % 2]
    return cells


def test_planted_fit_recovers_slope_and_prefers_the_right_candidate():
    cells = planted_cells(0.0)
    res = P.fit_all(cells, ["k3", "good", "signed"], "k3", boot=50)
    assert res["good"]["b"] == pytest.approx(0.5, rel=1e-9)
    assert res["good"]["loko"] == pytest.approx(0.0, abs=1e-12)
    assert res["signed"]["loko"] == pytest.approx(0.0, abs=1e-12)  # enters as |mean|
    assert res["k3"]["loko"] > 0.01
    noisy = planted_cells(0.002, seed=3)
    res = P.fit_all(noisy, ["k3", "good"], "k3", boot=300)
    assert res["good"]["b"] == pytest.approx(0.5, abs=0.05)
    lo, hi = res["good"]["gain_ci"]
    assert lo > 0 and res["good"]["gain"] > 0  # paired: k3's error minus good's
    assert res["k3"]["gain"] == 0.0 and res["k3"]["gain_ci"] == (0.0, 0.0)
    # the same seed gives the same bits
    again = P.fit_all(planted_cells(0.002, seed=3), ["k3", "good"], "k3", boot=300)
    assert again["good"]["loko_ci"] == res["good"]["loko_ci"]


def test_a_rescaled_candidate_predicts_exactly_as_well():
    # the fit is through the origin, so S and 3 S give the same predictions: a paired gain of 0 in every resample
    cells = planted_cells(0.002, seed=4)
    for v in cells.values:
        v["k3"] = 3.0 * v["good"]
    cells.absolute["k3"] = False
    res = P.fit_all(cells, ["k3", "good"], "k3", boot=100)
    assert res["good"]["gain"] == pytest.approx(0.0, abs=1e-12)
    assert res["good"]["gain_ci"][0] == pytest.approx(0.0, abs=1e-12)
    assert res["good"]["gain_ci"][1] == pytest.approx(0.0, abs=1e-12)
    assert res["k3"]["b"] == pytest.approx(res["good"]["b"] / 3, rel=1e-12)


def _study_dict(sweep: Path, table: Path, *, frozen: bool = True, seeds=(0,), last: int = 2, isa="native") -> dict:
    d = {"study": "t", "kind": "predictor", "isa": isa, "rerun": {"last_step": last, "seeds": list(seeds)},
         "window": [1, last], "cost": {"metric": "val/accuracy", "window": [2, 4]},
         "candidates": [{"name": "k3", "metric": "rollout_corr/k3_kl"},
                        {"name": "adv", "metric": "mismatch/adv_diff_mean", "absolute": True}],
         "reference": "k3", "table": str(table), "boot": 50,
         "sources": [{"name": "S", "sweep": str(sweep), "pattern": "(?P<arm>.+)_s(?P<seed>\\d+)",
                      "cells": {"head": "head", "stale": "stale"}}]}
    if frozen:
        d["frozen"] = P.predictor_from_dict(d).hash
    return d


def test_registration_errors_name_the_field(tmp_path):
    d = _study_dict(tmp_path, tmp_path / "t.parquet", frozen=False)
    with pytest.raises(StudyError, match="reference: 'nope' is not a candidate \\(valid: k3, adv\\)"):
        P.predictor_from_dict({**d, "reference": "nope"})
    with pytest.raises(StudyError, match="unknown key 'bogus'"):
        P.predictor_from_dict({**d, "bogus": 1})
    with pytest.raises(StudyError, match="window ends at step 9, after rerun.last_step 2"):
        P.predictor_from_dict({**d, "window": [1, 9]})
    one = {**d, "sources": [{**d["sources"][0], "cells": {"head": "head"}}]}
    with pytest.raises(StudyError, match="1 kind"):
        P.predictor_from_dict(one)
    st = P.predictor_from_dict({**d, "frozen": "0" * 64})
    with pytest.raises(StudyError, match="changed after it was frozen"):
        P.check_frozen(st)


def _planted_sweep(tmp_path: Path) -> Path:
    """Committed runs: per seed 0-3 a control (0.9), head (costs 0.04) and stale (costs 0.10) run."""
    names = [f"{a}_s{s}" for s in range(4) for a in ("control", "head", "stale")]
    cost = {"control": 0.0, "head": 0.04, "stale": 0.10}

    def metrics(name):
        arm, seed = name.rsplit("_s", 1)
        acc = 0.9 - cost[arm] + 0.001 * int(seed)
        return pd.DataFrame({"step": range(5), "val/accuracy": [acc] * 5})

    return write_sweep(tmp_path / "sweep", names, metrics, 4)


def test_analysis_refuses_then_recovers_planted_slope(tmp_path):
    sweep = _planted_sweep(tmp_path)
    table = tmp_path / "harm" / "t.parquet"
    st = P.predictor_from_dict(_study_dict(sweep, table, seeds=(0, 1)))
    res = P.analyze_predictor(st)
    assert res.status == "incomplete" and res.insample.startswith("INCOMPLETE: 0 of 4 re-runs")
    # the table the driver would write: k3 = cost / 2 for head, cost / 5 for stale; adv = -cost / 4 for both
    rows = []
    for r in P.rerun_list(st):
        c = {"head": 0.04, "stale": 0.10}[r.arm]
        k3 = c / 2 if r.arm == "head" else c / 5
        for step in range(3):
            rows.append({"source": "S", "run": r.run, "step": step, "rollout_corr/k3_kl": k3,
                         "mismatch/adv_diff_mean": -c / 4, "repeat": "ok"})
    table.parent.mkdir(parents=True)
    pd.DataFrame(rows[:-3]).to_parquet(table)
    assert P.analyze_predictor(st).status == "incomplete"
    pd.DataFrame(rows).to_parquet(table)
    res = P.analyze_predictor(st)
    assert res.status == "complete"
    assert res.fits["adv"]["b"] == pytest.approx(4.0, rel=1e-9)
    assert res.fits["adv"]["loko"] == pytest.approx(0.0, abs=1e-12)
    assert res.fits["k3"]["loko"] > 0.03  # the slope of one kind mispredicts the other
    assert "| adv (`mismatch/adv_diff_mean`, abs) | 4 [" in res.insample and "**adv** predict(s) better than k3" in res.insample
    rec = P.calibration_record(st, res.fits, res.cells)
    assert rec["candidates"]["adv"]["range"] == [pytest.approx(0.01), pytest.approx(0.025)]
    # a re-run that did not repeat leaves its cell out
    bad = pd.DataFrame(rows)
    bad.loc[bad["run"].str.startswith("stale_s1"), "repeat"] = "step 1 x: 1.0 vs 2.0"
    bad.to_parquet(table)
    with pytest.raises(StudyError, match="1 kind"):
        P.analyze_predictor(st)  # one kind left: no leave-one-kind-out fit


def _smoke_sweep(root: Path) -> Path:
    """Three committed smoke runs of 3 steps: control, head perturbation and one step of staleness."""
    sets = {"control": {"mismatch.injector": "none"},
            "head": {"mismatch.injector": "head_perturb", "mismatch.magnitude": 0.5},
            "stale": {"mismatch.injector": "stale", "mismatch.magnitude": 1}}
    for arm, s in sets.items():
        cfg = resolve(preset="smoke", overrides=[f"{k}={v}" for k, v in {**s, "run.steps": 3, "run.eval_every": 2,
                                                                           "run.seed": 0, "mismatch.seed": 0}.items()])
        train(cfg, root / f"{arm}_s0__abc123")
    return root


def test_recompute_repeats_resumes_and_survives_a_kill(tmp_path):
    sweep = _smoke_sweep(tmp_path / "sweep")
    table = tmp_path / "harm" / "t.parquet"
    st = P.predictor_from_dict(_study_dict(sweep, table))
    said = []
    calls = []

    def killed_second(cfg, run_dir):
        calls.append(Path(run_dir).name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return train(cfg, run_dir)

    with pytest.raises(KeyboardInterrupt):
        recompute(st, say=said.append, train=killed_second)
    t = pd.read_parquet(table)
    assert sorted(set(t["run"])) == ["head_s0__abc123"]  # the first run's rows survive the kill
    counts = recompute(st, say=said.append)
    assert counts == {"ran": 1, "repeat": 1, "differ": 0}
    t = pd.read_parquet(table)
    assert sorted(set(t["run"])) == ["head_s0__abc123", "stale_s0__abc123"] and set(t["repeat"]) == {"ok"}
    assert list(t[t["run"] == "head_s0__abc123"]["step"]) == [0, 1, 2]
    assert (t[(t["step"] >= 1) & (t["run"] == "head_s0__abc123")]["rollout_corr/k3_kl"] > 0).all()
    # the re-run's candidate values are the committed run's own (the committed smoke runs log them too)
    old = read_metrics(sweep / "head_s0__abc123")
    new = t[t["run"] == "head_s0__abc123"].reset_index(drop=True)
    assert new["mismatch/k3_seq"].to_numpy().tobytes() == old[old["step"] <= 2]["mismatch/k3_seq"].to_numpy().tobytes()
    runs = [line for line in said if line.startswith("[")]
    assert len(runs) == 2 and all(re.fullmatch(r"\[\d/2\] S \w+__abc123: repeats bit for bit; \d+\.\d CPU-s", line)
                                  for line in runs)  # timings and the repeat check only: blind
    assert recompute(st, say=said.append) == {"ran": 0, "repeat": 0, "differ": 0}
    assert not (table.parent / ".recompute").exists()


def test_recompute_records_a_run_that_does_not_repeat(tmp_path):
    sweep = _smoke_sweep(tmp_path / "sweep")
    p = sweep / "stale_s0__abc123" / "metrics.parquet"
    m = pd.read_parquet(p)
    m.loc[m["step"] == 1, "train/loss"] += 1.0
    m.to_parquet(p)
    table = tmp_path / "t.parquet"
    counts = recompute(P.predictor_from_dict(_study_dict(sweep, table)), say=lambda s: None)
    assert counts == {"ran": 2, "repeat": 1, "differ": 1}
    rep = pd.read_parquet(table).groupby("run")["repeat"].first()
    assert rep["head_s0__abc123"] == "ok" and rep["stale_s0__abc123"].startswith("step 1 train/loss")


def test_recompute_refuses_unfrozen_and_unpinned(tmp_path, monkeypatch):
    sweep = _smoke_sweep(tmp_path / "sweep")
    with pytest.raises(StudyError, match="needs a frozen registration"):
        recompute(P.predictor_from_dict(_study_dict(sweep, tmp_path / "t.parquet", frozen=False)))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    with pytest.raises(StudyError, match="timlab --isa avx2 study recompute"):
        recompute(P.predictor_from_dict(_study_dict(sweep, tmp_path / "t.parquet", isa="avx2")))


def test_harm_study_file_is_valid_and_frozen():
    st = P.load_predictor(REPO / "docs/examples/studies/harm.yaml")
    assert st.frozen == st.hash
    assert st.last_step == 25 and st.seeds == (0, 1, 2)


def test_missing_start_is_rebuilt_by_its_commands_and_checked(tmp_path, monkeypatch):
    import hashlib

    from timlab.experiments.studies.recompute import ensure_start

    monkeypatch.chdir(tmp_path)
    d = _study_dict(tmp_path, tmp_path / "t.parquet", frozen=False)
    good = hashlib.sha256(b"weights").hexdigest()
    d["starts"] = [{"path": "runs/s", "sha256": good, "build": ["pretrain x --out runs/s"]}]
    st = P.predictor_from_dict(d)
    ran = []

    def run_command(argv):
        ran.append(argv)
        Path("runs/s").mkdir(parents=True)
        Path("runs/s/model.safetensors").write_bytes(b"weights")
        return 0

    with pytest.raises(StudyError, match="start runs/s not found; rebuild it with: timlab pretrain x --out runs/s"):
        ensure_start(st, "runs/s")
    ensure_start(st, "runs/s", run_command=run_command, say=lambda s: None)
    assert ran == [["pretrain", "x", "--out", "runs/s"]]
    ensure_start(st, "runs/s", run_command=run_command)  # present: not rebuilt
    assert len(ran) == 1
    Path("runs/s/model.safetensors").write_bytes(b"other")
    with pytest.raises(StudyError, match="is not the registered"):
        ensure_start(st, "runs/s")


# ------------------------------------------------------------------------------ part (b): out of sample
def test_dose_for_interpolates_log_magnitude_against_log_k3():
    from timlab.experiments.studies.oos import dose_for, round_sig

    # k3 ~ m^2 between 0.1 and 0.3: 1e-3 lies between 9e-4 (0.3) and 1e-2 (1): m = 0.3 * (1e-3/9e-4)^(log(10/3)/log(1e-2/9e-4))
    want = math.exp(math.log(0.3) + math.log(1e-3 / 9e-4) / math.log(1e-2 / 9e-4) * math.log(1 / 0.3))
    assert dose_for([1, 0.1, 0.3], [1e-2, 1e-4, 9e-4], 1e-3) == round_sig(want) == 0.32
    assert dose_for([0.1, 0.3, 1], [1e-4, 9e-4, 1e-2], 5e-3) == 0.71
    # no pair brackets 1e-3: the line through the two probed points, extrapolated (slope log 4 / log 3)
    assert dose_for([0.1, 0.3], [1e-4, 4e-4], 1e-3) == round_sig(0.3 * 2.5 ** (math.log(3) / math.log(4))) == 0.62
    assert round_sig(0.03147) == 0.031 and round_sig(1234.0, 3) == 1230.0
    with pytest.raises(ValueError, match="k3 > 0"):
        dose_for([0.1, 0.3], [0.0, 1e-3], 1e-3)


def _oos_cells(costs, noise=0.0, seeds=8, seed=0):
    from timlab.experiments.studies.oos import OosCells

    rng = np.random.default_rng(seed)
    cells = OosCells([f"c{i}" for i in range(len(costs))], ["k"] * len(costs), ["p"] * len(costs),
                     ["0"] * len(costs))
    ctrl = 0.9 + noise * rng.standard_normal(seeds)
    for c in costs:
        cells.control.append(ctrl)
        cells.arm.append(0.9 - c + noise * rng.standard_normal(seeds))
    return cells


def test_decide_planted_winner_paired_interval_and_miscalibration():
    from timlab.experiments.studies.oos import decide, min_cover, verdict_line

    assert [min_cover(n) for n in (7, 2, 6)] == [4, 1, 3]
    costs = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07]
    cells = _oos_cells(costs)  # no seed noise: every resample gives the same costs
    preds = {"k3": [(0, c + 0.02, c + 0.01, c + 0.03) for c in costs],       # biased by 0.02, covers none
             "good": [(0, c + 0.005, c - 0.01, c + 0.02) for c in costs],    # off by 0.005, covers all
             "wide": [(0, 2 * c, -1.0, 1.0) for c in costs]}                 # off by c, covers all
    dec = decide(cells, preds, "k3", boot=50)
    per = dec["per"]
    assert per["k3"]["rmse"] == pytest.approx(0.02, abs=1e-12) and per["good"]["rmse"] == pytest.approx(0.005, abs=1e-12)
    assert per["wide"]["rmse"] == pytest.approx(math.sqrt(sum(c * c for c in costs) / 7), abs=1e-12)
    assert per["good"]["gain"] == pytest.approx(0.015, abs=1e-12)
    assert per["good"]["gain_ci"] == pytest.approx((0.015, 0.015), abs=1e-12)
    assert [per[k]["covered"] for k in preds] == [0, 7, 7]
    assert [per[k]["miscalibrated"] for k in preds] == [True, False, False]
    assert dec["winner"] == "good" and dec["beats"] == ["good"]  # wide: RMSE sqrt(20) x 0.01 > 0.02
    line = verdict_line(dec, "a tiny model")
    assert line.startswith("Verdict: **good predicts better than k3**. Winner (smallest out-of-sample error): **good**, "
                           "RMSE 0.0050 [0.0050, 0.0050] over 7 cells; miscalibrated (intervals cover fewer than 4 of 7 "
                           "costs): k3. Regime: a tiny model.")
    # seed noise large against the differences: the paired interval holds 0, so none beats k3
    noisy = _oos_cells(costs, noise=0.05, seed=1)
    close = {"k3": preds["k3"], "near": [(0, c + 0.018, c, c + 0.04) for c in costs]}
    dec = decide(noisy, close, "k3", boot=400)
    assert dec["per"]["near"]["gain_ci"][0] < 0 < dec["per"]["near"]["gain_ci"][1]
    assert dec["beats"] == [] and "**none beats k3**" in verdict_line(dec, "r")
    again = decide(_oos_cells(costs, noise=0.05, seed=1), close, "k3", boot=400)
    assert again["per"]["near"]["rmse_ci"] == dec["per"]["near"]["rmse_ci"]  # same seed, same bits


def _planted_harm(tmp_path: Path):
    """A planted predictor study (head costs 0.04, stale 0.10; adv = cost / 4 exactly, k3 the same 0.02
    for both) whose out-of-sample study has two cells: a costs 0.02 (adv 0.005), b costs 0.05 (adv 0.0125)."""
    import yaml

    from timlab.experiments.studies.registration import load_study

    sweep = _planted_sweep(tmp_path)
    table = tmp_path / "harm" / "t.parquet"
    d = _study_dict(sweep, table, seeds=(0, 1), frozen=False)
    d["findings"] = {"file": "FINDINGS.md", "insample": "h-in", "oos": "h-oos"}
    d["oos"] = "oos.yaml"
    (tmp_path / "FINDINGS.md").write_text("x\n<!-- findings:h-in -->\n<!-- /findings:h-in -->\n"
                                          "<!-- findings:h-oos -->\n<!-- /findings:h-oos -->\n", encoding="utf-8")
    hashed = P.predictor_from_dict(d, root=tmp_path).hash
    (tmp_path / "harm.yaml").write_text(yaml.safe_dump({**d, "frozen": hashed}), encoding="utf-8")
    rows = []
    for r in P.rerun_list(P.predictor_from_dict(d, root=tmp_path)):
        c = {"head": 0.04, "stale": 0.10}[r.arm]
        rows += [{"source": "S", "run": r.run, "step": s, "rollout_corr/k3_kl": 0.02, "mismatch/adv_diff_mean": -c / 4,
                  "repeat": "ok"} for s in range(3)]
    table.parent.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(table)
    oos = {"study": "oos", "out": str(tmp_path / "oos_sweep"), "steps": 4,
           "sweep": {"base": {"preset": "smoke"}, "conditions": [
               {"name": f"{a}_s{s}", "set": {"run.seed": s, "run.steps": 4, **({"mismatch.injector": "logit_noise",
                "mismatch.magnitude": 0.1} if a != "control" else {})}} for s in range(4) for a in ("control", "a", "b")]},
           "endpoints": [{"name": "acc", "metric": "val/accuracy", "stat": "level"}],
           "families": [{"name": "cost", "endpoints": ["acc"]}],
           "predicted_by": {"study": "harm.yaml", "kinds": {"a": "noise", "b": "noise"}, "probe": str(tmp_path / "probe")}}
    (tmp_path / "oos.yaml").write_text(yaml.safe_dump(oos), encoding="utf-8")
    return P.load_predictor(tmp_path / "harm.yaml"), load_study(tmp_path / "oos.yaml")


def test_oos_predictions_gate_the_runs_then_decide(tmp_path, capsys):
    from timlab.experiments.studies.engine import planned_runs
    from timlab.experiments.studies.registration import freeze
    from timlab.experiments.studies.oos import PREDICTED, check_predicted

    pst, oos = _planted_harm(tmp_path)
    assert pst.hash == pst.frozen and pst.oos.endswith("oos.yaml")  # oos: is not part of the hash
    res = O.analyze_study(pst)
    assert res.oos.startswith(f"NOT YET PREDICTED: the in-sample fits exist; the probe {tmp_path / 'probe'} lacks a, b")
    with pytest.raises(StudyError, match="no out-of-sample run starts before its prediction; the probe .* lacks a, b"):
        check_predicted(oos)
    probe = {"a": 0.005, "b": 0.0125}
    write_sweep(tmp_path / "probe", list(probe), lambda n: pd.DataFrame(
        {"step": range(3), "rollout_corr/k3_kl": [0.01] * 3, "mismatch/adv_diff_mean": [probe[n]] * 3}), 2)
    res = O.analyze_study(pst)
    assert res.oos.startswith(PREDICTED)
    assert "| a | noise | 0.01 | 0.005 |" in res.oos and "| b | noise | 0.01 | 0.0125 |" in res.oos
    b_k3 = res.fits["k3"]["b"]
    assert f"| a | {0.01 * b_k3:+.4f} [" in res.oos and "| +0.0200 [" in res.oos and "| +0.0500 [" in res.oos
    assert "Out-of-sample runs" in res.oos and "INCOMPLETE" in res.oos and res.decision is None
    with pytest.raises(StudyError, match="block h-oos of .* does not hold the predictions: run `timlab study analyze"):
        check_predicted(oos)
    from timlab import cli

    assert cli.main(["study", "run", str(tmp_path / "oos.yaml")]) == 2  # the CLI's gate: one line, nothing run
    err = capsys.readouterr().err
    assert err.startswith("timlab: error: study oos: no out-of-sample run starts before its prediction") and \
        err.count("\n") == 1 and not Path(oos.out).exists()
    assert cli.main(["study", "analyze", str(tmp_path / "harm.yaml")]) == 0
    assert f"\nOut of sample:\n{PREDICTED.strip('*')} (written before any out-of-sample run; 2 cells;" \
        in capsys.readouterr().out  # plain text; --markdown prints the block's own Markdown
    O.analyze_and_write(pst, write=True)
    assert "predictions of 2 cells are in block h-oos" in check_predicted(oos)
    # the runs: a costs 0.02 and b 0.05, exactly what adv predicts; k3 predicts 0.01 b_k3 for both
    freeze(oos, oos.out)
    cost = {"control": 0.0, "a": 0.02, "b": 0.05}
    ids = {p.name: p.run_id for p in planned_runs(oos)}
    write_sweep(Path(oos.out), list(ids), lambda n: pd.DataFrame(
        {"step": range(5), "val/accuracy": [0.9 - cost[n.rsplit("_s", 1)[0]] + 0.001 * int(n[-1])] * 5,
         "train/response_length_mean": [(60.0 if n.startswith("b") else 20.0) + int(n[-1])] * 5,
         "rollout_corr/k3_kl": [0.0] * 5, "mismatch/frac_bitwise_equal": [1.0] * 5}), 4, run_ids=ids)
    res = O.analyze_and_write(pst, write=True)
    dec = res.decision
    assert dec["winner"] == "adv" and dec["per"]["adv"]["rmse"] == pytest.approx(0.0, abs=1e-12)
    want_k3 = math.sqrt(((0.02 - 0.01 * b_k3) ** 2 + (0.05 - 0.01 * b_k3) ** 2) / 2)
    assert dec["per"]["k3"]["rmse"] == pytest.approx(want_k3, abs=1e-12)
    assert dec["beats"] == ["adv"] and dec["per"]["adv"]["covered"] == 2
    assert "Verdict: **adv predicts better than k3**" in res.oos and "out of sample answers of 22-62 tokens" in res.oos
    assert not pst.calibration  # the planted study names no record file
    rec = P.calibration_record(pst, res.fits, res.cells, dec)
    assert rec["winner"] == "adv" and rec["oos"]["beats_reference"] and not rec["oos"]["miscalibrated"]
    assert P.calibration_record(pst, res.fits, res.cells)["winner"] is None  # before (b): no winner


def test_predicted_by_errors_name_the_field(tmp_path):
    from timlab.experiments.studies.registration import load_study, study_from_dict

    good = study_from_dict({**_oos_dict(tmp_path), "predicted_by": {"study": "harm.yaml", "probe": "p",
                                                                    "kinds": {"a": "noise"}}}, root=REPO / "docs/examples/studies")
    assert good.predicted_by.kinds == {"a": "noise"} and good.predicted_by.study.endswith("studies/harm.yaml")
    bad = [({"study": "harm.yaml", "probe": "p"}, "predicted_by: missing key 'kinds'"),
           ({"study": "harm.yaml", "probe": "p", "kinds": {"control": "x"}}, "the control 'control' is not a cell"),
           ({"study": "harm.yaml", "probe": "p", "kinds": []}, "predicted_by.kinds: expected a mapping arm -> kind"),
           ({"study": "nope.yaml", "probe": "p", "kinds": {"a": "x"}}, "predictor study file not found"),
           ({"study": "harm.yaml", "probe": "p", "kinds": {"a": "x"}, "bogus": 1}, "unknown key 'bogus'")]
    for pb, msg in bad:
        with pytest.raises(StudyError, match=re.escape(msg)):
            study_from_dict({**_oos_dict(tmp_path), "predicted_by": pb}, root=REPO / "docs/examples/studies")
    real = load_study(REPO / "docs/examples/studies/harm_oos.yaml")  # the committed file: 7 cells, 3 kinds
    from timlab.experiments.studies.oos import oos_cells

    cells = oos_cells(real)
    assert cells.probe == ["v0_noise_0.29", "v0_noise_0.58", "v0_temp_0.12", "v0_temp_0.25", "v0_kv_fp8",
                           "v0_kv_fp8_e5m2", "v1_kv_fp8"] and cells.control_key == ["0"] * 6 + ["1"]
    assert P.load_predictor(REPO / "docs/examples/studies/harm.yaml").oos == str(
        REPO / "docs/examples/studies/harm_oos.yaml")


def _oos_dict(tmp_path: Path) -> dict:
    return {"study": "o", "steps": 4, "sweep": {"base": {"preset": "smoke"}, "conditions": [
        {"name": "control_s0", "set": {"run.seed": 0}}, {"name": "a_s0", "set": {"run.seed": 0}}]},
        "endpoints": [{"name": "acc", "metric": "val/accuracy", "stat": "level"}],
        "families": [{"name": "cost", "endpoints": ["acc"]}]}
