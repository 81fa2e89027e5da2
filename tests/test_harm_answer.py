"""The answer to "is this mismatch a problem?" that ``timlab check`` and ``timlab analyze`` print
(``timlab.experiments.diagnostics.harm_prediction``), and the evidence record it reads
(``timlab.experiments.studies.evidence``): the record equals what the committed sweeps give, hand-picked
inputs get the tier and the nearest cells the record implies, and no printed 95% interval is wider
than 10 points of accuracy."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from timlab.cli import main
from timlab.experiments.diagnostics import harm_prediction as H
from timlab.experiments.studies import evidence as E

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "timlab/data/sample_logprobs.jsonl"
EV = json.loads(H.EVIDENCE.read_text(encoding="utf-8"))
CELLS = {c["cell"]: c for c in EV["cells"]}
INTERVAL = re.compile(r"(-?\d+\.\d) points \[95% (-?\d+\.\d), (-?\d+\.\d)\]")


# ------------------------------------------------------------------------------ the record
def test_evidence_record_equals_what_the_committed_sweeps_give(monkeypatch):
    monkeypatch.chdir(REPO)
    rebuilt = E.text(E.build(REPO))
    assert rebuilt == H.EVIDENCE.read_text(encoding="utf-8"), "python scripts/harm_evidence.py --write"


def test_evidence_record_holds_the_studies_cells_with_their_published_costs():
    srcs = [c["source"] for c in EV["cells"]]
    assert srcs.count("Study H, in sample") == 46 and srcs.count("Study H, beside the fit") == 3
    assert srcs.count("Study H, out of sample") == 7 and srcs.count("Study P1") == 4
    assert srcs.count("Study P2") == 2 and srcs.count("Study H1") == 6
    # the costs their FINDINGS blocks publish (arm minus control there, control minus arm here)
    p1, p2 = CELLS["P1/persist"], CELLS["P2/redraw_1"]
    assert round(p1["cost"], 4) == 0.0524 and p1["detectable"] and p1["k3"] == pytest.approx(0.0115, abs=5e-5)
    assert round(p2["cost"], 4) == 0.0093 and round(p2["persistence_ema"], 2) == 0.37
    assert round(CELLS["P2/persist"]["persistence_ema"], 2) == 0.67 and CELLS["P1/persist"]["persistence_ema"] is None
    oos = CELLS["H-oos/0/temp_0.25"]
    assert round(oos["cost"], 4) == 0.0059 and round(oos["p"], 4) == 0.0698 and not oos["detectable"]
    assert round(CELLS["H1/hold_1e-2"]["cost"], 4) == 0.1076 and CELLS["H1/hold_1e-2"]["cost_window"] == [1500, 2000]
    # kinds read from the configs, sizes from the architectures (Study H's calibration has the same two)
    assert CELLS["P1/redraw_5"]["kind"] == "head_perturb redrawn every 5 steps"
    assert CELLS["E2/ld/stale_2"]["kind"] == "stale 2" and CELLS["E1/fp8"]["family"] == "numerical"
    assert CELLS["MoE/router_bf16_replay"]["remedy"] == "router replay"
    assert CELLS["H1/grow_tis"]["remedy"] == "token IS (truncate)"
    cal = json.loads(H.STUDY_H_CALIBRATION.read_text(encoding="utf-8"))
    assert sorted({c["params"] for c in EV["cells"]}) == cal["params"] == [150336, 483744]


# ------------------------------------------------------------------------------ the answer
def tier(k3, length=None, kind=None):
    return H.verdict(EV["cells"], k3, length=length, kind=kind)


def near(k3, length=None, kind=None, persistence=None):
    return [c["cell"] for c in H.nearest(EV["cells"], k3, length=length, kind=kind, persistence=persistence)]


def test_tiers_and_nearest_cells_for_hand_picked_mismatches():
    # k3 1e-3 at T 23, kind unknown: staleness at this k3 costs (E1, E3), the noise kinds do not
    t, line = tier(1e-3, 23)
    assert t == "range" and "cost 0.0 to 4.2 points" in line and "18 cells of any kind" in line
    assert near(1e-3, 23) == ["H-oos/0/kv_fp8", "E2/lr1e-4/ramp", "E3/0/stale_1"]
    # k3 1e-2 at T 23, a persistent head perturbation: the persistent arms of P2 and H2 (persistence 0.67-0.73)
    t, line = tier(1e-2, 23, "head")
    assert t == "range" and "cost 0.9 to 7.4 points" in line and "15 head cells" in line
    assert near(1e-2, 23, "head", 0.67) == ["P2/persist", "H2/persist_0.62", "H2/persist_0.4"]
    # a fresh direction's persistence (0.37): the redrawn arms first; P1's cells, without a logged persistence, count
    # as 0.3 apart and fall behind
    assert near(1e-2, 23, "head", 0.37) == ["H2/redraw5_0.54", "P2/redraw_1", "P2/persist"]
    # k3 0.3 at T 160: above every cell of that length (E3/E3b level 2 reach 3.8e-3)
    t, line = tier(0.3, 160)
    assert t == "above" and "is 3.8e-03" in line and "cost 4.2 to 10.2 points" in line
    # length unknown: every length counts
    t, line = tier(1e-3)
    assert t == "range" and "25 cells of any kind at k3" in line
    # an exact stack (the sample file's 5.5e-13): below E1's one step of staleness, the smallest detectable
    t, line = tier(5.46e-13, 15.2)
    assert t == "below" and "was 5.3e-04: E1/stale_1" in line
    assert tier(0.0, 23)[0] == "below"
    # no verdict at lengths no cell had, or a kind without cells; the router cells (k3 <= 5.7e-5) at 1e-2
    assert tier(1e-3, 1000) == ("none", "verdict: none: no measured cell has answers within a factor 2 of 1000 "
                                        "tokens (measured: 13-160)")
    assert tier(1e-2, 23, "router")[0] == "above"
    assert "MoE/router_bf16_replay" not in near(1e-6, 23, "router")  # remedies are not evidence of the kind


def answer_intervals(text: str) -> list[tuple[float, float, float]]:
    """Every 95% interval the answer prints, each in the one form it may take ("x points [95% a, b]")."""
    assert text.count("[95%") == len(INTERVAL.findall(text)), text
    return [tuple(map(float, m)) for m in INTERVAL.findall(text)]


def test_no_printed_interval_is_wider_than_ten_points():
    seen = 0
    for k3 in (0.0, 1e-9, 1e-6, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 1.0):
        for length in (None, 10.0, 23.0, 66.0, 160.0, 1000.0):
            for kind in (None, *H.kinds(EV)):
                text = H.harm_answer({H.K3: k3}, length=length, kind=kind, evidence=EV)
                for _, lo, hi in answer_intervals(text):
                    assert hi - lo <= 100 * H.MAX_WIDTH, text
                    seen += 1
    assert seen > 500
    # a cell whose measured interval is wider (E2's stale 4 at lr 2e-4: 28.1-41.1) shows its cost without it
    wide = CELLS["E2/lr2e-4/stale_4"]
    assert wide["cost_ci"][1] - wide["cost_ci"][0] > H.MAX_WIDTH
    assert H.cost_text(wide) == "cost 34.8 points (its 95% interval is wider than 10), 8 seeds, detectable"


def test_predicted_cost_only_where_its_interval_is_narrow():
    cal = json.loads(H.STUDY_H_CALIBRATION.read_text(encoding="utf-8"))
    line = H.predicted_line({H.K3: 1e-3}, cal, length=23.0)  # Study H's k3: +-0.215 at 95%
    assert line == ("predicted cost: none (the prediction interval of Study H's calibrated k3 is +-21.5 points here, "
                    "wider than the 10 points timlab prints)")
    # the record the answer reads is Study H2's (its signal condition held): its winner, max_abs, is +-43 points wide
    assert H.CALIBRATION == H.CALIBRATIONS[0] and H.CALIBRATION.name == "harm2_calibration.json"
    h2 = json.loads(H.CALIBRATION.read_text(encoding="utf-8"))
    assert h2["label"] == "Study H2" and h2["winner"] == "max_abs"
    half = 1.96 * math.sqrt(3.0 ** 2 * h2["candidates"]["max_abs"]["b_var"] + h2["candidates"]["max_abs"]["loko"] ** 2)
    assert H.predicted_line({H.K3: 1e-3, "mismatch/max_abs_diff": 3.0}, h2, length=20.0) == (
        f"predicted cost: none (the prediction interval of Study H2's calibrated max_abs is +-{100 * half:.1f} points "
        "here, wider than the 10 points timlab prints)") and half > 0.43
    assert H.predicted_line({H.K3: 1e-3}, h2, length=20.0) == (
        "predicted cost: none (max_abs = mismatch/max_abs_diff is not measured here)")
    narrow = {"winner": "k3", "lengths": [20.0, 70.0], "candidates": {"k3": {
        "metric": H.K3, "absolute": False, "b": 10.0, "b_var": 0.0, "loko": 0.01, "range": [1e-4, 1e-2]}}}
    half = 1.96 * 0.01
    assert H.predicted_line({H.K3: 1e-3}, narrow, length=30.0) == (
        f"predicted cost: 1.0 points [95% {100 * (0.01 - half):.1f}, {100 * (0.01 + half):.1f}] from k3 0.001 "
        "(Study H's calibration)")
    assert answer_intervals(H.predicted_line({H.K3: 1e-3}, narrow, length=30.0)) == [(1.0, -1.0, 3.0)]
    narrow["candidates"]["k3"]["loko"] = 0.0256  # 2 x 1.96 x 0.0256 = 0.1004: one step wider than timlab prints
    assert "wider than the 10 points" in H.predicted_line({H.K3: 1e-3}, narrow, length=30.0)
    assert H.predicted_line({H.K3: 1e-3}, narrow, length=100.0) == (
        "predicted cost: none (answers of 100 tokens are outside Study H's calibrated 20-70)")
    assert H.predicted_line({H.K3: 0.5}, narrow, length=30.0) == (
        "predicted cost: none (k3 0.5 is outside Study H's calibrated 0.0001-0.01)")


def test_persistence_and_size_enter_the_answer():
    text = H.harm_answer({H.K3: 1e-2, H.PERSISTENCE: 0.67}, length=23.0, kind="head", params=7_200_000, evidence=EV)
    lines = text.splitlines()
    assert lines[0] == "is this mismatch a problem? k3 1.0e-02 per token, answers of 23 tokens, kind head, persistence 0.67"
    assert lines[2].startswith("  nearest: P2/persist (head_perturb persistent, magnitude 0.6; k3 9.6e-03, T 23, "
                               "persistence 0.67): cost 3.0 points [95% 1.5, 4.7], 8 seeds, detectable; Study P2")
    assert lines[5] == "  cannot say: a model of 7.2M parameters (the lab's: 0.15M-0.48M); tasks other than scratch_add"
    assert "cannot say: a model of 7B parameters (the lab's: 0.15M-0.48M)" in H.harm_answer(
        {H.K3: 0.3}, length=160.0, params=7_000_000_000, evidence=EV)
    unknown = H.harm_answer({H.K3: 1e-2}, length=23.0, evidence=EV)
    assert ("its kind (--kind); its persistence (mismatch/persistence_ema; at one k3 a run-long direction cost 2.8x "
            "a fresh one, P1)") in unknown
    with pytest.raises(H.UsageError, match=r"--kind 'fp8': not a kind the lab has measured \(valid: head, kv_cache"):
        H.check_kind("fp8")


# ------------------------------------------------------------------------------ the CLI
def test_analyze_cli_prints_the_answer(tmp_path, capsys):
    assert main(["analyze", str(SAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "  is this mismatch a problem? k3 5.5e-13 per token, answers of 15 tokens, persistence 0.12\n    verdict: below any cost" in out
    assert out.count("    nearest: ") == 3 and "predicted accuracy cost" not in out
    # a planted file: 16 answers of 23 tokens whose log-ratio alternates +-0.14 (k3 ~ 0.0098), stated as head
    rows = [{"trainer_logprobs": [-1.0] * 23, "rollout_logprobs": [-1.0 + 0.14 * (-1) ** j for j in range(23)]}
            for _ in range(16)]
    path = tmp_path / "head.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["analyze", str(path), "--kind", "head"]) == 0
    out = capsys.readouterr().out
    assert "is this mismatch a problem? k3 9.8e-03 per token, answers of 23 tokens, kind head" in out
    assert "    verdict: in the range where measured cells cost 0.9 to 7.4 points of accuracy (15 head cells" in out
    for _, lo, hi in answer_intervals(out[out.index("is this mismatch"):]):
        assert hi - lo <= 10
    assert main(["analyze", str(path), "--kind", "fp8"]) == 2
    assert "valid: head, kv_cache, logit_noise, numerical, router, stale, temperature" in capsys.readouterr().err
    assert math.isclose(H.MAX_WIDTH, 0.10)
