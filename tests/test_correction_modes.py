"""verl's correction modes in the trainer: rejection sampling, self-normalized IS, bypass mode,
the REINFORCE loss and the verl-named presets (smoke-sized runs)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from timlab.cli import main
from timlab.config import PRESETS, VERL_PRESETS, ConfigError, resolve, validate
from timlab.trainer.losses import ppo_clip_loss, reinforce_loss
from timlab.trainer.run import train


def _weights(run_dir):
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def test_verl_presets_match_verls_factories():
    algo = pytest.importorskip("verl.trainer.config.algorithm")
    for name in VERL_PRESETS:
        v = getattr(algo.RolloutCorrectionConfig, name)()
        cfg = resolve(preset=f"smoke+{name}")
        validate(cfg)
        c = cfg.correction
        level = None if c.mode == "none" else c.level
        assert level == v.rollout_is, name
        if c.mode == "truncate":
            assert c.threshold == float(v.rollout_is_threshold), name
        if c.mode == "two_sided":
            assert f"{c.threshold_low}_{c.threshold}" == v.rollout_is_threshold, name
        assert (c.rs or None, c.rs_threshold or None) == (v.rollout_rs, v.rollout_rs_threshold and str(v.rollout_rs_threshold))
        assert (c.bypass_mode, cfg.algorithm.loss_type, c.batch_normalize) == (v.bypass_mode, v.loss_type,
                                                                             v.rollout_is_batch_normalize), name


def test_presets_compose_and_unknown_lists_choices():
    cfg = resolve(preset="surge+decoupled_k3_rs")
    assert cfg.task.name == "scratch_add" and (cfg.correction.rs, cfg.correction.rs_threshold) == ("seq_mean_k3", "0.01")
    assert set(VERL_PRESETS) <= set(PRESETS)
    with pytest.raises(ConfigError, match="unknown preset 'k3'; valid choices: .*decoupled_k3_rs"):
        resolve(preset="smoke+k3")


@pytest.mark.parametrize("sets, needle", [
    (["correction.rs=token_k9", "correction.rs_threshold=1"], "unknown rejection rule 'token_k9'; valid choices: seq_max_k2"),
    (["correction.rs=token_k2", "correction.rs_threshold=0.5_2"], "one upper bound"),
    (["correction.rs=token_k2"], "correction.rs and correction.rs_threshold go together"),
    (["algorithm.loss_type=ppo"], "unknown algorithm.loss_type 'ppo'; valid choices: ppo_clip, reinforce"),
    (["correction.bypass_mode=true", "correction.mode=truncate"], "count it twice"),
])
def test_bad_correction_settings_one_line(tmp_path, capsys, sets, needle):
    code = main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "r"), *sum([["--set", s] for s in sets], [])])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and needle in err, err


def test_reinforce_loss_by_hand_and_same_gradient_as_ppo_at_ratio_one():
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.7, 0.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.5, -0.5], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 2.0, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    loss, m = reinforce_loss(logp, logp.detach(), adv, mask, is_weights=w)
    by_hand = -(1.5 * (-1.0 * 1 + -0.5 * 2 + -2.0 * 0.5) + -0.5 * (-0.3 * 1)) / 5
    assert float(loss.detach()) == pytest.approx(by_hand, rel=1e-12) and m["train/clip_frac"] == 0.0
    g1 = torch.autograd.grad(loss, logp)[0]
    g2 = torch.autograd.grad(ppo_clip_loss(logp, logp.detach(), adv, mask, is_weights=w)[0], logp)[0]
    assert torch.allclose(g1, g2, rtol=1e-12, atol=0)


def test_bypass_at_zero_mismatch_is_bitwise_the_decoupled_run(tmp_path):
    """With the exact engine, log mu == log pi_old bit for bit, so pi_old = mu changes nothing."""
    base = ["run.steps=2", "run.checkpoint_every=2"]
    train(resolve(preset="smoke", overrides=base), tmp_path / "a")
    train(resolve(preset="smoke+bypass_ppo_clip", overrides=base), tmp_path / "b")
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_rejection_and_bypass_reinforce_under_injected_mismatch(tmp_path):
    inj = ["mismatch.injector=logit_noise", "mismatch.magnitude=0.5", "run.steps=2", "run.checkpoint_every=2"]
    train(resolve(preset="smoke+bypass_pg_geo_rs_token_tis", overrides=inj), tmp_path / "pg")
    df = pd.read_parquet(tmp_path / "pg" / "metrics.parquet")
    row = df[df.step == 2].iloc[0]
    assert 0 < row["rs/masked_frac"] <= 1 and row["rs/seq_mean_k1_masked_frac"] == row["rs/masked_frac"]
    assert row["train/clip_frac"] == 0.0  # REINFORCE never clips
    # a rule that rejects every token: no update happens, the weights stay the warm start's
    train(resolve(preset="smoke", overrides=inj + ["correction.rs=token_k1", "correction.rs_threshold=1.000001"]),
          tmp_path / "all")
    df = pd.read_parquet(tmp_path / "all" / "metrics.parquet")
    assert (df[df.step > 0]["rs/masked_frac"] == 1.0).all() and (df[df.step > 0]["train/updated"] == 0).all()
    # self-normalized token IS: the mean final weight is 1
    train(resolve(preset="smoke", overrides=inj + ["correction.mode=truncate", "correction.batch_normalize=true"]),
          tmp_path / "sn")
    df = pd.read_parquet(tmp_path / "sn" / "metrics.parquet")
    assert df[df.step > 0]["is/ratio_mean_after"].tolist() == pytest.approx([1.0, 1.0], rel=1e-9)
    assert (df[df.step > 0]["is/batch_norm_factor"] != 1.0).all()


def test_lo_hi_threshold_survives_set():
    """YAML 1.1 would read 0.5_2.0 as the number 0.52."""
    cfg = resolve(preset="smoke", overrides=["correction.rs=token_k1", "correction.rs_threshold=0.5_2.0"])
    assert cfg.correction.rs_threshold == "0.5_2.0"
