"""The MoE study's pre-registered analysis (``scripts/moe_tables.py study``), checked on synthetic
sweeps with planted effects before any study data exist; and ``stats.bootstrap_ratio_ci``.

The synthetic sweep is the registered spec's runs (docs/examples/moe.yaml: 7 arms x 8 seeds since
the 2026-11-25 amendment), each a run directory as the trainer leaves it (``status.json`` through ``RunDir``, one
``metrics.parquet`` row per step in ``MetricsLog``'s layout) under an ``index.parquet``."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pytest

from script_loader import REPO, load_script
from timlab.experiments.stats import bootstrap_ci, bootstrap_ratio_ci
from timlab.experiments.study.sweep_runs import grouped_seeds
from timlab.experiments.sweep import INDEX_FILE, load_spec
from timlab.rundir import RunDir
from timlab.rundir.metrics_log import MetricsLog

M = load_script("moe_tables")
SPEC = REPO / "docs" / "examples" / "moe.yaml"
STEPS = M.STUDY["steps"]
WANT = [c.name for c in load_spec(SPEC).conditions]
"""The study's runs, ``<arm>_s<seed>`` in the spec's order."""
SEEDS = range(8)
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


def _write_sweep(out) -> None:
    """The spec's runs with the planted effects, in the spec's order (seed by seed), each
    written as the trainer writes it (``MetricsLog``'s table, ``RunDir``'s status)."""
    rng = np.random.default_rng(0)
    index = []
    for name in WANT:
        seed = int(name.rsplit("_s", 1)[1])
        run_id = f"{name}__{seed:06x}"
        k3, flip, drop, gdrop, decline = PLANTED[M.arm(name)]
        (out / run_id).mkdir(parents=True)
        log = MetricsLog(out / run_id)
        log.rows = _metrics(rng, k3=k3, flip=flip, acc_drop=drop, gold_drop=gdrop, decline=decline
                            ).to_dict("records")
        log._flush()  # the trainer appends row by row; one write of the same rows gives the same file
        RunDir(out / run_id).write_status("finished", step=STEPS, total_steps=STEPS)
        index.append({"run_id": run_id, "condition": name, "spec_condition": name, "run_dir": run_id,
                      "state": "finished", "last_step": STEPS})
    pd.DataFrame(index).to_parquet(out / INDEX_FILE, index=False)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "sweep"
    _write_sweep(out)
    return out


@pytest.fixture(scope="module")
def per(planted):
    return M.collect(str(planted), M.STUDY, endpoints=M.study_endpoints)


@pytest.fixture(scope="module")
def analysis(planted, tmp_path_factory):
    return M.study(str(planted), spec=SPEC, erosion=tmp_path_factory.mktemp("no_erosion"))


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
            assert lo > 0
        assert lo == float(row.split(" | ")[2].split("[")[1].split(",")[0])  # the interval's lower end
        assert abs(lo) < 0.05  # planted: no effect; the bound is noise-sized
        # nothing to recover: the replay arm of a non-eroding arm is never said to recover
        assert "recovers" not in _row(analysis, endpoint, "router_bf16_replay - router_bf16")
    assert "no effect" not in analysis
    assert "the erosion study is not complete (0 of 88 runs)" in analysis


def test_a_control_guard_violation_voids_the_study(planted, tmp_path):
    bad = tmp_path / "sweep"
    shutil.copytree(planted, bad)
    m = pd.read_parquet(bad / "control_s3__000003" / "metrics.parquet")
    m.loc[m["step"] == 123, ["rollout_corr/k3_kl", "mismatch/frac_bitwise_equal"]] = [1e-9, 0.998]
    m.to_parquet(bad / "control_s3__000003" / "metrics.parquet", index=False)
    text = M.study(str(bad), spec=SPEC)
    assert "BROKEN" in text and text.endswith("VOID (re-run, do not analyse).") and "erodes" not in text
    # a control stopped by the guard (run.guard=true) voids it without waiting for the other runs
    RunDir(bad / "control_s5__000005").write_status("guard_failed", step=7, total_steps=STEPS)
    RunDir(bad / "bf16_s5__000005").write_status("running", step=7, total_steps=STEPS)
    assert M.study(str(bad), spec=SPEC).startswith("VOID: the zero-mismatch guard stopped control_s5 (rule 1")


def test_a_run_whose_start_differs_voids_the_study(per):
    assert M.analyse(per, WANT).splitlines()[0].endswith(": VALID.")
    moved = {a: [dict(r) for r in v] for a, v in per.items()}
    moved["bf16"][6]["start_acc"] = 0.986  # one run did not start from the registered start
    text = M.analyse(moved, WANT)
    assert "held" in text and "DIFFERS between runs (2 distinct)" in text and text.endswith("VOID (re-run, do not analyse).")


def test_an_incomplete_sweep_is_refused(planted, tmp_path):
    part = tmp_path / "sweep"
    shutil.copytree(planted, part)
    for name in ("bf16_s7", "control_s7", "router_bf16_replay_s6"):
        RunDir(part / f"{name}__{int(name[-1]):06x}").write_status("running", step=300, total_steps=STEPS)
    assert M.study(str(part), spec=SPEC) == (
        "INCOMPLETE: 53 of 56 runs finished at step 500 (missing: router_bf16_replay seed 6, control seed 7, "
        "bf16 seed 7); no endpoint is computed before the study is complete (no interim analysis).")
    assert M.study(str(tmp_path / "not_started"), spec=SPEC).startswith("INCOMPLETE: 0 of 56 runs finished")


# ------------------------------------------------------------------------------- rule 6
def test_cross_study_places_arms_against_the_erosion_fit():
    """A planted erosion law excess = -c * k3^alpha (per step): an MoE arm on the law costs what the
    law says; one far below it costs more."""
    rng = np.random.default_rng(1)
    c, alpha = 2e-3, 0.8
    ero = {"control": [_ero(rng, 0.0, 0.0) for _ in SEEDS]}
    for dose, k3 in zip((0.11, 0.175, 0.3, 0.49, 0.78, 1.1), (4e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)):
        ero[f"head_{dose}"] = [_ero(rng, k3, -c * k3**alpha * 100) for _ in SEEDS]
    for a in ("bf16", "fp8", "int8", "stale_1"):
        ero[a] = [_ero(rng, 1e-3, 0.0) for _ in SEEDS]
    col = {"control": {"acc_slope": np.zeros(8), "gold_slope": np.zeros(8), "k3": np.zeros(8)},
           "on_law": {"acc_slope": np.full(8, -c * 1e-2**alpha * 100) + rng.normal(0, 1e-5, 8),
                      "gold_slope": np.full(8, -c * 1e-2**alpha * 100) + rng.normal(0, 1e-5, 8), "k3": np.full(8, 1e-2)},
           "far_below": {"acc_slope": np.full(8, -0.5), "gold_slope": np.full(8, -0.5), "k3": np.full(8, 1e-4)}}
    lines = M._cross_study(col, ["on_law", "far_below"], ero, n=500)
    text = "\n".join(lines)
    assert text.count("costs what a head perturbation of the same k3 costs") == 2  # on_law, both slopes
    assert text.count("- far_below: realized k3 1.0e-04") == 2 and "costs more than a head perturbation" in text
    assert "nothing is placed" in "\n".join(M._cross_study(col, ["on_law"], {"control": ero["control"]}, n=500))


def _ero(rng, k3: float, slope: float) -> dict:
    x = slope + rng.normal(0, 1e-5)
    return {"k3": k3, "acc_slope": x, "gold_slope": x, "guard": True, "rows": 500, "start_acc": 0.965}


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
