"""``timlab analyze``'s persistence (``mismatch/persistence_*`` from a file's ``step`` and ``tokens``):
a planted per-token-id bias that keeps its direction across steps and one redrawn every step read
clearly apart; the values are ``PersistenceTracker``'s on each step's batch, fed in order of step
whatever the file's row order or chunking; files that cannot have it say why."""

from __future__ import annotations

import json
import math

import pytest
import torch

import timlab.experiments.diagnostics.analyze as analyze
from timlab.cli import main
from timlab.experiments.diagnostics.analyze import (
                                                    PERSISTENCE_NEEDS_STEPS,
                                                    PERSISTENCE_NEEDS_TOKENS,
                                                    analyze_file,
                                                    analyze_records,
                                                    format_analysis,
                                                    write_rows,
                                                    )
from timlab.metrics.persistence import PERSISTENCE_KEYS, PersistenceTracker

LAG1, EMA, RELIABILITY = PERSISTENCE_KEYS
V, STEPS, SEQS, LEN = 200, 12, 32, 24


def planted(kind: str, *, seed: int = 0, steps: int = STEPS, bias_sd: float = 0.1, noise: float = 0.05,
            tokens: bool = True, step: bool = True, disjoint: bool = False) -> list[dict]:
    """Rows in analyze's schema: token ids uniform over V, log pi in [-3, -1], log mu = log pi - bias[id] - noise.
    ``kind`` "persistent": one per-id bias for every step; "redrawn": a fresh one each step;
    "zero": log mu = log pi. ``disjoint``: each step's ids are shifted by V x its index, so no id recurs."""
    g = torch.Generator().manual_seed(seed)
    fixed = bias_sd * torch.randn(V, generator=g, dtype=torch.float64)
    rows = []
    for s in range(steps):
        bias = fixed if kind == "persistent" else bias_sd * torch.randn(V, generator=g, dtype=torch.float64)
        ids = torch.randint(0, V, (SEQS, LEN), generator=g)  # (B, T)
        train = -1.0 - 2.0 * torch.rand(SEQS, LEN, generator=g, dtype=torch.float64)  # (B, T)
        r = bias[ids] + noise * torch.randn(SEQS, LEN, generator=g, dtype=torch.float64)  # (B, T)
        if kind == "zero":
            r = torch.zeros_like(r)
        for b in range(SEQS):
            row = {"trainer_logprobs": train[b].tolist(), "rollout_logprobs": (train[b] - r[b]).tolist()}
            if step:
                row["step"] = 10 + s
            if tokens:
                row["tokens"] = (ids[b] + (V * s if disjoint else 0)).tolist()
            rows.append(row)
    return rows


def _mean_defined(per_step: list[dict], key: str) -> float:
    values = [s["metrics"][key] for s in per_step if s["metrics"][key] is not None]
    return sum(values) / len(values)


def test_a_persistent_bias_and_a_redrawn_one_read_clearly_apart(tmp_path):
    got = {kind: analyze_file(write_rows(planted(kind), tmp_path / f"{kind}.parquet")) for kind in ("persistent", "redrawn")}
    pers, fresh = got["persistent"], got["redrawn"]
    for res in (pers, fresh):
        info = res["persistence"]
        assert info["available"] and info["reason"] is None and info["vocab_size"] == V
        assert info["num_steps"] == STEPS and info["num_defined"] == {LAG1: STEPS - 1, EMA: STEPS - 1, RELIABILITY: STEPS}
        first = res["per_step"][0]["metrics"]
        assert first[LAG1] is None and first[EMA] is None and first[RELIABILITY] is not None  # nothing before step 1
        for key in PERSISTENCE_KEYS:  # the file's value: the mean over the steps where the key is defined
            assert res["metrics"][key] == pytest.approx(_mean_defined(res["per_step"], key), rel=1e-12)
    # per-id noise of the mean over ~4 tokens (sd 0.025) against a bias of sd 0.1: ~0.94 if it lasts
    assert pers["metrics"][LAG1] > 0.85 and pers["metrics"][EMA] > 0.9
    assert all(s["metrics"][EMA] > 0.8 for s in pers["per_step"][1:])
    # a fresh direction every step: correlations of independent draws over 200 ids (sd ~0.07 per step)
    assert abs(fresh["metrics"][LAG1]) < 0.1 and abs(fresh["metrics"][EMA]) < 0.1
    assert all(abs(s["metrics"][EMA]) < 0.3 for s in fresh["per_step"][1:])
    # within a step both biases are plain (even vs odd sequences agree): redrawn is not noise, it turns
    assert pers["metrics"][RELIABILITY] > 0.85 and fresh["metrics"][RELIABILITY] > 0.85
    text = format_analysis(pers)
    assert "persistence of the per-token-id bias across steps" in text
    assert f"ema {pers['metrics'][EMA]:.3g} ({STEPS - 1} of {STEPS} steps)" in text
    assert "vocabulary 200 (max token id + 1)" in text


def test_values_are_the_trackers_fed_in_order_of_step_whatever_the_row_order(tmp_path, monkeypatch):
    rows = planted("persistent", steps=5, noise=0.2)
    by_step: dict[int, list[dict]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    tracker, want = PersistenceTracker(V), {}
    for step in sorted(by_step):  # what the trainer would log: each step's (B, T) batch, in order
        part = by_step[step]
        train = torch.tensor([r["trainer_logprobs"] for r in part], dtype=torch.float64)
        roll = torch.tensor([r["rollout_logprobs"] for r in part], dtype=torch.float64)
        want[step] = tracker.update(train, roll, torch.ones_like(train), torch.tensor([r["tokens"] for r in part]))
    # rows of different steps interleaved, later steps first (each step's own rows keep their order),
    # and chunks of ~10 rows, so steps span chunks
    shuffled = [by_step[s][i] for i in range(SEQS) for s in sorted(by_step, reverse=True)]
    monkeypatch.setattr(analyze, "CHUNK_CELLS", 10 * LEN)
    res = analyze_file(write_rows(shuffled, tmp_path / "shuffled.jsonl"))
    assert [s["step"] for s in res["per_step"]] == sorted(by_step)
    for s in res["per_step"]:
        for key in PERSISTENCE_KEYS:
            w = want[s["step"]][key]
            assert (s["metrics"][key] is None) if math.isnan(w) else s["metrics"][key] == pytest.approx(w, abs=1e-12)
    assert want[11][LAG1] > 0.3  # a real value, not a vacuous match of NaNs


@pytest.mark.parametrize("kind, rows, reason", [
    ("no tokens", lambda: planted("persistent", steps=3, tokens=False), PERSISTENCE_NEEDS_TOKENS),
    ("no step", lambda: planted("persistent", steps=1, step=False), PERSISTENCE_NEEDS_STEPS),
    ("one step", lambda: planted("persistent", steps=1),
     "this file has one step (step 10) with token ids: persistence compares a step's per-token-id bias"),
    ("zero mismatch", lambda: planted("zero", steps=3), "r = 0 at every valid token (no mismatch)"),
    ("no id recurs", lambda: planted("persistent", steps=3, disjoint=True),
     "the correlations are undefined at every step: fewer than 3 token ids recur between steps"),
])
def test_a_file_without_persistence_says_why(kind, rows, reason):
    res = analyze_records(rows())
    assert res["persistence"]["available"] is False and reason in res["persistence"]["reason"]
    assert not set(PERSISTENCE_KEYS) & set(res["metrics"])  # no number where there is none
    assert all(not set(PERSISTENCE_KEYS) & set(s["metrics"]) for s in res["per_step"])
    lines = [line.strip() for line in format_analysis(res).splitlines()]
    assert f"persistence: unavailable ({res['persistence']['reason']})" in lines
    assert not any("persistence_lag1" in line for line in lines)  # no per-step columns either


def test_rows_without_tokens_are_left_out_and_counted():
    rows = planted("persistent", steps=3, seed=1)
    for i in (0, 40, 41):
        del rows[i]["tokens"]
    res = analyze_records(rows)
    assert res["persistence"]["available"] and res["persistence"]["rows_without_tokens"] == 3
    assert res["num_valid"] == len(rows)  # tokens stay optional for every other metric
    assert "; 3 row(s) without tokens left out" in format_analysis(res)


def test_a_negative_token_id_at_a_valid_position_is_a_row_error():
    rows = planted("persistent", steps=2, seed=2)
    rows[3]["tokens"][5] = -1
    rows[4]["tokens"][2] = -100  # padding may hold anything
    rows[4]["mask"] = [1, 1, 0] + [1] * (LEN - 3)
    res = analyze_records(rows)
    assert [(e["row"], e["column"]) for e in res["errors"]] == [(3, "tokens")]
    assert "tokens[5] = -1 at a valid position (mask=1); token ids must be >= 0" in res["errors"][0]["problem"]
    assert res["persistence"]["available"]


def test_cli_prints_persistence_per_step_and_writes_it_to_json(tmp_path, capsys):
    path = write_rows(planted("persistent", steps=4), tmp_path / "persistent.jsonl")
    js = tmp_path / "r.json"
    assert main(["analyze", str(path), "--json", str(js)]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = next(line for line in lines if "persistence of the per-token-id bias" in line)
    header = next(line for line in lines if line.split()[:3] == ["step", "seqs", "tokens"])
    assert header.split()[-3:] == ["persistence_lag1", "persistence_ema", "persistence_reliability"]
    table = [line.split() for line in lines[lines.index(header) + 1:] if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in table] == [10, 11, 12, 13]
    assert table[0][-3:-1] == ["-", "-"] and all(float(r[-2]) > 0.8 for r in table[1:])  # ema per step
    saved = json.loads(js.read_text())
    assert saved["metrics"][EMA] > 0.9 and saved["persistence"]["num_defined"][EMA] == 3
    assert saved["per_step"][0]["metrics"][LAG1] is None and saved["per_step"][1]["metrics"][LAG1] > 0.8
    assert f"ema {saved['metrics'][EMA]:.3g} (3 of 4 steps)" in summary
