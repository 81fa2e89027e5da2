"""timlab for verl: mismatch metrics on verl's batch, and the length-decay LR for verl's PPO loop.

Written against verl 0.9.1 (``verl/trainer/ppo/ray_trainer.py``, ``verl/workers/engine_workers.py``);
the patch that wires it in, and what was tested, are in docs/integrations.md. Imports only
timlab's pure layer and torch: verl itself is never imported, so this module works on the
driver, in a worker, or in a test with plain tensors.

``compute_metrics(batch)``: verl's batch (a ``DataProto``, anything with a ``.batch`` mapping,
or a plain dict) with ``old_log_probs`` (log pi_old, recomputed by the actor), ``rollout_log_probs``
(log mu, from the rollout engine; verl keeps them with
``actor_rollout_ref.rollout.calculate_log_probs=True``) and ``response_mask`` (or
``attention_mask`` + ``responses``, from which verl derives it), all (B, T). Returns
``timlab.metrics.all_metrics``: ``rollout_corr/*`` with the definitions and names of verl's
``compute_offpolicy_metrics`` (departures, all in edge cases, are listed in
``timlab.metrics.offpolicy``) plus timlab's ``mismatch/*`` extras.

With ``advantages`` in the batch (after verl's ``compute_advantage``; (B, T), one value per token)
it adds the advantage-weighted harm statistics (``mismatch/adv_diff_mean``, ``_corr``), and with
the actor's token entropies (``entropys``, which verl pops right after ``compute_log_prob``; pass
them as ``entropy=``) the decision-token split (``mismatch/k3_decision``, ``mismatch/k3_rest``):
``timlab.metrics.harm``. ``advantage_metrics(batch)`` gives the advantage-weighted ones alone,
for the point after ``compute_advantage``.

``correction_metrics(batch, rollout_correction)``: timlab's ``is/*`` (raw ratios before truncation,
truncated / masked shares of tokens and sequences) and ``rs/*`` for verl's own rollout-correction
settings; timlab's ``is_weights`` and ``rejection_mask`` give verl's weights and masks (tested
against verl's functions in tests/test_rejection.py).

``MismatchPersistence(vocab_size)``: the persistence of the mismatch's per-token-id bias across
training steps (``timlab.metrics.persistence``: ``mismatch/persistence_lag1``, ``_ema``,
``_reliability``). Its ``update(batch)``, called once per training step where ``compute_metrics``
is, reads the token ids from ``responses`` (B, T) besides the log-probs and the mask, and keeps
one ``PersistenceTracker`` across steps (``state_dict`` / ``load_state_dict`` for verl's
checkpoints). ``vocab_size`` is the model's (its HF config's ``vocab_size``, which can exceed the
tokenizer's length): the ids the rollout can sample.

``LengthDecayHook``: Beyond-Precision Algorithm 1 for verl. In verl the LR scheduler lives in the
actor workers while the mean response length (``response_length/mean``) is computed by the
driver, so the hook runs on the driver and sends the workers a factor:

- driver, per training step: pass ``hook.lr_factor`` to ``update_actor`` (a non-tensor field of
  the batch), then, once verl has filled ``metrics``, ``metrics.update(hook.update_from_metrics(metrics))``;
- worker, at the start of each ``train_mini_batch``: ``apply_lr_factor(engine.optimizer,
  factor, scheduler=engine.lr_scheduler)`` sets each group's LR to verl's scheduled LR x factor,
  so verl's own schedule (constant, or warmup + cosine) composes multiplicatively with it.

Update t is verl's training step t (verl steps its own scheduler once per step too, after all
mini-batches), so with ``ppo_mini_batch_size`` < batch every mini-batch of a step shares one LR.
For a loop where optimizer and batch live in one process, ``make_length_decay_scheduler``
returns the plain ``LengthDecayLR``; step it with ``response_length=response_length_mean(batch)``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch.optim import Optimizer

from timlab.errors import UsageError
from timlab.metrics import all_metrics, harm_metrics
from timlab.metrics import advantage_metrics as _advantage_metrics
from timlab.metrics.persistence import PersistenceTracker
from timlab.remedies import is_weights, rejection_mask
from timlab.schedulers import LengthDecayLR
from timlab.schedulers.length_decay import METRIC_KEYS as SCHEDULER_KEYS, LengthDecayView

OLD_LOGP_KEY = "old_log_probs"
ROLLOUT_LOGP_KEY = "rollout_log_probs"
RESPONSE_MASK_KEY = "response_mask"
ADVANTAGES_KEY = "advantages"
"""verl's per-token advantages (B, T), in the batch after ``compute_advantage``."""
ENTROPY_KEY = "entropys"
"""verl's name for the actor's token entropies (B, T) (``compute_log_prob``'s output)."""
TOKENS_KEY = "responses"
"""verl's response token ids (B, T), right-padded like the log-probs."""
LENGTH_KEY = "response_length/mean"
"""verl's metric for the batch's mean response length (``compute_data_metrics``)."""


def _tensors(batch: Any) -> Mapping[str, torch.Tensor]:
    """The tensor mapping of a DataProto (``.batch``, a TensorDict) or of a plain dict."""
    data = getattr(batch, "batch", batch)
    if not hasattr(data, "keys") or not hasattr(data, "__getitem__"):
        raise TypeError(f"expected a verl DataProto, an object with a .batch mapping, or a dict; got {type(batch).__name__}")
    return data


def _has(data: Mapping, key: str) -> bool:
    return key in list(data.keys())


def response_mask(batch: Any) -> torch.Tensor:
    """(B, T) mask of response tokens: ``response_mask``, else ``attention_mask[:, -T:]`` with
    T = ``responses.shape[1]`` (how verl's ``compute_response_mask`` builds it)."""
    data = _tensors(batch)
    if _has(data, RESPONSE_MASK_KEY):
        return data[RESPONSE_MASK_KEY]
    if _has(data, "attention_mask") and _has(data, "responses"):
        T = data["responses"].shape[-1]
        return data["attention_mask"][:, -T:]  # (B, T)
    raise KeyError(f"batch has neither {RESPONSE_MASK_KEY!r} nor 'attention_mask' + 'responses'; keys: {sorted(data.keys())}")


def response_length_mean(batch: Any) -> float:
    """Mean response length of the batch, as verl's ``response_length/mean`` computes it
    (``attention_mask[:, -T:]`` summed per row when present, else ``response_mask``)."""
    data = _tensors(batch)
    if _has(data, "attention_mask") and _has(data, "responses"):
        mask = data["attention_mask"][:, -data["responses"].shape[-1]:]  # (B, T)
    else:
        mask = response_mask(batch)
    return float(mask.sum(-1).float().mean())


def _log_probs(data: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi_old, log mu) of the batch; a missing one raises a KeyError naming verl's setting."""
    missing = [k for k in (OLD_LOGP_KEY, ROLLOUT_LOGP_KEY) if not _has(data, k)]
    if missing:
        hint = (" (verl keeps the rollout engine's log-probs with actor_rollout_ref.rollout.calculate_log_probs=True)"
                if ROLLOUT_LOGP_KEY in missing else "")
        raise KeyError(f"batch is missing {', '.join(map(repr, missing))}{hint}; keys: {sorted(data.keys())}")
    return data[OLD_LOGP_KEY], data[ROLLOUT_LOGP_KEY]


def compute_metrics(batch: Any, *, num_micro_batches: int = 1, entropy: torch.Tensor | None = None) -> dict[str, float]:
    """``rollout_corr/*`` (verl's names and definitions) and ``mismatch/*`` on verl's batch.

    Needs ``old_log_probs`` and ``rollout_log_probs`` (B, T) and a response mask (see
    ``response_mask``). ``num_micro_batches`` feeds ``mismatch/ratio_var_across_micro_batches``.
    Adds the advantage-weighted harm statistics when the batch has ``advantages``, and the
    decision-token split when ``entropy`` (B, T) is given or the batch has ``entropys``.
    """
    data = _tensors(batch)
    train, rollout = _log_probs(data)
    mask = response_mask(batch)
    out = all_metrics(train, rollout, mask, num_micro_batches=num_micro_batches)
    if entropy is None and _has(data, ENTROPY_KEY):
        entropy = data[ENTROPY_KEY]
    adv = data[ADVANTAGES_KEY] if _has(data, ADVANTAGES_KEY) else None
    out.update(harm_metrics(train, rollout, mask, advantages=adv, entropy=entropy))
    return out


def advantage_metrics(batch: Any) -> dict[str, float]:
    """``mismatch/adv_diff_mean`` and ``mismatch/adv_diff_corr`` (``timlab.metrics.advantage_metrics``)
    on verl's batch after ``compute_advantage``: ``old_log_probs``, ``rollout_log_probs``,
    ``advantages`` (B, T) and the response mask."""
    data = _tensors(batch)
    train, rollout = _log_probs(data)
    if not _has(data, ADVANTAGES_KEY):
        raise KeyError(f"batch has no {ADVANTAGES_KEY!r} (verl adds them in compute_advantage); keys: {sorted(data.keys())}")
    return _advantage_metrics(train, rollout, response_mask(batch), data[ADVANTAGES_KEY])


def correction_metrics(batch: Any, rollout_correction: Mapping[str, Any]) -> dict[str, float]:
    """timlab's ``is/*`` and ``rs/*`` for verl's ``algorithm.rollout_correction`` settings
    (``rollout_is``, ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``,
    ``rollout_rs_threshold``; a mapping or an omegaconf node) on verl's batch: the raw ratios
    before truncation (``is/ratio_*_before``, ``is/ratio_frac_*``) and the truncated / masked
    shares of tokens and sequences, which verl's ``rollout_corr/rollout_is_*`` do not give.
    ``is/*`` only when ``rollout_is`` is set, ``rs/*`` only when ``rollout_rs`` is.
    """
    data = _tensors(batch)
    train, rollout, mask = data[OLD_LOGP_KEY], data[ROLLOUT_LOGP_KEY], response_mask(batch)
    get = rollout_correction.get
    out: dict[str, float] = {}
    level = get("rollout_is", None)
    if level:
        spec = str(get("rollout_is_threshold", 2.0))
        lo, hi = spec.split("_", 1) if "_" in spec else (None, spec)
        mode = "truncate" if lo is None else "two_sided"  # verl: one number = TIS, "lo_hi" = IcePop
        _, m = is_weights(train, rollout, mask, level=level, mode=mode, threshold=float(hi),
                          threshold_low=None if lo is None else float(lo),
                          batch_normalize=bool(get("rollout_is_batch_normalize", False)))
        out.update(m)
    rules = get("rollout_rs", None)
    if rules:
        _, m = rejection_mask(train, rollout, mask, rules=rules, thresholds=get("rollout_rs_threshold", None))
        out.update(m)
    return out


class MismatchPersistence:
    """``mismatch/persistence_*`` over verl's training steps: one ``PersistenceTracker`` fed verl's
    batch once per step (see the module docstring)."""

    def __init__(self, vocab_size: int):
        self.tracker = PersistenceTracker(int(vocab_size))

    def update(self, batch: Any) -> dict[str, float]:
        """This step's ``PERSISTENCE_KEYS`` (NaN at the first step, the reliability excepted) from
        ``old_log_probs``, ``rollout_log_probs``, ``responses`` and the response mask; then take it in."""
        data = _tensors(batch)
        train, rollout = _log_probs(data)
        if not _has(data, TOKENS_KEY):
            raise KeyError(f"batch has no {TOKENS_KEY!r} (the response token ids persistence needs); "
                           f"keys: {sorted(data.keys())}")
        return self.tracker.update(train, rollout, response_mask(batch), data[TOKENS_KEY])

    def state_dict(self) -> dict:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state)


def make_length_decay_scheduler(optimizer: Optimizer, **schedule_kwargs) -> LengthDecayLR:
    """``LengthDecayLR`` on ``optimizer`` (``schedule_kwargs``: its keyword arguments), for a loop
    that has both the optimizer and the batch.

    After each update: ``scheduler.step(response_length=response_length_mean(batch))``.
    """
    return LengthDecayLR(optimizer, **schedule_kwargs)


def apply_lr_factor(optimizer: Optimizer, factor: float, *, scheduler: Any = None) -> list[float]:
    """Worker side: set each param group's LR to its scheduled LR x ``factor``; returns the LRs.

    The scheduled LR is ``scheduler.get_last_lr()`` when the scheduler has it (torch schedulers,
    so calling this twice does not compound), else the group's current LR.
    """
    factor = float(factor)
    if not (math.isfinite(factor) and factor > 0.0):
        raise UsageError(f"lr factor must be a finite number > 0, got {factor!r}")
    groups = optimizer.param_groups
    if scheduler is not None and hasattr(scheduler, "get_last_lr"):
        base = [float(x) for x in scheduler.get_last_lr()]
    else:
        base = [float(g["lr"]) for g in groups]
    lrs = [b * factor for b in base]
    for group, lr in zip(groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return lrs


class LengthDecayHook(LengthDecayView):
    """Driver-side length-decay LR for verl: the factor for the next actor update, fed with
    ``response_length/mean`` once per training step.

    ``schedule_kwargs`` are ``LengthDecayLR``'s keyword arguments, with its defaults (halve every
    ``decay_period`` steps; None: from the response-length surge; floor ``min_lr_ratio``).
    ``base_lr`` (the actor's ``optim.lr``) only adds ``train/lr`` = base_lr x factor to the
    returned metrics. Internally a ``LengthDecayLR`` runs on a one-parameter shadow optimizer
    with LR 1, so its LR is the factor.
    """

    def __init__(self, *, length_key: str = LENGTH_KEY, base_lr: float | None = None, **schedule_kwargs):
        self.schedule = LengthDecayLR.standalone(**schedule_kwargs)
        self.length_key = length_key
        self.base_lr = None if base_lr is None else float(base_lr)

    @property
    def lr_factor(self) -> float:
        """Factor of the next actor update (send this to the workers)."""
        return float(self.schedule.get_last_lr()[0])

    @property
    def num_steps(self) -> int:
        """Training steps fed so far."""
        return self.schedule.last_epoch

    def update_from_metrics(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Feed one training step's ``metrics[length_key]`` (missing or non-finite: no signal)
        and advance; returns ``SCHEDULER_KEYS`` describing the step just taken (``train/lr``
        only with ``base_lr``)."""
        used = self.lr_factor
        value = metrics.get(self.length_key)
        length = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
        self.schedule.step(response_length=length)
        lr = None if self.base_lr is None else self.base_lr * used
        values = (lr, used, length, self.surge_step, self.decay_period)
        return {key: float("nan") if v is None else float(v) for key, v in zip(SCHEDULER_KEYS, values)
                if v is not None or key != "train/lr"}

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)


def length_decay_from_config(config: Any) -> LengthDecayHook | None:
    """The hook for a verl config with a ``timlab.length_decay`` section (None without one).

    The section's keys are ``LengthDecayHook``'s arguments, e.g. on verl's command line
    ``+timlab.length_decay.decay_period=null +timlab.length_decay.min_lr_ratio=0.1``;
    ``base_lr`` defaults to ``actor_rollout_ref.actor.optim.lr``.
    """
    section = config.get("timlab", None) if hasattr(config, "get") else None
    section = section.get("length_decay", None) if section is not None else None
    if section is None:
        return None
    kwargs = dict(section)
    if "base_lr" not in kwargs:
        try:
            kwargs["base_lr"] = float(config["actor_rollout_ref"]["actor"]["optim"]["lr"])
        except (KeyError, TypeError):
            pass
    try:
        return LengthDecayHook(**kwargs)
    except TypeError as e:
        raise TypeError(f"timlab.length_decay: {e}") from None


__all__ = [
    "OLD_LOGP_KEY", "ROLLOUT_LOGP_KEY", "RESPONSE_MASK_KEY", "ADVANTAGES_KEY", "ENTROPY_KEY", "LENGTH_KEY",
    "SCHEDULER_KEYS", "response_mask", "response_length_mean", "compute_metrics", "advantage_metrics",
    "correction_metrics", "TOKENS_KEY", "MismatchPersistence",
    "make_length_decay_scheduler", "apply_lr_factor", "LengthDecayHook", "length_decay_from_config",
]
