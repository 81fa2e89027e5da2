"""mismatch/persistence_*: the per-vocabulary-entry correlation of a mismatch's bias across steps
(timlab.metrics.persistence), on planted batches and in a training run with a resume."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from timlab.errors import UsageError
from timlab.metrics.persistence import PERSISTENCE_KEYS, PersistenceTracker, correlation, token_sums

V = 12


def batch(bias: torch.Tensor, g: torch.Generator, noise: float = 0.05):
    """(B, T) tokens drawn uniformly from V ids, log pi = -1, log mu = -1 - bias[token] + noise; the
    last 3 columns masked out (they hold NaN, which a metric must ignore)."""
    tokens = torch.randint(0, V, (16, 10), generator=g)
    train = torch.full((16, 10), -1.0)
    rollout = train - bias[tokens] + noise * torch.randn(16, 10, generator=g)
    mask = torch.ones(16, 10)
    mask[:, 7:] = 0
    rollout[:, 7:] = float("nan")
    return train, rollout, mask, tokens


def test_token_sums_add_each_ids_log_ratios():
    tokens = torch.tensor([[1, 2, 1], [2, 0, 3]])
    train, rollout = torch.zeros(2, 3), torch.tensor([[-0.5, 0.25, -1.0], [1.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    sums, counts = token_sums(train, rollout, mask, tokens, 4)
    assert sums.tolist() == [0.0, 1.5, -1.25, 0.0] and counts.tolist() == [0.0, 2.0, 2.0, 0.0]
    with pytest.raises(UsageError, match=r"tokens must be a tensor of shape \(2, 3\)"):
        token_sums(train, rollout, mask, tokens[:, :2], 4)
    with pytest.raises(UsageError, match=r"ids outside \[0, 2\)"):
        token_sums(train, rollout, mask, tokens, 2)  # id 2 at a valid position (id 3 is masked out)


def test_a_fixed_bias_persists_a_fresh_one_does_not_and_zero_mismatch_is_nan():
    g = torch.Generator().manual_seed(0)
    fixed = torch.randn(V, generator=g)
    runs = {"fixed": lambda: fixed, "fresh": lambda: torch.randn(V, generator=g), "zero": lambda: torch.zeros(V)}
    got = {}
    for name, draw in runs.items():
        t = PersistenceTracker(V)
        rows = [t.update(*batch(draw(), g, noise=0.0 if name == "zero" else 0.05)) for _ in range(30)]
        assert all(math.isnan(rows[0][k]) for k in PERSISTENCE_KEYS[:2])  # nothing to compare with yet
        got[name] = pd.DataFrame(rows[1:]).mean()
    assert got["fixed"]["mismatch/persistence_lag1"] > 0.98 and got["fixed"]["mismatch/persistence_ema"] > 0.98
    assert abs(got["fresh"]["mismatch/persistence_lag1"]) < 0.2 and abs(got["fresh"]["mismatch/persistence_ema"]) < 0.35
    # within a step both biases are plain to see: a fresh bias is not noise, it changes direction
    assert got["fixed"]["mismatch/persistence_reliability"] > 0.98 and got["fresh"]["mismatch/persistence_reliability"] > 0.9
    assert got["zero"].isna().all()  # r exactly 0: no direction to correlate


def test_reliability_is_low_when_the_bias_is_hidden_in_noise():
    g = torch.Generator().manual_seed(3)
    t = PersistenceTracker(V)
    rows = [t.update(*batch(torch.zeros(V), g, noise=1.0)) for _ in range(20)]  # no bias: only per-token noise
    rel = pd.DataFrame(rows)["mismatch/persistence_reliability"]
    assert rel.notna().all() and abs(rel.mean()) < 0.35


def test_correlation_needs_three_shared_entries():
    s, c = torch.tensor([1.0, 2.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert math.isnan(correlation(s, c, s, c))
    s3, c3 = torch.tensor([1.0, 2.0, 4.0, 0.0]), torch.tensor([1.0, 1.0, 2.0, 0.0])
    assert correlation(s3, c3, s3, c3) == pytest.approx(1.0)
    assert correlation(s3, c3, -s3, c3) == pytest.approx(-1.0)


def test_tracker_state_round_trips():
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(V, generator=g)
    a, b = PersistenceTracker(V), PersistenceTracker(V)
    for _ in range(3):
        a.update(*batch(bias, g))
    b.load_state_dict(a.state_dict())
    nxt = batch(bias, g)
    assert a.update(*nxt) == b.update(*nxt)
    with pytest.raises(UsageError, match="vocabulary of 12, not 5"):
        PersistenceTracker(5).load_state_dict(a.state_dict())


def test_training_logs_persistence_and_a_resume_repeats_it(tmp_path):
    """A head perturbation logs a persistence in [-1, 1] at every step after the first (NaN at the
    first); killed at a checkpoint and resumed, the run logs the same values."""
    from timlab.config import resolve
    from timlab.trainer.run import train

    over = ["mismatch.injector=head_perturb", "mismatch.magnitude=1.0", "run.eval_every=6", "run.checkpoint_every=3"]
    full = resolve(preset="smoke", overrides=over + ["run.steps=6"])
    train(full, tmp_path / "full")
    train(resolve(preset="smoke", overrides=over + ["run.steps=3"]), tmp_path / "cut")
    train(full, tmp_path / "cut", resume=True)
    a, b = (pd.read_parquet(tmp_path / d / "metrics.parquet").set_index("step") for d in ("full", "cut"))
    for k in PERSISTENCE_KEYS:
        if k != "mismatch/persistence_reliability":  # a within-step statistic: defined at step 1 too
            assert math.isnan(a.loc[1, k])
        assert a.loc[2:6, k].notna().all() and (a.loc[2:6, k].abs() <= 1).all(), a[k]
        assert a.loc[1:6, k].equals(b.loc[1:6, k])
