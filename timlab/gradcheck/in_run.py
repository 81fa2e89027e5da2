"""gradcheck inside a training run: every ``run.gradcheck_every`` steps ``RLRun.gradient_check``
calls ``timlab.gradcheck.estimator.gradcheck`` at the current weights against the run's injector
(with its own seeds, so the run's trajectory is the same with or without it) and logs the pooled
statistics as ``gradcheck/<key>``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from timlab.gradcheck.estimator import GradcheckResult

if TYPE_CHECKING:
    from timlab.config import Config

GRADCHECK_KEYS = ("cosine", "cosine_lo", "cosine_hi", "cosine_plugin", "rel_bias", "rel_bias_lo", "rel_bias_hi",
                  "noise_floor_rel",
                  "bias_norm", "grad_norm_exact", "grad_norm_tim", "snr_exact", "snr_exact_lo", "snr_exact_hi",
                  "snr_tim", "snr_tim_lo", "snr_tim_hi")
"""gradcheck statistics logged as ``gradcheck/<key>`` (see ``timlab.metrics.gradients``)."""
IS_KEYS = ("rel_bias_is", "rel_bias_is_lo", "rel_bias_is_hi")
"""The importance-weighted estimate's keys, logged when gradcheck gives them (default sampling only)."""


def micro_batch(cfg: Config) -> int:
    """Sequences per in-run gradcheck micro-batch: 8, or one rloo group."""
    return cfg.rollout.samples_per_prompt if cfg.run.gradcheck_estimator == "rloo" else 8


def run_metrics(res: GradcheckResult) -> dict:
    """The ``gradcheck/*`` metrics of one in-run check."""
    out = {f"gradcheck/{k}": float(res.pooled[k]) for k in GRADCHECK_KEYS}
    out.update({f"gradcheck/{k}": float(res.pooled[k]) for k in IS_KEYS if k in res.pooled})
    out["gradcheck/tv_max"] = res.bound["delta_max"]
    out["gradcheck/tv_mean"] = res.bound["delta_mean"]
    return out
