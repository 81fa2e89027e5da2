"""One name per quantity: every key a run or a plug-in logs is in docs/metrics.md, and the
trainer and the plug-ins use the same names for the length-decay schedule's quantities."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import torch

from timlab.config import resolve
from timlab.metrics import HARM_CANDIDATES, all_metrics, harm_metrics
from timlab.remedies import RS_RULES, RS_SUMMARY_KEYS, rejection_mask, rule_metric_keys
from timlab.remedies.importance import METRIC_KEYS as IS_KEYS
from timlab.schedulers.length_decay import METRIC_KEYS as SCHEDULER_KEYS
from timlab.trainer.run import train

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def documented() -> set[str]:
    """Keys in the first column of docs/metrics.md's tables; '(+ `_lo`, `_hi`)' adds suffixes;
    `rs/<rule>_x` stands for every rejection rule."""
    keys: set[str] = set()
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        expanded = " ".join(first.replace("<rule>", rule) for rule in RS_RULES.names()) if "<rule>" in first else first
        names = re.findall(r"`([a-z_]+/[a-z_0-9]+)`", expanded)
        suffixes = re.findall(r"`(_[a-z]+)`", first)
        keys.update(names)
        keys.update(n + s for n in names for s in suffixes)
    return keys


def test_the_table_has_no_duplicate_quantity_names():
    keys = documented()
    assert "mismatch/abs_diff_max" not in keys and "mismatch/max_abs_diff" in keys
    assert not any(k.startswith("timlab/") for k in keys)


def test_pure_layer_keys_are_documented():
    r = torch.tensor([[0.1, -0.2, 0.0]], dtype=torch.float64)
    keys = set(all_metrics(r, torch.zeros_like(r), torch.ones_like(r))) | set(IS_KEYS) | set(SCHEDULER_KEYS)
    keys |= set(harm_metrics(r, torch.zeros_like(r), torch.ones_like(r), advantages=torch.ones(1), entropy=r.abs()))
    assert set(HARM_CANDIDATES) <= keys
    keys |= set(RS_SUMMARY_KEYS) | {k for rule in RS_RULES.names() for k in rule_metric_keys(rule)}
    _, rs = rejection_mask(r, torch.zeros_like(r), torch.ones_like(r), rules=",".join(RS_RULES.names()), thresholds="1")
    assert set(rs) <= keys
    assert keys - documented() == set()


def test_every_key_a_run_logs_is_documented(tmp_path):
    cfg = resolve(preset="smoke", overrides=[
        "run.steps=2", "scheduler.name=length_decay", "correction.mode=truncate", "run.gradcheck_every=2",
        "mismatch.injector=logit_noise", "mismatch.magnitude=0.1", "correction.rs=seq_max_k3,token_k1",
        "correction.rs_threshold=0.1,0.5_2.0", "run.alarm=grad_norm_change",
    ])
    train(cfg, tmp_path / "run")
    columns = set(pd.read_parquet(tmp_path / "run" / "metrics.parquet").columns) - {"step"}
    assert {"scheduler/surge_step", "scheduler/decay_period", "gradcheck/rel_bias", "is/ess", "is/ratio_min_before",
            "rs/masked_frac", "rs/seq_max_k3_max", "alarm/above_threshold", "alarm/statistic"} <= columns
    assert set(HARM_CANDIDATES) <= columns  # a run with an injector logs every harm candidate
    assert columns - documented() == set()
    assert {c for c in columns if c.startswith("scheduler/")} <= set(SCHEDULER_KEYS)  # the plug-ins' names
