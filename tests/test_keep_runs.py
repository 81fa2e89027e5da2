"""scripts/keep_runs.py: a long sweep's finished runs copied into the repository as they finish."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd

from study_sweep import write_sweep

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("keep_runs", REPO / "scripts" / "keep_runs.py")
keep_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(keep_runs)


def metrics(name: str) -> pd.DataFrame:
    return pd.DataFrame({"step": range(11), "val/accuracy": 0.5})


def test_keeps_finished_diverged_and_guard_stopped_runs_only(tmp_path, capsys):
    src, dst = tmp_path / "work" / "s", tmp_path / "repo" / "s"
    names = ["a_s0", "b_s0", "c_s0", "d_s0", "e_s0"]
    write_sweep(src, names, metrics, 10, states={"b_s0": ("running", 4), "c_s0": ("diverged", 6),
                                                 "d_s0": ("guard_failed", 1), "e_s0": ("finished", 7)})
    for n in names:
        (src / f"{n}__abc123" / "config.yaml").write_text(f"name: {n}\n")
    (src / "a_s0__abc123" / "checkpoints").mkdir()
    (src / "study.json").write_text("{}")
    assert keep_runs.main([str(src), str(dst), "--steps", "10"]) == 0
    assert capsys.readouterr().out.split() == ["a_s0__abc123", "c_s0__abc123", "d_s0__abc123"]
    assert sorted(p.name for p in dst.iterdir()) == ["a_s0__abc123", "c_s0__abc123", "d_s0__abc123", "index.parquet",
                                                     "study.json"]
    assert sorted(p.name for p in (dst / "a_s0__abc123").iterdir()) == ["config.yaml", "metrics.parquet",
                                                                        "status.json"]
    assert keep_runs.keep(src, dst, 10) == []  # nothing new
    assert keep_runs.keep(src, dst) == ["e_s0__abc123"]  # without --steps a run finished early counts
    status = src / "b_s0__abc123" / "status.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), "state": "finished", "step": 10}))
    assert keep_runs.keep(src, dst, 10) == ["b_s0__abc123"]
