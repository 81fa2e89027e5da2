"""The study-engine features Study L1 registers, on synthetic grouped sweeps with planted effects:
an endpoint on the log-odds scale (``scale: logit``), the exponent of a fixed-k3 arm's cost against
the answer length (``kind: length_exponent``) with the tests that read its interval, and the margin
rules (``test: within``: the same cost to within a share of a reference arm's cost; ``test: under``).
Then Study L1's own file on a planted "follows T * k3" sweep."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from study_sweep import write_sweep
from timlab.experiments.studies.stats import LOGIT_CLIP, logit
from timlab.experiments.studies.engine import analyze, planned_runs

from timlab.experiments.studies.registration import StudyError, freeze, study_from_dict

REPO = Path(__file__).resolve().parents[1]
STEPS = 40
SEEDS = 5
T = {"1": 30.0, "31": 300.0, "109": 1000.0}
"""Each group's planted mean response length (the control's, which is the group's T)."""
BASE = 0.9
"""The controls' accuracy level."""
NOISE = 1e-3
"""Each run's accuracy level is shifted by NOISE x a standard normal draw of its own."""


def registration(**over) -> dict:
    """Three lengths (groups r1, r31, r109) x control and spread, plus hi and lo at r109, 5 seeds."""
    arms = {g: ["control", "spread"] + (["hi", "lo"] if g == "109" else []) for g in T}
    conds = [{"name": f"r{g}_{a}_s{s}", "set": {"mismatch.injector": "none" if a == "control" else "head_perturb",
                                                 **({} if a == "control" else {"mismatch.magnitude": 1.0}),
                                                 "run.seed": s, "mismatch.seed": s}}
             for s in range(SEEDS) for g in T for a in arms[g]]
    sweep = {"base": {"preset": "smoke", "set": {"run.steps": STEPS}}, "conditions": conds}
    d = {"study": "l1_planted", "sweep": sweep,
         "steps": STEPS, "arm_pattern": "r(?P<group>\\d+)_(?P<arm>.+)_s\\d+", "groups": "restate",
         "endpoints": [{"name": "k3", "metric": "rollout_corr/k3_kl", "stat": "level", "window": [10, None]},
                       {"name": "length", "metric": "train/response_length_mean", "stat": "level",
                        "window": [10, None]},
                       {"name": "acc", "metric": "val/accuracy", "stat": "level", "window": [10, None]},
                       {"name": "acc_logit", "metric": "val/accuracy", "stat": "level", "window": [10, None],
                        "scale": "logit"}],
         "families": [{"name": "cost", "endpoints": ["acc", "acc_logit"], "rule": "erodes"},
                      {"name": "same", "endpoints": ["acc", "acc_logit"], "against": "lo", "arms": ["hi"],
                       "rule": "same cost"},
                      {"name": "lo_share", "endpoints": ["acc"], "arms": ["lo"], "rule": "under a quarter of hi"}],
         "rules": [{"name": "erodes", "test": "below"},
                   {"name": "same cost", "test": "within", "margin": 0.5, "margin_of": "spread",
                    "holds": "**the same cost** (within +-{margin})", "fails": "differ (margin +-{margin})"},
                   {"name": "under a quarter of hi", "test": "under", "margin": 0.25, "margin_of": "hi"}],
         "fits": [{"kind": "length_exponent", "name": "spread, accuracy", "endpoint": "acc", "arm": "spread",
                   "tests": [{"name": "follows T * k3", "holds": 1, "excludes": 0},
                             {"name": "slower than T * k3", "below": 1}]},
                  {"kind": "length_exponent", "name": "spread, log-odds", "endpoint": "acc_logit", "arm": "spread",
                   "tests": [{"name": "follows T * k3", "holds": 1, "excludes": 0}]}]}
    d.update(over)
    return d


def levels(costs: dict) -> dict:
    """{run name: its accuracy level}: the group's control level (BASE) minus the planted cost of
    its (group, arm) (``costs``; 0 for the controls), plus its own noise."""
    out = {}
    for g in T:
        for a in ("control", "spread", "hi", "lo"):
            for s in range(SEEDS):
                rng = np.random.default_rng([int(g), ("control", "spread", "hi", "lo").index(a), s])
                out[f"r{g}_{a}_s{s}"] = BASE - costs.get((g, a), 0.0) + NOISE * float(rng.standard_normal())
    return out


def metrics_of(level: dict):
    """Each run's table: step 0 the one start (0.95), then its level at the evaluations of steps
    10-40; its group's T as its mean response length; k3 1e-3 in the treated arms, exactly 0 in the
    controls (their guard held)."""
    def of(name: str) -> pd.DataFrame:
        g, arm = name.split("_")[0][1:], name.split("_")[1]
        steps = np.arange(STEPS + 1)
        ev = np.where(steps % 10 == 0, 1.0, np.nan)
        acc = np.where(steps == 0, 0.95, level[name])
        rl = np.where(steps >= 1, 1.0, np.nan)
        k3 = 0.0 if arm == "control" else 1e-3
        return pd.DataFrame({"step": steps, "val/accuracy": ev * acc, "val/gold_logprob": ev * -0.3,
                             "rollout_corr/k3_kl": rl * k3,
                             "mismatch/frac_bitwise_equal": rl * (1.0 if k3 == 0 else 0.4),
                             "train/response_length_mean": rl * T[g]})
    return of


def run(tmp_path, costs: dict, **over):
    """The analysis of a sweep with the planted ``costs`` ((group, arm) -> accuracy lost), and the run levels."""
    study = study_from_dict(registration(**over), root=tmp_path, source="l1_planted.yaml")
    ids = {p.name: p.run_id for p in planned_runs(study)}
    level = levels(costs)
    freeze(study, tmp_path / "sweep")
    write_sweep(tmp_path / "sweep", list(ids), metrics_of(level), STEPS, run_ids=ids)
    return analyze(study, tmp_path / "sweep"), level


def power(b: float, a: float) -> dict:
    """The spread arm's planted cost a * T^b at each length."""
    return {(g, "spread"): a * t ** b for g, t in T.items()}


def mean_of(level: dict, g: str, arm: str, f=lambda x: x) -> float:
    return float(np.mean([f(level[f"r{g}_{arm}_s{s}"]) for s in range(SEEDS)]))


# ------------------------------------------------------------------------------- the log-odds scale
def test_logit_clips_to_its_one_range():
    assert LOGIT_CLIP == (0.005, 0.995)
    assert logit(0.5) == 0.0 and logit(0.9) == pytest.approx(math.log(9))
    assert logit(1.0) == logit(0.995) == pytest.approx(math.log(199)) and logit(0.0) == pytest.approx(-logit(1.0))
    assert math.isnan(logit(math.nan))


def test_the_logit_scale_gives_the_planted_log_odds_difference(tmp_path):
    costs = {**power(1.0, 1e-4), ("109", "hi"): 0.1, ("109", "lo"): 0.1}
    res, level = run(tmp_path, costs)
    # spread at r109: accuracy 0.8 against 0.9, a log-odds difference of logit(0.8) - logit(0.9) = -0.811
    want = mean_of(level, "109", "spread", logit) - mean_of(level, "109", "control", logit)
    assert want == pytest.approx(math.log(4) - math.log(9), abs=0.01)
    block = res.text.split("**acc_logit**")[1]
    row = next(x for x in block.splitlines() if x.startswith("| 109 | spread |"))
    assert f"| {want:+.4f} [" in row and row.endswith("| **yes** |")
    assert res.verdicts["cost", "acc_logit", ("109", "spread")] is True
    # the accuracy scale's difference of the same runs is the plain one, -0.1
    acc = next(x for x in res.text.split("**acc**")[1].splitlines() if x.startswith("| 109 | spread |"))
    assert f"| {mean_of(level, '109', 'spread') - mean_of(level, '109', 'control'):+.4f} [" in acc


def test_a_scale_on_a_slope_or_an_unknown_scale_is_a_one_line_error(tmp_path):
    for endpoint, message in (
            ({"name": "s", "metric": "val/accuracy", "stat": "slope", "scale": "logit"},
             "endpoints[4]: scale: logit applies to a level of the metric (level, first, last, start, final, max, "
             "min), not to stat slope"),
            ({"name": "s", "metric": "val/accuracy", "stat": "level", "scale": "probit"},
             "endpoints[4]: scale: 'probit'; valid choices: logit")):
        d = registration()
        d["endpoints"].append(endpoint)
        with pytest.raises(StudyError) as e:
            study_from_dict(d, root=tmp_path, source="s.yaml")
        assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------- the length exponent
def test_fit_exponent_recovers_a_power_and_refuses_a_cost_without_a_log():
    from timlab.experiments.studies.fits import fit_exponent

    a, b = fit_exponent([30.0, 300.0, 1000.0], [2e-4 * t ** 0.7 for t in (30.0, 300.0, 1000.0)])
    assert (a, b) == pytest.approx((2e-4, 0.7))
    assert fit_exponent([30.0, 300.0], [0.01, 0.0]) is None and fit_exponent([30.0], [0.01]) is None
    assert fit_exponent([300.0, 300.0], [0.01, 0.02]) is None


def test_a_planted_exponent_of_1_is_recovered_with_an_interval_holding_1(tmp_path):
    res, level = run(tmp_path, {**power(1.0, 1e-4), ("109", "hi"): 0.1, ("109", "lo"): 0.1})
    line = next(x for x in res.text.splitlines() if x.startswith("**Length exponent, spread, accuracy**"))
    b, lo, hi = (float(x) for x in line.split("b = ")[1].split(" (a = ")[0].replace("[", "").replace("]", "")
                 .replace(",", "").split())
    Ts, cost = list(T.values()), [mean_of(level, g, "control") - mean_of(level, g, "spread") for g in T]
    assert b == pytest.approx(np.polyfit(np.log(Ts), np.log(cost), 1)[0], abs=0.005)
    assert b == pytest.approx(1.0, abs=0.05)
    assert lo <= 1 <= hi and lo > 0.5 and hi < 1.5
    assert "0 (0.0%) without an exponent" in line
    assert "1: T 30.0, cost 3.0e-03 [" in line and "109: T 1000.0, cost 0.100 [" in line
    assert res.tests["spread, accuracy", "follows T * k3"] is True
    assert res.tests["spread, accuracy", "slower than T * k3"] is False
    assert "- follows T * k3 (b's interval holds 1, excludes 0): **yes**." in res.text
    assert "- slower than T * k3 (b's interval below 1): no." in res.text
    # on the log-odds scale the same runs cost 0.033, 0.29 and 0.81: b 0.91 [0.82, 1.03]
    assert res.tests["spread, log-odds", "follows T * k3"] is True


def test_a_planted_exponent_of_0_3_excludes_1(tmp_path):
    res, _ = run(tmp_path, {**power(0.3, 0.01), ("109", "hi"): 0.08, ("109", "lo"): 0.08})
    line = next(x for x in res.text.splitlines() if x.startswith("**Length exponent, spread, accuracy**"))
    b = float(line.split("b = ")[1].split()[0])
    lo, hi = (float(x) for x in line.split("b = ")[1].split("[")[1].split("]")[0].split(", "))
    assert b == pytest.approx(0.3, abs=0.03) and hi < 1 and lo > 0
    assert res.tests["spread, accuracy", "follows T * k3"] is False
    assert res.tests["spread, accuracy", "slower than T * k3"] is True


def outlier(tmp_path, gain: float, **over):
    """A sweep whose r1 controls sit exactly at BASE and whose r1 spread seeds lose 0.01 but one,
    which gains ``gain``; the other groups as ``power(1.0, 1e-4)``."""
    level = levels({**power(1.0, 1e-4), ("109", "hi"): 0.1, ("109", "lo"): 0.1})
    for s in range(SEEDS):
        level[f"r1_control_s{s}"] = BASE
        level[f"r1_spread_s{s}"] = BASE - 0.01 if s else BASE + gain
    study = study_from_dict(registration(**over), root=tmp_path, source="l1_planted.yaml")
    ids = {p.name: p.run_id for p in planned_runs(study)}
    freeze(study, tmp_path / "sweep")
    write_sweep(tmp_path / "sweep", list(ids), metrics_of(level), STEPS, run_ids=ids)
    res = analyze(study, tmp_path / "sweep")
    line = next(x for x in res.text.splitlines() if x.startswith("**Length exponent, spread, accuracy**"))
    return res, line, float(line.split(" without an exponent")[0].split("(")[-1].rstrip("%)"))


def test_resamples_without_an_exponent_are_counted_and_the_point_must_have_one(tmp_path):
    # the gaining seed gains 0.05: the point cost at r1 is -0.002 (no log); a resample's cost is
    # above 0 only when it never draws that seed: undefined in 1 - (4/5)^5 = 67% of the resamples
    res, line, share = outlier(tmp_path, 0.05)
    assert line.startswith("**Length exponent, spread, accuracy**: b undefined: a cost is not above 0 (1: T 30.0, "
                           "cost -2.0e-03 [")
    assert abs(share - 100 * (1 - 0.8 ** 5)) < 3
    assert res.tests["spread, accuracy", "follows T * k3"] is None
    assert "- follows T * k3 (b's interval holds 1, excludes 0): no decision (b undefined at the point estimate)." \
        in res.text


@pytest.mark.parametrize("max_undefined, decided", [(0.5, True), (0.2, None)])
def test_above_the_registered_share_without_an_exponent_nothing_is_decided(tmp_path, max_undefined, decided):
    # the gaining seed gains 0.03: the point cost at r1 is +0.002; a resample's is above 0 unless it
    # draws that seed twice or more: undefined in 1 - 0.8^5 - 5 x 0.2 x 0.8^4 = 26% of the resamples
    fits = registration()["fits"]
    fits[0]["max_undefined"] = max_undefined
    res, line, share = outlier(tmp_path, 0.03, fits=fits)
    assert abs(share - 100 * (1 - 0.8 ** 5 - 0.2 * 5 * 0.8 ** 4)) < 3
    assert line.split("b = ")[1].split(" ")[0] != "undefined"
    assert res.tests["spread, accuracy", "follows T * k3"] is decided
    if decided is None:
        assert f"no decision (b undefined in {share:.1f}% of resamples, above the registered 20%)." in res.text


def test_exponent_fit_registrations_are_one_line_errors(tmp_path):
    fit = {"kind": "length_exponent", "name": "x", "endpoint": "acc", "arm": "spread",
           "tests": [{"name": "t", "holds": 1}]}
    for change, message in (
            ({"arm": None}, "fits[0]: kind length_exponent needs arm: the arm whose cost is fitted against T"),
            ({"name": None}, "fits[0]: kind length_exponent needs name:"),
            ({"tests": [{"name": "t"}]}, "fits[0]: tests[0]: no condition; give one or more of holds, excludes, below, "
                                         "above"),
            ({"tests": [{"name": "t", "inside": 1}]}, "fits[0]: tests[0]: unknown key 'inside'; valid choices: name, "
                                                      "then, otherwise, holds, excludes, below, above"),
            ({"tests": [{"name": "t", "holds": "one"}]}, "fits[0]: tests[0]: holds: expected a number, got 'one'"),
            ({"max_undefined": 1.0}, "fits[0]: max_undefined: expected a share from 0 to below 1, got 1.0")):
        f = {k: v for k, v in {**fit, **change}.items() if v is not None}
        with pytest.raises(StudyError) as e:
            study_from_dict(registration(fits=[f]), root=tmp_path, source="s.yaml")
        assert message in str(e.value) and "\n" not in str(e.value)
    assert study_from_dict(registration(fits=[fit]), root=tmp_path, source="s.yaml").fits[0].tests[0].conditions == \
        (("holds", 1.0),)
    with pytest.raises(StudyError) as e:
        planned_runs(study_from_dict(registration(fits=[{**fit, "arm": "wide"}]), root=tmp_path, source="s.yaml"))
    assert "fits: x: arm: 'wide' is not an arm of the sweep; arms: control, spread, hi, lo" in str(e.value)
    with pytest.raises(StudyError, match="fits: two length_exponent fits named 'x'; each needs its own name"):
        study_from_dict(registration(fits=[fit, fit]), root=tmp_path, source="s.yaml")
    ungrouped = {k: v for k, v in registration(fits=[fit]).items() if k not in ("groups", "arm_pattern")}
    ungrouped["families"] = [{"name": "cost", "endpoints": ["acc"], "rule": "erodes"}]
    with pytest.raises(StudyError, match="fits\\[0\\]: kind length_exponent needs groups"):
        study_from_dict(ungrouped, root=tmp_path, source="s.yaml")


def exponent_fit(**over) -> dict:
    return {"kind": "length_exponent", "name": "two", "endpoint": "acc", "arm": "spread",
            "tests": [{"name": "follows T * k3", "holds": 1, "excludes": 0}], **over}


def test_a_two_group_exponent_is_the_slope_between_the_two_points(tmp_path):
    # spread costs 0.02, 0.03 and 0.08 at T 30, 300 and 1,000: b through 31 and 109 alone is
    # log(c109 / c31) / log(1000 / 300), about 0.81; through all three it is not
    costs = {("1", "spread"): 0.02, ("31", "spread"): 0.03, ("109", "spread"): 0.08, ("109", "hi"): 0.1,
             ("109", "lo"): 0.1}
    res, level = run(tmp_path, costs, fits=[exponent_fit(groups=[31, "109"]), exponent_fit(name="all")])
    c = {g: mean_of(level, g, "control") - mean_of(level, g, "spread") for g in T}
    two = next(x for x in res.text.splitlines() if x.startswith("**Length exponent, two**"))
    b = float(two.split("b = ")[1].split()[0])
    want = math.log(c["109"] / c["31"]) / math.log(1000 / 300)
    assert want == pytest.approx(math.log(8 / 3) / math.log(10 / 3), abs=0.03)  # 0.815, but for the noise
    assert b == float(f"{want:.2f}")
    assert "a * T^b over 2 restates, 31 and 109 (T: the restate's control mean length" in two
    assert "Per restate: 31: T 300.0, cost " in two and "1: T 30.0" not in two
    every = next(x for x in res.text.splitlines() if x.startswith("**Length exponent, all**"))
    assert "over 3 restates, 1, 31 and 109 (" in every and float(every.split("b = ")[1].split()[0]) != b
    # the fit itself, unrounded: least squares through two points is the slope between them
    from timlab.experiments.studies.fits import exponent_points, fit_exponent

    col = {(g, a): {"acc": np.array([level[f"r{g}_{a}_s{s}"] for s in range(SEEDS)]),
                    "length": np.full(SEEDS, T[g])} for g in T for a in ("control", "spread")}
    Ts, cost = exponent_points(col, ["31", "109"], "acc", control="control", arm="spread", length="length")
    assert (Ts, cost) == ([300.0, 1000.0], pytest.approx([c["31"], c["109"]], rel=1e-12))
    assert fit_exponent(Ts, cost)[1] == pytest.approx(want, rel=1e-12)
    assert fit_exponent(Ts, cost)[0] == pytest.approx(c["31"] / 300 ** want, rel=1e-9)


def test_a_two_group_exponents_interval_is_the_slope_of_each_resample():
    """Seeds without noise: every resample has the same two costs, so b's interval is one point,
    log(c2 / c1) / log(T2 / T1); with noise in one group only, each resample's b is that slope of
    its own two resampled costs."""
    from timlab.experiments.studies.stats import N_BOOT
    from timlab.experiments.studies.fits import exponent_section

    def col(noise: float) -> dict:
        out = {}
        for g, t, cost in (("31", 300.0, 0.03), ("109", 1000.0, 0.08)):
            out[g, "control"] = {"acc": np.full(8, 0.9), "len": np.full(8, t)}
            out[g, "spread"] = {"acc": 0.9 - cost + noise * (g == "109") * np.linspace(-1, 1, 8), "len": np.full(8, t)}
        return out

    lines, decided = exponent_section(col(0.0), ["31", "109"], "acc", "x", control="control", arm="spread",
                                      length="len", tests=(), group_name="restate")
    b = math.log(0.08 / 0.03) / math.log(1000 / 300)
    assert f"b = {b:.2f} [{b:.2f}, {b:.2f}]" in lines[0] and "over 2 restates, 31 and 109" in lines[0]
    # one noisy group: the interval's ends are the slope through the 2.5% and 97.5% resampled costs
    lines, _ = exponent_section(col(0.01), ["31", "109"], "acc", "x", control="control", arm="spread", length="len",
                                group_name="restate")
    rng = np.random.default_rng(0)
    bs = []
    for _ in range(N_BOOT):  # exponent_points' draws: each group's control seeds, then its arm's
        c = []
        for g, cost in (("31", 0.03), ("109", 0.08)):
            rng.integers(0, 8, 8)
            arm = col(0.01)[g, "spread"]["acc"][rng.integers(0, 8, 8)]
            c.append(0.9 - arm.mean())
        bs.append(math.log(c[1] / c[0]) / math.log(1000 / 300))
    lo, hi = np.percentile(bs, [2.5, 97.5])
    assert f"[{lo:.2f}, {hi:.2f}]" in lines[0] and hi - lo > 0.01


def test_exponent_groups_are_checked_against_the_studys_groups(tmp_path):
    for change, message in (
            ({"groups": [109]}, "fits[0]: groups: an exponent needs at least 2 groups, got ['109']"),
            ({"groups": [31, 31]}, "fits[0]: groups: 31 listed twice"),
            ({"groups": "31, 109"}, "fits[0]: groups: expected a list of group values (e.g. [31, 109]), got '31, 109'")):
        with pytest.raises(StudyError) as e:
            study_from_dict(registration(fits=[exponent_fit(**change)]), root=tmp_path, source="s.yaml")
        assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(StudyError) as e:
        planned_runs(study_from_dict(registration(fits=[exponent_fit(groups=[31, 300])]), root=tmp_path,
                                     source="s.yaml"))
    assert str(e.value) == "s.yaml: fits: two: groups: '300' is not a restate of the study; restates: 1, 31, 109"
    length = {"kind": "length", "endpoint": "acc", "groups": [31, 109]}
    with pytest.raises(StudyError, match="fits\\[0\\]: groups: only kind length_exponent takes it, not kind length"):
        study_from_dict(registration(fits=[length]), root=tmp_path, source="s.yaml")


def outcome(*when, **over) -> dict:
    """An outcome over the planted registration's families and fits, once per scale."""
    return {"name": "o", "scales": {"accuracy": {"endpoint": "acc", "fit": "spread, accuracy"},
                                    "log-odds": {"endpoint": "acc_logit", "fit": "spread, log-odds"}},
            "cases": [{"when": list(when), "then": "yes"}], "otherwise": "no", **over}


SAME = {"family": "same", "endpoint": "{endpoint}", "group": 109, "arm": "hi", "is": "holds"}
FIT = {"fit": "{fit}", "test": "follows T * k3", "is": True}


@pytest.mark.parametrize("change, message", [
    ({**SAME, "family": "width"}, "cases[0]: when[0]: family: 'width'; valid choices: cost, same, lo_share"),
    ({**SAME, "endpoint": "k3"}, "(scale accuracy): cases[0]: when[0]: endpoint of family same: 'k3'; valid choices: "
                                 "acc, acc_logit"),
    ({**SAME, "family": "lo_share", "arm": "lo"},
     "(scale log-odds): cases[0]: when[0]: endpoint of family lo_share: 'acc_logit'"),
    ({**SAME, "is": "held"}, "cases[0]: when[0]: is: 'held'; valid choices: holds, fails, opposite, not testable"),
    ({**SAME, "group": None}, "cases[0]: when[0]: group: needed in a grouped study (the comparison's group)"),
    ({**SAME, "arm": None}, "cases[0]: when[0]: missing key 'arm'"),
    ({**SAME, "test": "x"}, "cases[0]: when[0]: unknown key 'test'; valid choices: family, endpoint, group, arm, is, "
                            "label"),
    ({**SAME, "endpoint": "{metric}"}, "cases[0]: when[0]: {metric} is not a placeholder of the scales; valid "
                                       "choices: {endpoint}, {fit}"),
    ({**FIT, "fit": "spread"}, "cases[0]: when[0]: fit (a length_exponent fit's name): 'spread'; valid choices: "
                               "spread, accuracy, spread, log-odds"),
    ({**FIT, "test": "slower than T * k3"}, "(scale log-odds): cases[0]: when[0]: test of fit spread, log-odds: "
                                            "'slower than T * k3'; valid choices: follows T * k3"),
    ({**FIT, "is": "holds"}, "cases[0]: when[0]: is: 'holds'; valid choices: yes, no, undecided"),
    ({"any": [SAME]}, "cases[0]: when[0]: any: expected a list of at least 2 conditions"),
    ({"any": [SAME, {**FIT, "is": "maybe"}]}, "cases[0]: when[0]: any[1]: is: 'maybe'; valid choices: yes, no, "
                                              "undecided"),
])
def test_outcome_references_are_checked_when_the_file_is_read(tmp_path, change, message):
    when = {k: v for k, v in change.items() if v is not None}
    with pytest.raises(StudyError) as e:
        study_from_dict(registration(outcomes=[outcome(when)]), root=tmp_path, source="s.yaml")
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("s.yaml: outcomes[0]")


def test_outcome_groups_arms_scales_and_order_are_checked(tmp_path):
    for over, message in (
            ({"outcomes": [outcome(SAME, scales={"a": {"endpoint": "acc"}, "b": {"fit": "x"}})]},
             "outcomes[0]: scales: every scale must give the same placeholders, got a: endpoint; b: fit"),
            ({"outcomes": [outcome(SAME, scales={"a": "acc"})]},
             "outcomes[0]: scales: expected a mapping of scale: {placeholder: text}"),
            ({"outcomes": [outcome(SAME), outcome(SAME)]}, "outcomes: two named 'o'; each needs its own name"),
            ({"outcomes": [outcome(FIT)], "order": ["families", "tables", "verdicts", "fits"]},
             "order: outcomes (printed with the verdicts) read the fits' tests, so fits come before verdicts"),
            ({"families": registration()["families"] + [{"name": "desc", "endpoints": ["acc"]}],
              "outcomes": [outcome({**SAME, "family": "desc", "endpoint": "acc"})]},
             "outcomes[0] (scale accuracy): cases[0]: when[0]: family desc decides no rule on acc (descriptive)")):
        with pytest.raises(StudyError) as e:
            study_from_dict(registration(**over), root=tmp_path, source="s.yaml")
        assert message in str(e.value) and "\n" not in str(e.value)
    # groups and arms: against the sweep's, on every scale
    for when, message in (
            ({**SAME, "group": 7}, "outcomes: o (scale accuracy): group: '7' is not a restate of the study; restates: "
                                   "1, 31, 109"),
            ({**SAME, "arm": "lo"}, "outcomes: o (scale accuracy): arm: family same makes no comparison 'lo' in "
                                    "restate 109; valid choices: hi"),
            ({**SAME, "group": 31}, "arm: family same makes no comparison 'hi' in restate 31; valid choices: none")):
        with pytest.raises(StudyError) as e:
            planned_runs(study_from_dict(registration(outcomes=[outcome(when)]), root=tmp_path, source="s.yaml"))
        assert str(e.value).startswith("s.yaml: ") and message in str(e.value)
    ungrouped = {k: v for k, v in registration().items() if k not in ("groups", "arm_pattern", "fits")}
    ungrouped["families"] = [{"name": "cost", "endpoints": ["acc"], "rule": "erodes"}]
    with pytest.raises(StudyError, match="when\\[0\\]: group: only a grouped study has groups"):
        study_from_dict({**ungrouped, "outcomes": [outcome({**SAME, "family": "cost", "endpoint": "acc"}, scales={})]},
                        root=tmp_path, source="s.yaml")


def test_an_outcome_reads_a_comparison_not_made_as_not_testable():
    """A comparison of a void group is not made and a fit's test may decide nothing: the outcome
    reads "not testable" and "undecided", which hold only where a condition asks for them."""
    from timlab.experiments.studies.engine import _outcomes

    study = study_from_dict(registration(outcomes=[outcome(SAME, FIT), outcome(
        {**SAME, "is": "not testable"}, {**FIT, "is": "undecided"}, name="p")]), source="s.yaml")
    found: dict = {}
    lines = _outcomes(study, {}, {("spread, accuracy", "follows T * k3"): None}, found)
    assert found == {("o", "accuracy"): "no", ("o", "log-odds"): "no", ("o", ""): "no", ("p", "accuracy"): "yes",
                     ("p", "log-odds"): "yes", ("p", ""): "yes"}
    assert "- accuracy: **no** (same acc hi (restate 109): not testable; spread, accuracy: follows T * k3: undecided)" \
        in lines and "Verdict o: **no** (accuracy: no; log-odds: no)." in lines


# ------------------------------------------------------------------------------- the margin rules
@pytest.mark.parametrize("hi, verdict, holds", [
    (0.10, "**the same cost** (within +-{m})", True),  # hi - lo ~ 0 +- 0.002, inside +-0.5 x spread's 0.1
    (0.16, "differ (margin +-{m})", False),  # hi - lo ~ -0.06: outside the margin
    (0.12, "differ (margin +-{m})", False),  # hi - lo ~ -0.02: inside the margin but it does not hold 0
])
def test_the_equivalence_rule_holds_and_fails_where_planted(tmp_path, hi, verdict, holds):
    res, level = run(tmp_path, {**power(1.0, 1e-4), ("109", "hi"): hi, ("109", "lo"): 0.1})
    assert res.verdicts["same", "acc", ("109", "hi")] is holds
    block = res.text.split("**acc**")[2]  # the same family's accuracy table (after the cost family's)
    row = next(x for x in block.splitlines() if x.startswith("| 109 | hi |"))
    m = 0.5 * (mean_of(level, "109", "control") - mean_of(level, "109", "spread"))  # 0.5 x spread's cost there
    assert m == pytest.approx(0.05, abs=0.001) and row.endswith(f"| {verdict.format(m=f'{m:.4f}')} |")
    diff = mean_of(level, "109", "hi") - mean_of(level, "109", "lo")
    assert f"| {diff:+.4f} [" in row and diff == pytest.approx(0.1 - hi, abs=0.003)
    # the families of hi and lo are made in the one group that has both arms
    assert "| 1 | hi |" not in res.text and "| 31 | lo |" not in res.text


@pytest.mark.parametrize("lo, holds", [(0.01, True), (0.05, False)])
def test_the_under_rule_bounds_an_arms_cost_by_a_share_of_anothers(tmp_path, lo, holds):
    res, _ = run(tmp_path, {**power(1.0, 1e-4), ("109", "hi"): 0.1, ("109", "lo"): lo})
    assert res.verdicts["lo_share", "acc", ("109", "lo")] is holds  # lo's cost under 0.25 x hi's 0.1


def test_a_margin_rule_without_a_margin_says_so(tmp_path):
    # spread costs nothing at r109: there is no margin to be equivalent within
    res, _ = run(tmp_path, {("109", "hi"): 0.1, ("109", "lo"): 0.1})
    assert res.verdicts["same", "acc", ("109", "hi")] is None
    assert "| no margin (spread costs " in res.text and ", not above 0) |" in res.text


def test_margin_rule_registrations_are_one_line_errors(tmp_path):
    for rule, message in (
            ({"name": "r", "test": "within", "margin": 0.5}, "rules[3]: test within needs margin_of"),
            ({"name": "r", "test": "within", "margin_of": "spread", "margin": -1}, "rules[3]: margin: expected a "
                                                                                   "positive number, got -1"),
            ({"name": "r", "test": "below", "margin": 0.5}, "rules[3]: margin: only the margin tests (within, under) "
                                                            "take it, not test below")):
        d = registration()
        d["rules"].append(rule)
        with pytest.raises(StudyError) as e:
            study_from_dict(d, root=tmp_path, source="s.yaml")
        assert message in str(e.value) and "\n" not in str(e.value)
    d = registration()
    d["rules"][1]["margin_of"] = "wide"
    with pytest.raises(StudyError, match="rules: same cost: margin_of: 'wide' is not an arm of the sweep"):
        planned_runs(study_from_dict(d, root=tmp_path, source="s.yaml"))


# ------------------------------------------------------------------------------- Study L1's file
L1 = REPO / "docs" / "examples" / "studies" / "l1.yaml"
LENGTHS = {"1": 31.0, "31": 301.0, "109": 1005.0}
"""Study L1's lengths (its groups' T)."""


def l1(tmp_path, cost, *, noise: float = NOISE, same_noise: bool = True):
    """Study L1's own file (8 seeds) on a planted sweep: each run's accuracy level is BASE minus
    ``cost(group, arm)`` (0 for the controls) plus ``noise`` x a standard normal draw of its own;
    ``same_noise``: hi and lo share each seed's draw (then their difference is exactly the planted one)."""
    d = yaml.safe_load(L1.read_text())
    assert "frozen" not in d and "amendments" not in d  # frozen by sweeps/l1/study.json at its first run, not by a frozen: key
    study = study_from_dict(d, root=L1.parent, source=str(L1))
    ids = {p.name: p.run_id for p in planned_runs(study)}
    level = {}
    for name in ids:
        g, arm, s = name[1:].split("_")
        key = {"control": 0, "spread": 1, "hi": 2, "lo": 2 if same_noise else 3}[arm]
        rng = np.random.default_rng([int(g), key, int(s[1:])])
        level[name] = BASE - (0 if arm == "control" else cost(g, arm)) + noise * rng.standard_normal()

    def of(name: str) -> pd.DataFrame:
        g = name[1:].split("_")[0]
        m = metrics_of(level)(name)
        m["train/response_length_mean"] *= LENGTHS[g] / T[g]
        m.loc[m["step"] == 0, "val/accuracy"] = 0.97
        return m

    freeze(study, tmp_path / "l1")
    write_sweep(tmp_path / "l1", list(ids), of, STEPS, run_ids=ids)
    res = analyze(study, tmp_path / "l1")
    assert res.status == "complete" and res.text.count(": VALID.") == 3
    return res


ACC, ODDS = "spread, accuracy level, T ~ 300 and 1,000", "spread, log-odds, T ~ 300 and 1,000"
RULE1, RULE2 = "rule 1: b holds 1 and excludes 0", "rule 2: b excludes 1 from above"


def verdict_line(res) -> str:
    return next(x for x in res.text.splitlines() if x.startswith("Verdict L1: "))


def test_study_l1s_file_on_a_planted_t_k3_law(tmp_path):
    """Every arm costs 0.18 x T * k3 (E3b's rate; k3 1e-3, T 31, 301, 1,005), hi and lo alike: on
    accuracy, rule 1's two parts hold; on the log-odds scale the same runs give b below 1 (the
    logit bends a cost of 0.18 at 0.9 down), so the verdict is scale-dependent."""
    res = l1(tmp_path, lambda g, arm: 0.18 * LENGTHS[g] * 1e-3)
    assert res.tests[ACC, RULE1] is True and res.tests[ACC, RULE2] is False
    assert res.verdicts["same", "acc_level", ("109", "hi")] is True  # hi - lo inside +-0.5 x 0.18
    assert res.verdicts["where", "acc_level", ("109", "hi")] is False
    assert res.verdicts["cost", "acc_level", ("109", "lo")] is True
    assert res.verdicts["lo_share", "acc_level", ("109", "lo")] is False
    # the log-odds costs are 0.06, 0.49 and 1.25 logits: through T ~ 300 and 1,000, b = 0.78 [0.76, 0.80]
    line = next(x for x in res.text.splitlines() if x.startswith(f"**Length exponent, {ODDS}**"))
    far, near = (logit(BASE) - logit(BASE - 0.18 * t * 1e-3) for t in (1005, 301))
    assert float(line.split("b = ")[1][:4]) == pytest.approx(math.log(far / near) / math.log(1005 / 301), abs=0.01)
    assert res.tests[ODDS, RULE1] is False and res.tests[ODDS, RULE2] is True
    # the three-length fit is descriptive (no test): b 0.88 through T ~ 30, 300 and 1,000
    three = next(x for x in res.text.splitlines()
                 if x.startswith("**Length exponent, spread, log-odds, three lengths (descriptive)**"))
    far, near = (logit(BASE) - logit(BASE - 0.18 * t * 1e-3) for t in (1005, 31))
    assert float(three.split("b = ")[1][:4]) == pytest.approx(math.log(far / near) / math.log(1005 / 31), abs=0.03)
    assert "over 3 restates, 1, 31 and 109 (" in three and not any(k[0].endswith("(descriptive)") for k in res.tests)
    # the verdict: rule 1 on accuracy; on log-odds rule 1's b fails and rule 2's hi - lo does: neither
    assert res.outcomes["L1", "accuracy"] == "follows T * k3" and res.outcomes["L1", "log-odds"] == "neither"
    assert verdict_line(res) == ("Verdict L1: **scale-dependent: follows T * k3 on accuracy, neither on log-odds** "
                                 "(accuracy: follows T * k3; log-odds: neither).")
    assert ("- log-odds: **neither** (rule 1, b through T ~ 300 and 1,000 holds 1 and excludes 0: no; rule 1, hi and "
            "lo cost the same (restate 109): holds; rule 2, hi costs more than lo (restate 109): fails; rule 2, lo's "
            "cost detectable (restate 109, cost family; rule 2 needs it not to hold): holds; rule 2, lo's cost under a quarter of hi's (restate "
            "109): fails; rule 2, b through T ~ 300 and 1,000 excludes 1 from above: yes)") in res.text


def test_study_l1_follows_t_k3_on_both_scales(tmp_path):
    """Small costs, 0.05 x T * k3 (0.015 and 0.05 at T ~ 300 and 1,000; the logit is near linear
    there), hi and lo alike, with per-run noise 0.005: b's interval holds 1 and excludes 0 on both
    scales and hi and lo cost the same."""
    res = l1(tmp_path, lambda g, arm: 0.05 * LENGTHS[g] * 1e-3, noise=0.005)
    for fit in (ACC, ODDS):
        assert res.tests[fit, RULE1] is True and res.tests[fit, RULE2] is False
    assert res.states["same", "acc_logit", ("109", "hi")] == "holds"
    assert res.outcomes["L1", "accuracy"] == res.outcomes["L1", "log-odds"] == "follows T * k3"
    assert verdict_line(res) == ("Verdict L1: **follows T * k3** (accuracy: follows T * k3; log-odds: follows T * "
                                 "k3).")


@pytest.mark.parametrize("lo, lo_cost, lo_share", [(0.0, "fails", "holds"), (0.012, "holds", "holds")])
def test_study_l1_follows_the_decisions_on_both_scales(tmp_path, lo, lo_cost, lo_share):
    """spread's cost barely grows with T (0.05, 0.055 and 0.06: b ~ 0.15, excluding 1 from above);
    at restate 109 hi costs 0.12 and lo either nothing (not detectable) or 0.012, detectable but
    under a quarter of hi's: rule 2's disjunction holds either way."""
    spread = {"1": 0.05, "31": 0.055, "109": 0.06}
    res = l1(tmp_path, lambda g, arm: {"spread": spread[g], "hi": 0.12, "lo": lo}[arm], noise=0.002,
             same_noise=False)
    for key in ("acc_level", "acc_logit"):
        assert res.states["where", key, ("109", "hi")] == "holds"
        assert res.states["same", key, ("109", "hi")] == "fails"
        assert res.states["cost", key, ("109", "lo")] == lo_cost
        assert res.states["lo_share", key, ("109", "lo")] == lo_share
    for fit in (ACC, ODDS):
        assert res.tests[fit, RULE1] is False and res.tests[fit, RULE2] is True
    assert verdict_line(res) == ("Verdict L1: **follows the decision-token mismatch** (accuracy: follows the "
                                 "decision-token mismatch; log-odds: follows the decision-token mismatch).")


@pytest.mark.parametrize("hi, lo, where", [(0.0, 0.12, "opposite"), (0.12, 0.06, "holds")])
def test_study_l1_neither(tmp_path, hi, lo, where):
    """spread's cost as in the decisions test, so b excludes 1 from above; but lo costs more than hi
    (rule 2's first part gives its opposite), or lo costs half of hi's (detectable, and not under a
    quarter: both branches of rule 2's disjunction fail): neither, on both scales."""
    spread = {"1": 0.05, "31": 0.055, "109": 0.06}
    res = l1(tmp_path, lambda g, arm: {"spread": spread[g], "hi": hi, "lo": lo}[arm], noise=0.002, same_noise=False)
    for key in ("acc_level", "acc_logit"):
        assert res.states["where", key, ("109", "hi")] == where
        assert res.states["cost", key, ("109", "lo")] == "holds"
        assert res.states["lo_share", key, ("109", "lo")] == "fails"
    assert res.tests[ACC, RULE2] is True and res.tests[ODDS, RULE2] is True
    assert verdict_line(res) == "Verdict L1: **neither** (accuracy: neither; log-odds: neither)."
    assert f"rule 2, hi costs more than lo (restate 109): {where};" in res.text
