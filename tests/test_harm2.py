"""Study H2 (docs/FINDINGS.md, "Study H2"): the pilot's registered dose rule, by hand, and the held-out
predictor analysis on planted sweeps."""

from __future__ import annotations

import math

import pytest

from timlab.experiments.studies.stats import chi2_sf, cochran_q
from timlab.experiments.studies.oos import dose_for_cost, pilot_doses, round_sig


def test_dose_for_cost_interpolates_log_dose_in_the_cost():
    # E1's head_perturb costs at 0.3, 0.5, 0.8: 0.014, 0.037, 0.074
    d, c = [0.3, 0.5, 0.8], [0.014, 0.037, 0.074]
    t = (0.02 - 0.014) / (0.037 - 0.014)
    assert dose_for_cost(d, c, 0.02) == round_sig(math.exp(math.log(0.3) + t * math.log(0.5 / 0.3))) == 0.34
    t = (0.06 - 0.037) / (0.074 - 0.037)
    assert dose_for_cost(d, c, 0.06) == round_sig(0.5 * (0.8 / 0.5) ** t) == 0.67
    # order of the pilot doses does not matter
    assert dose_for_cost(d[::-1], c[::-1], 0.06) == 0.67


def test_dose_for_cost_below_the_lowest_uses_the_zero_anchor_one_step_down():
    d, c = [0.3, 0.5, 0.8], [0.03, 0.037, 0.074]
    lo = 0.3 / (0.5 / 0.3)  # one pilot step below 0.3 on the log axis, cost 0
    assert dose_for_cost(d, c, 0.02) == round_sig(math.exp(math.log(lo) + (0.02 / 0.03) * math.log(0.3 / lo))) == 0.25


def test_dose_for_cost_above_the_largest_extrapolates_at_most_one_step():
    d, c = [0.3, 0.5, 0.8], [0.014, 0.037, 0.074]
    assert dose_for_cost(d, c, 0.08) == round_sig(0.8 * (0.8 / 0.5) ** ((0.08 - 0.074) / 0.037)) == 0.86
    assert dose_for_cost(d, c, 0.5) == round_sig(0.8 * 0.5 / 0.3) == 1.3  # capped: one step h = log(0.5/0.3)


def test_dose_for_cost_makes_the_costs_monotone_and_handles_no_response():
    # a non-monotone pilot: the envelope is 0.01, 0.01, 0.09 on a linear axis (kv's log2 scale)
    assert dose_for_cost([6.5, 7.25, 8.0], [0.01, 0.005, 0.09], 0.06, log=False) == round_sig(7.25 + 0.75 * 0.05 / 0.08) == 7.7
    # nothing costs: one step past the largest dose
    assert dose_for_cost([6.5, 7.25, 8.0], [0.0, -0.01, 0.0], 0.02, log=False) == 8.8
    with pytest.raises(ValueError):
        dose_for_cost([0.3], [0.01], 0.02)
    with pytest.raises(ValueError):
        dose_for_cost([0.0, 0.5], [0.01, 0.02], 0.02)


def test_pilot_doses_are_distinct_and_in_target_order():
    assert pilot_doses([0.3, 0.5, 0.8], [0.014, 0.037, 0.074]) == (0.34, 0.67)
    # two targets that round onto one dose: the second moves half a pilot step up
    lo, hi = pilot_doses([0.3, 0.5, 0.8], [0.1, 0.1, 0.1], (0.02, 0.0201))
    assert dose_for_cost([0.3, 0.5, 0.8], [0.1, 0.1, 0.1], 0.0201) == lo == 0.2
    assert hi == round_sig(lo * math.sqrt(0.5 / 0.3)) == 0.26
    assert pilot_doses([6.5, 7.25, 8.0], [0.0, -0.01, 0.0], log=False) == (8.8, round_sig(8.8 + 0.375))


# ------------------------------------------------------------------------------ the held-out analysis
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402

from timlab.experiments.studies import heldout as H  # noqa: E402
from timlab.experiments.studies.registration import StudyError  # noqa: E402
from study_sweep import write_sweep  # noqa: E402

FIT = {"pa_1": 0.02, "pa_2": 0.04, "pb_1": 0.03, "pb_2": 0.06}


def _planted(tmp_path: Path, held: dict[str, float]):
    """A held-out study over a planted sweep: fit kinds pa, pb and held-out kind hc; every cell realizes
    k3 0.02; adv = cost / 4 exactly; kp = k3 x persistence = cost / 10 exactly (its persistence undefined
    on step 1, and negative in the control, where the product must not count)."""
    import yaml

    costs = {"control": 0.0, **FIT, **held}
    runs = {"study": "h2r", "out": str(tmp_path / "sweep"), "steps": 4,
            "validity": {"control_exact": True},
            "sweep": {"base": {"preset": "smoke"}, "conditions": [
                {"name": f"{a}_s{s}", "set": {"run.seed": s, "run.steps": 4, **({"mismatch.injector": "logit_noise",
                 "mismatch.magnitude": 0.1} if a != "control" else {})}} for s in range(4) for a in costs]},
            "endpoints": [{"name": "acc", "metric": "val/accuracy", "stat": "level"}],
            "families": [{"name": "cost", "endpoints": ["acc"]}]}
    (tmp_path / "runs.yaml").write_text(yaml.safe_dump(runs), encoding="utf-8")
    d = {"study": "h2", "kind": "heldout", "runs": "runs.yaml", "kind_pattern": "(?P<kind>[a-z]+)_\\d",
         "kinds": {"pa": "fit", "pb": "fit", "hc": "heldout"}, "window": [1, 3],
         "cost": {"metric": "val/accuracy", "window": [0, 4]},
         "candidates": [{"name": "k3", "metric": "rollout_corr/k3_kl"},
                        {"name": "adv", "metric": "mismatch/adv_diff_mean", "absolute": True},
                        {"name": "kp", "metric": "rollout_corr/k3_kl", "times": "mismatch/persistence_ema"}],
         "reference": "k3", "boot": 200, "findings": {"file": "FINDINGS.md", "fit": "f", "test": "t"}, "regime": "planted"}
    (tmp_path / "FINDINGS.md").write_text("x\n<!-- findings:f -->\n<!-- /findings:f -->\n<!-- findings:t -->\n"
                                          "<!-- /findings:t -->\n", encoding="utf-8")
    d["frozen"] = H.heldout_from_dict(d, root=tmp_path).hash
    (tmp_path / "h2.yaml").write_text(yaml.safe_dump(d), encoding="utf-8")
    return H.load_heldout(tmp_path / "h2.yaml"), costs


def _write_runs(st, costs):
    from timlab.experiments.studies.engine import planned_runs
    from timlab.experiments.studies.registration import freeze
    from timlab.experiments.studies.registration import load_study

    rs = load_study(st.runs)
    freeze(rs, rs.out)
    ids = {p.name: p.run_id for p in planned_runs(rs)}

    def metrics(n: str) -> pd.DataFrame:
        arm, seed = n.rsplit("_s", 1)
        c, ctrl = costs[arm], arm == "control"
        return pd.DataFrame({"step": range(5), "val/accuracy": [0.9 - c + 0.001 * int(seed)] * 5,
                             "rollout_corr/k3_kl": [0.0 if ctrl else 0.02] * 5,
                             "mismatch/frac_bitwise_equal": [1.0 if ctrl else 0.5] * 5,
                             "mismatch/adv_diff_mean": [-c / 4] * 5,
                             "mismatch/persistence_ema": [float("nan")] * 2 + [-1.0 if ctrl else c / 0.2] * 3,
                             "train/response_length_mean": [20.0] * 5})

    write_sweep(Path(rs.out), list(ids), metrics, 4, run_ids=ids)


def test_chi2_sf_and_cochran_q_by_hand():
    assert chi2_sf(2.0, 2) == pytest.approx(math.exp(-1.0), rel=1e-12)  # df 2: exp(-x / 2)
    # df 6: exp(-x / 2) (1 + x / 2 + (x / 2)^2 / 2); Study H's heterogeneity, Q = 1.9: p = 0.93
    assert chi2_sf(1.9, 6) == pytest.approx(math.exp(-0.95) * (1 + 0.95 + 0.95 ** 2 / 2), rel=1e-12)
    assert chi2_sf(11.0705, 5) == pytest.approx(0.05, abs=1e-5)  # the 95% point of chi-square(5)
    assert chi2_sf(30.0, 3) == pytest.approx(1.3801e-6, rel=1e-3)  # continued-fraction branch
    assert chi2_sf(0.0, 4) == 1.0
    q, df, p = cochran_q([0.0, 1.0], [1.0, 1.0])
    assert (q, df) == (0.5, 1) and p == pytest.approx(math.erfc(math.sqrt(0.25)), rel=1e-12)


def test_heldout_refuses_before_the_runs_then_picks_the_planted_statistic(tmp_path):
    st, costs = _planted(tmp_path, {"hc_1": 0.01, "hc_2": 0.08})
    res = H.analyze_heldout(st, root=tmp_path)
    assert res.status == "incomplete" and "INCOMPLETE" in res.fit_text and "test waits" in res.test_text
    _write_runs(st, costs)
    res = H.analyze_heldout(st, root=tmp_path)
    assert res.status == "complete", res.fit_text
    dec = res.decision
    # adv and kp predict every held-out cost exactly; k3 (0.02 everywhere) predicts the fit cells' mean
    assert res.fits["adv"]["b"] == pytest.approx(4.0) and res.fits["kp"]["b"] == pytest.approx(10.0)
    assert dec["per"]["adv"]["rmse"] == pytest.approx(0.0, abs=1e-12) == dec["per"]["kp"]["rmse"]
    pred = res.fits["k3"]["b"] * 0.02  # a weighted mean of the fit cells' costs (weights 1 / bootstrap variance)
    assert min(FIT.values()) < pred < max(FIT.values())
    want = math.sqrt(((0.01 - pred) ** 2 + (0.08 - pred) ** 2) / 2)
    assert dec["per"]["k3"]["rmse"] == pytest.approx(want, abs=1e-9)
    assert set(dec["beats"]) == {"adv", "kp"} and res.signal[2] < 0.05
    assert "**the held-out costs differ**" in res.test_text and "Verdict: **adv predicts better than k3**" in res.test_text
    assert "| pa_1 | pa | +0.0200 [" in res.fit_text and "held-out answers of 20-20 tokens" in res.test_text
    rec = H.calibration_record(st, res, 1000)
    assert rec["winner"] == dec["winner"] and rec["lengths"] == [20.0, 20.0] and rec["params"] == [1000, 1000]
    assert rec["candidates"]["adv"]["b"] == pytest.approx(4.0) and rec["candidates"]["adv"]["range"] == pytest.approx(
        [0.005, 0.015])  # the fit cells' adv: cost / 4 over 0.02-0.06


def test_heldout_says_no_verdict_when_the_held_out_costs_do_not_differ(tmp_path):
    st, costs = _planted(tmp_path, {"hc_1": 0.03, "hc_2": 0.03})
    _write_runs(st, costs)
    res = H.analyze_heldout(st, root=tmp_path)
    assert res.signal[0] == pytest.approx(0.0, abs=1e-12) and res.signal[2] == pytest.approx(1.0)
    assert res.decision["no_verdict"] and "**no verdict: the held-out cells' costs do not differ**" in res.test_text
    assert "predicts better" not in res.test_text.rsplit("\n", 1)[-1]
    assert H.calibration_record(st, res, 1000) is None  # rule 4: nothing ships without signal


def test_heldout_registration_errors_name_the_field(tmp_path):
    st, _ = _planted(tmp_path, {"hc_1": 0.01, "hc_2": 0.08})
    import yaml

    d = yaml.safe_load((tmp_path / "h2.yaml").read_text())
    for change, msg in [({"kind_pattern": "[a-z]+_\\d"}, "kind_pattern: needs the named group kind"),
                        ({"kinds": {"pa": "fit", "hc": "heldout"}}, "kinds: needs >= 2 fit kinds"),
                        ({"kinds": {"pa": "fit", "pb": "train"}}, "kinds: expected a mapping kind -> role .fit, heldout."),
                        ({"reference": "tv"}, "reference: 'tv' is not a candidate .valid: k3, adv, kp."),
                        ({"signal": {"alpha": 2.0}}, r"signal.alpha: expected a number in \(0, 1\)")]:
        with pytest.raises(StudyError, match=msg):
            H.heldout_from_dict({**d, **change}, root=tmp_path)
    (tmp_path / "h2.yaml").write_text(yaml.safe_dump({**d, "window": [1, 2]}))  # changed after its freeze
    with pytest.raises(StudyError, match="changed after it was frozen"):
        H.analyze_heldout(H.load_heldout(tmp_path / "h2.yaml"), root=tmp_path)


def test_monte_carlo_permutation_p_is_never_zero():
    from timlab.experiments.studies.stats import permutation_test

    # 16 vs 16 in two strata of 8 vs 8: 12,870^2 relabelings, past the exact limit; a planted gap no draw reaches
    a, b = list(range(100, 116)), list(range(16))
    r = permutation_test(a, b, strata=([0] * 8 + [1] * 8, [0] * 8 + [1] * 8), n_mc=999)
    assert not r.exact and r.p == pytest.approx(1 / 1000)
    r = permutation_test(a, b, max_exact=10, n_mc=499)
    assert not r.exact and r.p == pytest.approx(1 / 500)


def test_h2_ships_the_calibration_record_its_analysis_gives():
    """timlab/data/harm2_calibration.json is what `timlab study analyze docs/examples/studies/harm2.yaml
    --write` ships from the committed sweep (rule 4: the signal condition held)."""
    import json

    repo = Path(__file__).resolve().parents[1]
    st = H.load_heldout(repo / "docs" / "examples" / "studies" / "harm2.yaml")
    res = H.analyze_heldout(st, root=repo)
    rec = H.calibration_record(st, res, H.policy_params(st, root=repo))
    assert rec is not None and rec["winner"] == "max_abs" and rec["params"] == [150336, 150336]
    assert json.loads(json.dumps(rec, sort_keys=True)) == json.loads(H.CALIBRATION.read_text(encoding="utf-8"))


def test_heldout_cli_check_analyze_and_write(tmp_path, capsys, monkeypatch):
    from timlab import cli

    st, costs = _planted(tmp_path, {"hc_1": 0.01, "hc_2": 0.08})
    assert cli.main(["study", "check", str(tmp_path / "h2.yaml")]) == 0
    assert f"Registration {st.hash[:12]} (frozen): fit kinds pa, pb; held-out kinds hc" in capsys.readouterr().out
    assert cli.main(["study", "analyze", str(tmp_path / "h2.yaml"), "--write"]) == 2  # incomplete: nothing written
    assert "--write: the analysis is incomplete; nothing written" in capsys.readouterr().err
    _write_runs(st, costs)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(H, "CALIBRATION", tmp_path / "cal.json")
    assert cli.main(["study", "analyze", str(tmp_path / "h2.yaml"), "--write"]) == 0
    out = capsys.readouterr().out
    assert "**" not in out and "Verdict: adv predicts better than k3" in out  # plain text on the terminal
    text = (tmp_path / "FINDINGS.md").read_text()
    assert "Verdict: **adv predicts better than k3**" in text.split("<!-- findings:t -->")[1]
    import json

    assert json.loads((tmp_path / "cal.json").read_text())["winner"] == "adv"
