"""The MoE study's pre-registered analysis (docs/examples/studies/moe.yaml, run by the study engine),
checked on a synthetic sweep with planted effects; ``stats.bootstrap_ratio_ci``; and the
descriptive tables of scripts/moe_tables.py.

The synthetic sweep is the registered spec's runs (docs/examples/moe.yaml: 7 arms x 8 seeds since
the 2026-11-25 amendment), each a run directory as the trainer leaves it (``status.json`` through ``RunDir``, one
``metrics.parquet`` row per step in ``MetricsLog``'s layout) under an ``index.parquet``."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest

from script_loader import REPO, load_script
from study_sweep import write_sweep
from timlab.experiments.studies.stats import bootstrap_ci, bootstrap_ratio_ci
from timlab.experiments.studies.engine import analyze, planned_runs
from timlab.experiments.studies.registration import load_study
from timlab.experiments.studies.sweep_runs import grouped_seeds
from timlab.experiments.sweeps.runner import INDEX_FILE
from timlab.rundir import RunDir
from timlab.rundir.metrics_log import MetricsLog

M = load_script("moe_tables")
STUDY = load_study(REPO / "docs" / "examples" / "studies" / "moe.yaml")
STEPS = STUDY.steps
IDS = {p.name: p.run_id for p in planned_runs(STUDY)}
WANT = list(IDS)
"""The study's runs, ``<arm>_s<seed>`` in the spec's order."""
START = (0.988, -0.44)
"""The shared step-0 evaluation (accuracy, gold log-prob) of every run."""


# ------------------------------------------------------------------------------- statistics
def test_bootstrap_ratio_ci():
    a, b = [1.0, 1.1, 0.9, 1.0], [10.0, 11.0, 9.0, 10.0]
    lo, hi = bootstrap_ratio_ci(a, b)
    assert lo < 0.1 < hi and hi - lo < 0.03 and bootstrap_ratio_ci(a, b) == (lo, hi)  # fixed seed: repeatable
    assert bootstrap_ratio_ci([2.0] * 3, [4.0] * 5) == (0.5, 0.5)  # no spread: the ratio of means
    # a constant denominator: the numerator's own bootstrap interval (the same draws), scaled
    x = [1.0, 2.0, 3.0, 4.0, 7.0]
    assert bootstrap_ratio_ci(x, [4.0] * 3) == pytest.approx(tuple(v / 4 for v in bootstrap_ci(x)), rel=1e-12)
    with pytest.raises(ValueError, match="denominator"):
        bootstrap_ratio_ci([1.0, 2.0], [0.0, 0.0])


def test_seed_lists_compress_to_ranges():
    assert grouped_seeds(
        ["control_s0", "control_s1", "control_s2", "bf16_s3", "bf16_s5", "control_s7"]) == \
        "control seeds 0-2, 7, bf16 seeds 3, 5"


# ------------------------------------------------------------------------------- synthetic sweeps
def _metrics(rng, *, k3: float, flip: float, acc_drop: float, gold_drop: float, decline: float = 0.0,
             start: tuple[float, float] = START) -> pd.DataFrame:
    """One 500-step run: the mechanism every RL step (none at step 0, the start's evaluation), an
    evaluation every 25 steps. A drop lowers the level from step 25 on, a decline (per 100 steps)
    tilts accuracy and gold log-prob from there; each run's evaluations carry their own noise."""
    steps = np.arange(STEPS + 1)
    rl = np.where(steps >= 1, 1.0, np.nan)  # (501,)
    ev = np.where(steps % 25 == 0, 1.0, np.nan)
    acc = 0.97 - acc_drop - decline * steps / 100 + 0.004 * rng.standard_normal(steps.size)
    gold = -0.20 - gold_drop - 10 * decline * steps / 100 + 0.01 * rng.standard_normal(steps.size)
    acc[0], gold[0] = start
    return pd.DataFrame({
        "step": steps, "train/step_time_s": 1.0,
        "rollout_corr/k3_kl": rl * (k3 * (1 + 0.1 * rng.standard_normal(steps.size)) if k3 else 0.0),
        "mismatch/frac_bitwise_equal": rl * (0.3 if k3 else 1.0),
        "mismatch/router_flip_frac": rl * flip, "mismatch/router_flip_frac_any_layer": rl * 3 * flip,
        "mismatch/abs_diff_mean_router_flipped": rl * (0.02 if flip else 0.0),
        "mismatch/abs_diff_mean_router_unflipped": rl * (1e-3 if k3 else 0.0),
        "val/accuracy": ev * acc, "val/gold_logprob": ev * gold, "time/eval_s": ev * 5.0})


PLANTED = {  # arm: (k3, flip frac, accuracy drop, gold log-prob drop, decline per 100 steps)
    "control": (0.0, 0.0, 0.0, 0.0, 0.0),
    "bf16": (3e-3, 6e-3, 0.05, 0.3, 0.0),          # erodes on both levels
    "bf16_replay": (3e-4, 6e-3, 0.0, 0.0, 0.0),    # replay removes most k3 and recovers both levels
    "router_bf16": (1.5e-5, 1.6e-3, 0.0, 0.0, 0.0),  # no effect: "no detectable erosion" with a bound
    "router_bf16_replay": (8e-8, 1.5e-3, 0.0, 0.0, 0.0),
    "kv_fp8_e5m2": (5e-3, 0.05, 0.0, 0.0, 0.02),   # erodes on both slopes (a decline, no drop)
    "kv_fp8_e5m2_replay": (3e-3, 0.05, 0.0, 0.0, 0.0),  # replay recovers both slopes
}


def _sweep(root, *, names=None, start=None):
    """The spec's runs with the planted effects at ``root``/sweeps/moe (``names``: only these;
    ``start``: name -> another step-0 evaluation); each run's noise from its own seed."""
    def run(name):
        arm, seed = name.rsplit("_s", 1)
        k3, flip, drop, gdrop, decline = PLANTED[arm]
        rng = np.random.default_rng([int(seed), list(PLANTED).index(arm)])
        return _metrics(rng, k3=k3, flip=flip, acc_drop=drop, gold_drop=gdrop, decline=decline,
                        start=(start or {}).get(name, START))
    return write_sweep(root / "sweeps" / "moe", names or WANT, run, STEPS, run_ids=IDS)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    _sweep(root)
    return root


@pytest.fixture(scope="module")
def analysis(planted):
    res = analyze(STUDY, root=planted)
    assert res.status == "complete"
    return res.text


def _row(text: str, endpoint: str, comparison: str) -> str:
    block = text.split(f"**{endpoint}")[1].split("\n\n**")[0]
    return next(line for line in block.splitlines() if line.startswith(f"| {comparison} |"))


def test_planted_sweep_is_valid_and_mechanism_is_measured(analysis):
    first = analysis.splitlines()[0]
    assert first.startswith("Validity (rule 1): control guard") and "held" in first and first.endswith("VALID.")
    assert f"the same in all {len(WANT)} runs (accuracy 0.988, gold log-prob -0.440)" in first
    assert len(WANT) == 56  # 7 arms x 8 seeds (amendment of 2026-11-25)
    mech = analysis.split("**Mechanism**")[1].split("\n\n**")[0]
    bf16 = next(line for line in mech.splitlines() if line.startswith("| bf16 |"))
    assert "| in the MoE range |" in bf16  # 3e-3 +- 10% per step, 500 steps, 8 seeds
    assert "| below the dense range |" in next(line for line in mech.splitlines() if line.startswith("| router_bf16 |"))
    ctrl = next(line for line in mech.splitlines() if line.startswith("| control |"))
    assert ctrl == "| control | 0.000 [0.000, 0.000] [0.000, 0.000] | - | 0.000 [0.000, 0.000] | 0.000 | 0.000 / 0.000 |"
    # flips: the planted rate, 3x of it at any layer, |r| 0.02 at flipped and 1e-3 at unflipped positions
    assert bf16.endswith("| 6.0e-03 [6.0e-03, 6.0e-03] | 0.018 | 0.020 / 1.0e-03 |"), bf16


def test_an_eroding_arm_is_detected(analysis):
    for endpoint in ("mean accuracy", "mean gold log-prob"):
        row = _row(analysis, endpoint, "bf16 - control")
        assert row.endswith("| **erodes** |"), row
        # all 8 bf16 seeds below all 8 controls: the exact test's floor, 2/12,870, Holm over 9 at most x9
        p, p_holm = (float(x) for x in row.split(" | ")[3:5])
        assert p == round(2 / 12870, 4) and p_holm <= round(9 * 2 / 12870, 4)
    acc = _row(analysis, "mean accuracy", "bf16 - control")
    diff = float(acc.split(" | ")[2].split(" ")[0])
    assert diff == pytest.approx(-0.05 * 20 / 19, abs=0.005)  # 19 evaluations in the window, 20 after the drop


def test_replay_removes_mismatch_and_recovers(analysis):
    rep = analysis.split("**Router replay against no replay**")[1].split("\n\n**")[0]
    k3 = next(line for line in rep.splitlines() if "| realized k3 | bf16_replay / bf16 |" in line)
    assert k3.endswith("| **removes the flip-driven mismatch** |")
    ratio = float(k3.split(" | ")[2].split(" ")[0])
    assert ratio == pytest.approx(0.1, rel=0.05)
    flips = next(line for line in rep.splitlines() if "| router flip frac (pairs) | bf16_replay / bf16 |" in line)
    assert flips.endswith("| not separable |")  # the same planted flip rate with and without replay
    for endpoint in ("mean accuracy", "mean gold log-prob"):
        assert _row(analysis, endpoint, "bf16_replay - bf16").endswith("| **recovers** |")


def test_a_slow_decline_erodes_the_slopes_and_replay_recovers_them(analysis):
    for endpoint, planted in (("accuracy slope", -0.02), ("gold log-prob slope", -0.2)):
        row = _row(analysis, endpoint, "kv_fp8_e5m2 - control")
        assert row.endswith("| **erodes** |"), row
        assert float(row.split(" | ")[2].split(" ")[0]) == pytest.approx(planted, rel=0.1)
        assert _row(analysis, endpoint, "kv_fp8_e5m2_replay - kv_fp8_e5m2").endswith("| **recovers** |")
        assert "no detectable erosion" in _row(analysis, endpoint, "bf16 - control")  # a drop is not a slope
        # bf16_replay sits above bf16 on a level but bf16 does not erode the slope: never a recovery there
        assert "recovers" not in _row(analysis, endpoint, "bf16_replay - bf16")
    mech = analysis.split("**Mechanism**")[1].split("\n\n**")[0]
    assert "| in the MoE range |" in next(line for line in mech.splitlines() if line.startswith("| kv_fp8_e5m2 |"))


def test_an_arm_without_effect_gets_a_bound_not_a_null(analysis):
    for endpoint in ("mean accuracy", "accuracy slope", "mean gold log-prob", "gold log-prob slope"):
        row = _row(analysis, endpoint, "router_bf16 - control")
        assert "| no detectable erosion (costs " in row, row
        if "costs at most " in row:
            lo = float(row.split("costs at most ")[1].split(")")[0])
        else:  # the whole interval above 0 (noise on a null arm can do that): no cost at all
            lo = float(row.split("costs none: the interval [")[1].split(",")[0])
            assert lo >= 0  # printed to 4 decimals: +0.0000 for an end just above 0
        assert lo == float(row.split(" | ")[2].split("[")[1].split(",")[0])  # the interval's lower end
        assert abs(lo) < 0.05  # planted: no effect; the bound is noise-sized
        # nothing to recover: the replay arm of a non-eroding arm is never said to recover
        assert "recovers" not in _row(analysis, endpoint, "router_bf16_replay - router_bf16")
    assert "no effect" not in analysis
    assert ("Cross-study (rule 6, descriptive): the erosion study is not complete (0 of 88 runs), so it has no fit; "
            "nothing is placed.") in analysis
    assert analysis.endswith("`python scripts/moe_tables.py layers SWEEP` on the machine that ran it.")


def test_a_control_guard_violation_voids_the_study(planted, tmp_path):
    shutil.copytree(planted / "sweeps", tmp_path / "sweeps")
    bad = tmp_path / "sweeps" / "moe" / IDS["control_s3"] / "metrics.parquet"
    m = pd.read_parquet(bad)
    m.loc[m["step"] == 123, ["rollout_corr/k3_kl", "mismatch/frac_bitwise_equal"]] = [1e-9, 0.998]
    m.to_parquet(bad, index=False)
    text = analyze(STUDY, root=tmp_path).text
    assert "BROKEN" in text and text.endswith("VOID (re-run, do not analyse).") and "erodes" not in text
    # a control stopped by the guard (run.guard=true) voids it without waiting for the other runs
    RunDir(tmp_path / "sweeps" / "moe" / IDS["control_s5"]).write_status("guard_failed", step=7, total_steps=STEPS)
    RunDir(tmp_path / "sweeps" / "moe" / IDS["bf16_s5"]).write_status("running", step=7, total_steps=STEPS)
    assert analyze(STUDY, root=tmp_path).text.startswith("VOID: the zero-mismatch guard stopped control_s5 (")


def test_a_run_whose_start_differs_voids_the_study(tmp_path):
    _sweep(tmp_path, start={"bf16_s6": (0.986, -0.44)})  # one run did not start from the registered start
    text = analyze(STUDY, root=tmp_path).text
    assert "held" in text and "DIFFERS between runs (2 distinct)" in text and text.endswith("VOID (re-run, do not analyse).")


def test_an_incomplete_sweep_is_refused(tmp_path):
    _sweep(tmp_path, names=[n for n in WANT if n not in ("bf16_s7", "control_s7", "router_bf16_replay_s6")])
    assert analyze(STUDY, root=tmp_path).text == (
        "INCOMPLETE: 53 of 56 runs finished at step 500 (missing: router_bf16_replay seed 6, control seed 7, "
        "bf16 seed 7); no endpoint is computed before the study is complete (no interim analysis).")
    assert analyze(STUDY, root=tmp_path / "not_started").text.startswith("INCOMPLETE: 0 of 56 runs finished")


def test_layers_table_from_distributions(tmp_path):
    """``layers``: per arm and sparse layer, the mean over steps and runs of the flip fraction the
    trainer appends to distributions.jsonl."""
    index = []
    for name, fracs in (("bf16_s0", (0.01, 0.03)), ("bf16_s1", (0.03, 0.05))):
        log = MetricsLog(tmp_path / name)
        (tmp_path / name).mkdir()
        log.rows = _metrics(np.random.default_rng(0), k3=1e-3, flip=0.01, acc_drop=0, gold_drop=0).to_dict("records")
        log._flush()
        for step in (1, 2):
            log.append_distribution(step, {"router_flip_frac_by_layer": {0: fracs[0] * step, 1: fracs[1] * step}})
        index.append({"run_id": name, "spec_condition": name, "run_dir": name, "state": "finished"})
    pd.DataFrame(index).to_parquet(tmp_path / INDEX_FILE, index=False)
    table = M.layers(str(tmp_path))
    assert "| bf16 | 2 | 0.030 | 0.060 |" in table  # (0.015 + 0.045) / 2, (0.045 + 0.075) / 2
