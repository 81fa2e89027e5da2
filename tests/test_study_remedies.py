"""Study R26 (docs/examples/studies/remedies.yaml, docs/FINDINGS.md "New remedies at head_perturb
1") and the engine features it added, on planted data: per-run endpoints that open where a run first
reaches a value (the post-learning slope), max / sum / plus endpoints, a rule read on the p alone
(<= alpha), descriptive cells (runs, values, shares, a mean over the runs that have one, counts
without an interval), family tables without a heading or an alignment of their own, families computed
for text only, and paragraphs that print the analysis' numbers."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from study_sweep import write_sweep
from timlab.experiments.studies.stats import Comparison, holm, permutation_test
from timlab.experiments.studies.engine import analyze, planned_runs
from timlab.experiments.studies.registration import StudyError, freeze, load_study, study_from_dict
from timlab.experiments.studies.endpoints import window_stat
from timlab.experiments.studies.engine import _verdict
from timlab.experiments.studies.registration import Rule

REPO = Path(__file__).resolve().parents[1]
R26 = REPO / "docs" / "examples" / "studies" / "remedies.yaml"
STEPS = 150
LEVEL = {"none": 0.75, "token_tis": 0.86, "bypass_ppo_clip": 0.70, "k3_rs_token_tis": 0.80, "token_tis_bn": 0.76}
"""Each arm's planted accuracy from step 10 on (+ 0.01 x seed); bypass falls to 0.1 + 0.02 x seed at step 60,
and seeds 3 and 4 of k3_rs_token_tis stay at 0.5 (they never reach 0.6)."""
K3 = {"none": 0.12, "token_tis": 0.19, "bypass_ppo_clip": 0.23, "k3_rs_token_tis": 0.2, "token_tis_bn": 0.19}


def planted(name: str) -> pd.DataFrame:
    arm, seed = name.rsplit("_s", 1)
    s = int(seed)
    steps = np.arange(STEPS + 1)
    acc = np.full(steps.size, LEVEL[arm] + 0.01 * s)
    if arm == "bypass_ppo_clip":
        acc[steps >= 60] = 0.1 + 0.02 * s
    if arm == "k3_rs_token_tis" and s >= 3:
        acc[:] = 0.5
    acc[0] = 0.57  # one start
    ev = steps % 10 == 0
    train = np.where(steps >= 1, 1.0, np.nan)
    m = {"step": steps, "val/accuracy": np.where(ev, acc, np.nan), "rollout_corr/k3_kl": train * K3[arm],
         "mismatch/frac_bitwise_equal": train * 0.4, "train/response_length_mean": train * np.where(steps <= 75, 10, 20),
         "train/step_time_s": train * (0.2 + 0.1 * s), "time/eval_s": np.where(ev, 0.5, np.nan),
         "is/frac_truncated": train * (0.02 if "tis" in arm else 0.0), "train/clip_frac": train * (0.12 if arm == "bypass_ppo_clip" else 0.0)}
    if arm == "k3_rs_token_tis":
        m["rs/masked_frac"] = train * 0.7  # logged by the rejection arm only
    return pd.DataFrame(m)


@pytest.fixture(scope="module")
def r26(tmp_path_factory):
    study = load_study(R26)
    ids = {p.name: p.run_id for p in planned_runs(study)}
    out = write_sweep(tmp_path_factory.mktemp("r26") / "sweep", list(ids), planted, STEPS, run_ids=ids)
    return analyze(study, out)  # frozen: in the file, so no study.json is needed


def test_r26_registers_five_arms_of_five_seeds_against_no_remedy():
    study = load_study(R26)
    arms = list(dict.fromkeys(p.arm for p in planned_runs(study)))
    assert arms == list(LEVEL) and len(planned_runs(study)) == 25 and study.control == "none"
    assert study.frozen == study.hash and study.findings[1] == "surge-remedies"


def test_r26_planted_table_of_arms(r26):
    assert r26.status == "complete"
    lines = r26.text.splitlines()
    # no validity check is registered (every arm is under mismatch): the block opens with the table
    assert lines[0].startswith("| arm | seeds | realized k3 | final accuracy per seed (mean) | peak accuracy |")
    assert lines[1] == "|---|" + "---|" * 9
    assert lines[2] == ("| no remedy | 5 | 0.12 | 0.75, 0.76, 0.77, 0.78, 0.79 (0.770) | 0.770 | 0/5 [0.00, 0.52] | 0/5 "
                        "| 0.000 | - | 10.0 / 20.0 |")
    # bypass falls under both rules; 0.1 + 0.02 s; the clip share is its only correction; its slope is over the fall
    bypass = lines[4].split(" | ")
    assert bypass[:7] == ["| bypass_ppo_clip", "5", "0.23", "0.10, 0.12, 0.14, 0.16, 0.18 (0.140)", "0.720",
                          "5/5 [0.48, 1.00]", "5/5"]
    assert bypass[8] == "clipped 0.12"
    # two seeds never reach 0.6 (their peak is the start, 0.57): the slope is the mean of the other three, which
    # says so; two shares logged
    assert lines[5] == ("| decoupled_k3_rs_token_tis | 5 | 0.2 | 0.80, 0.81, 0.82, 0.50, 0.50 (0.686) | 0.714 | "
                        "0/5 [0.00, 0.52] | 0/5 | 0.000 (3 runs reached 0.6) | truncated 0.02, rejected 0.70 | 10.0 / 20.0 |")
    assert "| token TIS + batch normalize | 5 | 0.19 | 0.76, 0.77, 0.78, 0.79, 0.80 (0.780) |" in lines[6]


def test_r26_planted_verdicts_read_the_holm_p_alone(r26):
    final = {a: [planted(f"{a}_s{s}")["val/accuracy"].iloc[-1] for s in range(5)] for a in LEVEL}
    pairs = [(a, b) for a in ("bypass_ppo_clip", "k3_rs_token_tis", "token_tis_bn") for b in ("none", "token_tis")]
    p = [permutation_test(final[a], final[b]).p for a, b in pairs]
    adj = holm(p)
    # four comparisons separate completely (p 2/252 each); Holm over 6 lifts them to 6 x 2/252 = 0.048 <= 0.05
    assert [f"{x:.3f}" for i, x in enumerate(adj) if i not in (2, 4)] == ["0.048"] * 4
    assert min(adj[2], adj[4]) > 0.05
    rows = [x for x in r26.text.splitlines() if " vs " in x and x.startswith("| ")]
    names = {"none": "no remedy", "token_tis": "token TIS (C = 2)", "bypass_ppo_clip": "bypass_ppo_clip",
             "k3_rs_token_tis": "decoupled_k3_rs_token_tis", "token_tis_bn": "token TIS + batch normalize"}
    diffs = ["-0.630", "-0.740", "-0.084", "-0.194", "+0.010", "-0.100"]
    verdict = ["worse", "worse", "not separable with 5 seeds", "worse", "not separable with 5 seeds", "worse"]
    assert rows == [f"| {names[a]} vs {names[b]} | {d} | {x:.3f} | {y:.3f} | {v} |"
                    for (a, b), d, x, y, v in zip(pairs, diffs, p, adj, verdict)]
    assert r26.verdicts[("primary", "final_acc", "bypass_ppo_clip")] is False  # "above" does not hold: it is worse
    assert "| comparison (final accuracy) | mean A - mean B | raw p | Holm p (6 tests) | verdict |\n|---|---|---|---|---|" \
        in r26.text and "**" not in r26.text  # no heading


def test_r26_planted_paragraphs(r26):
    p6, timing = r26.text.split("\n\n")[-2:]
    assert p6 == ("P6 again (this sweep's warm start; token TIS vs no remedy, final accuracy, outside the family): "
                  "+0.110, raw p = 0.008. Plateau-rule falls (1/0), exact permutation: token TIS (C = 2) vs no remedy: "
                  "+0.000, p = 1.000; bypass_ppo_clip vs no remedy: +1.000, p = 0.008; decoupled_k3_rs_token_tis vs no "
                  "remedy: +0.000, p = 1.000; token TIS + batch normalize vs no remedy: +0.000, p = 1.000.")
    # 150 steps x (0.2 + 0.1 s) s + 16 evaluations x 0.5 s: 38 s (seed 0) to 98 s (seed 4)
    assert timing == "A run's logged step and evaluation times sum to 38-98 s on the shared machine (25 finished runs)."


# ------------------------------------------------------------------------------- the features, one by one
def test_window_opens_where_the_run_first_reaches_a_value():
    m = pd.DataFrame({"step": [0, 10, 20, 30, 40, 50], "x": [0.2, 0.5, 0.7, 0.8, 0.9, 0.9]})
    # reaches 0.6 at step 20; + lag 10 -> steps 30-50: (30, .8), (40, .9), (50, .9): Sxy = 1, Sxx = 200
    assert window_stat(m, "x", "slope", reach=0.6, lag=10) == pytest.approx(100 * 1 / 200)
    assert math.isnan(window_stat(m, "x", "slope", reach=0.6, lag=10, min_points=4))  # 3 values
    assert math.isnan(window_stat(m, "x", "level", reach=0.95))  # never reached
    assert window_stat(m, "x", "level", (None, 40), reach=0.5) == pytest.approx((0.5 + 0.7 + 0.8 + 0.9) / 4)
    assert window_stat(m, "x", "max") == 0.9 and window_stat(m, "x", "min", (10, None)) == 0.5
    assert window_stat(m, "x", "sum", (40, 50)) == 1.8


def test_a_rule_on_the_p_alone_differs_from_one_that_needs_the_interval():
    # Holm p exactly 0.05 and a bootstrap interval that crosses 0: only the p-alone rule calls it
    c = Comparison(mean=0.5, t_ci=(0.4, 0.6), boot_ci=(0.4, 0.6), diff=-0.1, diff_ci=(-0.2, 0.01), p=0.05, p_holm=0.05)
    kw = dict(test="above", holds="better", opposite="worse", fails="not separable")
    assert _verdict(Rule("r", interval=False, **kw), c, 1, (8, 8), True) == (False, "worse", "opposite")
    assert _verdict(Rule("r", **kw), c, 1, (8, 8), True) == (False, "not separable", "fails")
    # the smallest attainable p equal to alpha: testable on the p alone (<=), not under p < alpha
    floor = 2 / 252 * 6
    assert _verdict(Rule("r", alpha=floor, interval=False, **kw), c, 6, (5, 5), True)[1] == "not separable"
    assert _verdict(Rule("r", alpha=floor, **kw), c, 6, (5, 5), True)[1].startswith("not testable here")


def r26_dict(**over) -> dict:
    import yaml

    d = yaml.safe_load(R26.read_text())
    d.pop("frozen")
    d.update(over)
    return d


@pytest.mark.parametrize("over, message", [
    ({"paragraphs": ["{p7[final_acc][token_tis].p}"]}, "paragraphs[0]: field {p7[final_acc][token_tis].p}; valid:"),
    ({"paragraphs": ["{p6[fell][token_tis].p}"]}, "paragraphs[0]: field {p6[fell][token_tis].p}"),
    ({"paragraphs": ["{p6[final_acc][token_tis].q}"]}, "fields: mean, t_ci, boot_ci, diff, diff_ci, p, p_holm"),
    ({"paragraphs": ["{runs[seconds].median}"]}, "{runs[ENDPOINT].FIELD} (fields: min, max, mean, n)"),
    ({"paragraphs": ["{runs[seconds].max:.0z}"]}, "is not a format spec for a number"),
    ({"order": ["paragraphs", "tables", "families", "fits", "verdicts"]}, "order: paragraphs read the families'"),
])
def test_bad_paragraphs_are_refused_naming_the_field(over, message):
    with pytest.raises(StudyError, match="^") as e:
        study_from_dict(r26_dict(**over), root=R26.parent, source="r26.yaml")
    assert message in str(e.value)


def test_bad_cells_and_families_are_refused():
    d = r26_dict()
    d["families"][0]["columns"][1] = "diff:+.3z"
    with pytest.raises(StudyError, match=r"families\[0\]: columns: diff:\+\.3z: '\+\.3z' is not a Python format spec"):
        study_from_dict(d, root=R26.parent)
    d = r26_dict()
    d["families"][0]["columns"][1] = "mean:+.3f"
    with pytest.raises(StudyError, match="columns: mean:\\+.3f: 'mean'; valid choices: diff, p, p_holm"):
        study_from_dict(d, root=R26.parent)
    d = r26_dict()
    d["families"][1]["name"] = "runs"
    with pytest.raises(StudyError, match="families\\[1\\]: name: runs is taken"):
        study_from_dict(d, root=R26.parent)
    d = r26_dict()
    d["tables"][0]["columns"][6]["partial"] = " ({m} runs)"
    with pytest.raises(StudyError, match=r"columns\[6\]: partial: not a format string of \{k\} and \{n\}"):
        study_from_dict(d, root=R26.parent)
    d = r26_dict()
    d["tables"][0]["align"] = "right"
    with pytest.raises(StudyError, match="tables\\[0\\]: align: 'right'; valid choices: auto, left"):
        study_from_dict(d, root=R26.parent)


def test_a_paragraph_naming_a_comparison_the_family_lacks_is_refused(tmp_path):
    study = study_from_dict(r26_dict(paragraphs=["{p6[final_acc][bypass_ppo_clip].p}"]), root=R26.parent)
    ids = {p.name: p.run_id for p in planned_runs(study)}
    freeze(study, tmp_path / "sweep")
    out = write_sweep(tmp_path / "sweep", list(ids), planted, STEPS, run_ids=ids)
    with pytest.raises(StudyError, match="paragraphs\\[0\\]: .*no comparison 'bypass_ppo_clip' in family p6; valid "
                                         "choices: token_tis"):
        analyze(study, out)
