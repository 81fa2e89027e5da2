"""Study P2's registration (docs/examples/studies/p2.yaml, docs/FINDINGS.md "Study P2"), tested before its
data exist: the sweep it registers (arms, seeds in order, one fixed magnitude, only the persistence moving), and
its analysis on planted 150-step sweeps, where each outcome must come out of the sweep planted for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from study_sweep import assert_registered_in_findings, analyzed, planted_levels
from timlab.experiments.studies.engine import endpoint_values, planned_runs
from timlab.experiments.studies.registration import StudyError, load_study
from timlab.experiments.sweeps.spec import expand, spec_from_dict

REPO = Path(__file__).resolve().parents[1]
P2 = load_study(REPO / "docs" / "examples" / "studies" / "p2.yaml")
ARMS = ["control", "persist", "redraw_1"]
REDRAW = {"control": 0, "persist": 0, "redraw_1": 1}


def test_p2_registers_three_arms_of_eight_seeds_at_one_fixed_magnitude():
    spec = spec_from_dict(P2.sweep, root=P2.sweep_root, source=P2.sweep_source)
    runs = expand(spec)
    assert [r.spec_condition for r in runs] == [f"{a}_s{s}" for s in range(8) for a in ARMS]
    assert P2.steps == 150 and spec.isa == "avx2"
    for r in runs:
        arm, seed = r.spec_condition.rsplit("_s", 1)
        c = r.config
        assert r.overrides["run.seed"] == r.overrides["mismatch.seed"] == int(seed)
        assert c.model.path == "runs/erosion_start" and c.run.steps == 150 and c.run.eval_every == 10
        assert c.task.n_val == 512 and c.correction.mode == "none"
        assert c.mismatch.redraw_every == REDRAW[arm]
        if arm == "control":
            assert c.mismatch.injector == "none"
        else:  # one fixed magnitude, no controller: only the persistence moves
            assert (c.mismatch.injector, c.mismatch.target_k3, c.mismatch.magnitude) == ("head_perturb", 0.0, 0.6)


def test_findings_names_the_registration_hash_and_the_block():
    assert P2.findings[1] == "persistence-p2"
    assert_registered_in_findings(P2, "Study P2")


def planted(costs: dict[str, float], seed_sd: float = 5e-3):
    """150-step runs at accuracy 0.98 minus each arm's planted cost (``study_sweep.planted_levels``); k3 2e-2."""
    return planted_levels(ARMS, costs, seed_sd, level=0.98, start=(0.98, -0.19), k3=2e-2, magnitude=0.6)


@pytest.mark.parametrize("costs, seed_sd, outcome", [
    ({"persist": 0.06, "redraw_1": 0.02}, 5e-3, "the cost follows how long the bias persists, at one magnitude too"),
    ({"persist": 0.06, "redraw_1": 0.06}, 5e-3, "at one magnitude the persistence does not matter"),
    ({}, 5e-3, "no cost to attribute (persist's cost not detectable)"),
    # a difference of 0.005 under a seed-to-seed sd of 0.03: neither shown nor ruled out
    ({"persist": 0.07, "redraw_1": 0.065}, 3e-2, "undecided"),
])
def test_p2_analysis_gives_each_planted_outcome(tmp_path, costs, seed_sd, outcome):
    res = analyzed(P2, tmp_path, planted(costs, seed_sd))
    assert res.status == "complete", res.text
    assert res.text.splitlines()[0].endswith("VALID.")
    cols = endpoint_values(P2, root=tmp_path)[""]  # the registered endpoints, as the analysis computes them
    assert list(cols) == ARMS and all(len(v["acc_level"]) == 8 for v in cols.values())
    persist_cost = cols["control"]["acc_level"].mean() - cols["persist"]["acc_level"].mean()
    assert f"{-persist_cost:+.4f}" in res.text
    assert res.outcomes[("P2", "")] == outcome, res.text
    line = next(x for x in res.text.splitlines() if x.startswith("Verdict P2"))
    assert outcome in line


def test_p2_analysis_refuses_an_incomplete_sweep(tmp_path):
    res = analyzed(P2, tmp_path, planted({}), [p.name for p in planned_runs(P2)][:10])
    assert res.status == "incomplete" and res.text.startswith("INCOMPLETE: 10 of 24 runs finished at step 150")
    with pytest.raises(StudyError, match="INCOMPLETE: 10 of 24 runs"):
        endpoint_values(P2, root=tmp_path)
