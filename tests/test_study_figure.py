"""scripts/study_figure.py: per-arm curves over seeds, and the figures behind FINDINGS' studies."""

from __future__ import annotations

import pandas as pd
import pytest

from script_loader import REPO, load_script

fig = load_script("study_figure")


def test_curves_mean_min_max_per_step_with_smoothing():
    a = pd.DataFrame({"step": [0, 1, 2, 3], "x": [1.0, 3.0, None, 5.0]})
    b = pd.DataFrame({"step": [0, 1, 2, 3], "x": [3.0, 5.0, 7.0, 9.0]})
    c = fig.curves([a, b], "x")
    assert c["mean"].tolist() == [2.0, 4.0, 7.0, 7.0]  # step 2: only b has a value
    assert c["min"].tolist() == [1.0, 3.0, 7.0, 5.0]
    assert c["max"].tolist() == [3.0, 5.0, 7.0, 9.0]
    s = fig.curves([b], "x", smooth=2)  # rolling mean over the last 2 steps, the first step alone
    assert s["mean"].tolist() == [3.0, 4.0, 6.0, 8.0]


def test_figure_groups_seeds_into_arms_and_names_unknown_arms(tmp_path):
    sweep = REPO / "sweeps" / "moe_calib"
    groups = fig.by_arm(sweep)
    assert {k: len(v) for k, v in groups.items()} == {
        "kv_fp8": 2, "kv_fp8_replay": 2, "kv_fp8_e5m2": 2, "kv_fp8_e5m2_replay": 2}
    out = fig.figure(sweep, tmp_path / "f.png", ["kv_fp8", "kv_fp8_e5m2"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="arm.s. bf16 not in .*its arms: kv_fp8, "):
        fig.figure(sweep, tmp_path / "g.png", ["bf16"])
