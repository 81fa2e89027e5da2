"""timlab for TRL's ``GRPOTrainer``: the length-decay LR as a callback, mismatch metrics as a mixin.

Written against TRL 1.16 / transformers 5.23 / accelerate 1.15 (what was tested, and how:
docs/integrations.md). Imports only timlab's pure layer (metrics, schedulers) and TRL.

``TimlabCallback``: Beyond-Precision Algorithm 1 (``timlab.schedulers.LengthDecayLR``) replaces
the Trainer's LR schedule::

    trainer = GRPOTrainer(..., callbacks=[TimlabCallback(decay_period=None)])  # None: from the surge

How it takes over the LR (no Trainer method is patched):
- ``on_train_begin``: the Trainer's scheduler (a torch ``LambdaLR`` for every
  ``lr_scheduler_type`` except ``reduce_lr_on_plateau``) keeps its place and its ``step()``
  timing, but its ``lr_lambdas`` are replaced by timlab's factor, so ``lr_scheduler_type``,
  warmup and decay settings no longer act: update t runs at ``learning_rate * factor(t)``. Every
  param group's LR is set to that value at once.
- The factor comes from a ``LengthDecayLR`` on a one-parameter shadow optimizer with LR 1 (so
  its LR *is* the factor), stepped once per optimizer update in ``on_log`` with that update's
  mean completion length (TRL's ``completions/mean_length``). After each step the next update's
  LR is written again, so a surge detected at update s acts from update s + 1 on.
- ``on_step_end`` asks for a log after every optimizer update (``control.should_log = True``):
  TRL averages its metrics over the logging window, and the surge detector needs one length per
  update. ``logging_steps`` therefore has no effect.
- Resume (``trainer.train(resume_from_checkpoint=...)``): the schedule is rebuilt by replaying
  the lengths kept in ``state.log_history`` (restored from trainer_state.json). No extra file is
  written and TRL's scheduler.pt stays loadable (the new lambdas are plain functions, which
  ``LambdaLR.state_dict`` stores as None).

Keys added to every update's log (``trainer.state.log_history`` and the ``logs`` dict the
callbacks after this one receive), the names timlab's own trainer logs (docs/metrics.md):
``train/lr`` (the LR the update ran with; TRL's own ``learning_rate`` shows the same),
``scheduler/lr_factor``, ``scheduler/response_length`` (the length fed to the scheduler),
``scheduler/surge_step`` and ``scheduler/decay_period`` (NaN until known). The
``report_to`` loggers (wandb, tensorboard) are callbacks registered *before* user callbacks, so
they see these keys only when this callback runs first: ``TimlabGRPOTrainer`` moves it there.

``TimlabMetricsMixin`` / ``TimlabGRPOTrainer``: timlab's ``all_metrics`` (verl's
``rollout_corr/*`` plus ``mismatch/*``) on (trainer log-probs, sampler log-probs, completion
mask) of every generation batch, logged through TRL's own metric channel. TRL keeps the
sampler's per-token log-probs only when the generation backend returns them: vLLM (TRL computes
the trainer side too when ``vllm_importance_sampling_correction`` is on) or a ``rollout_func``
that returns ``logprobs``. TRL's plain transformers ``generate`` path (the CPU path) drops them,
so there is nothing to compare and the mixin logs nothing. It also logs the raw IS ratios of
TRL's own correction *before* its truncation or masking (``is/ratio_{mean,max,min}_before``,
``is/ratio_frac_high`` / ``_low``: shares above ``vllm_importance_sampling_clip_max`` and below
``clip_min``, or 1 / clip_max), at the level of ``vllm_importance_sampling_mode`` (TRL logs its
ratios only after truncation), and the advantage-weighted harm statistics of the batch's
``advantages`` (``mismatch/adv_diff_mean``, ``mismatch/adv_diff_corr``; ``timlab.metrics.harm``:
TRL computes token entropies only inside its loss, so the decision-token split is not logged).
On training batches it also logs the persistence of the mismatch's per-token-id bias across
generation batches (``mismatch/persistence_lag1``, ``_ema``, ``_reliability``;
``timlab.metrics.persistence``) from ``completion_ids``, with one ``PersistenceTracker`` per
trainer sized to the model's vocabulary (its config's ``vocab_size``); NaN at the first batch (the
reliability excepted). Its state is not in TRL's checkpoints: a resumed run starts it afresh.
When TRL did not compute
``old_per_token_logps`` itself, the mixin runs one extra no-grad forward of the current policy.
Tokens whose sampler log-prob is NaN (vLLM could not score them) are left out of the mask.

Departures from TRL: the loss is untouched; the LR schedule is timlab's; every update is logged.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback
from trl import GRPOTrainer

from timlab.metrics import advantage_metrics, all_metrics
from timlab.metrics.persistence import PersistenceTracker
from timlab.remedies import RAW_RATIO_KEYS, is_weights
from timlab.schedulers import LengthDecayLR
from timlab.schedulers.length_decay import METRIC_KEYS as SCHEDULER_KEYS, LengthDecayView

LENGTH_KEY = "completions/mean_length"
"""TRL's metric for the mean completion length of a generation batch (TRL 1.16)."""


def _set_lr(group: dict, lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def _nan_if_none(x: float | int | None) -> float:
    return float("nan") if x is None else float(x)


class TimlabCallback(LengthDecayView, TrainerCallback):
    """Beyond-Precision length-decay LR for TRL's ``GRPOTrainer`` (see the module docstring).

    ``schedule_kwargs`` are ``LengthDecayLR``'s keyword arguments, with its defaults: halve the
    LR every ``decay_period`` updates (None: set it to ``surge_factor`` x the update where the
    mean completion length surged), never below ``min_lr_ratio`` x ``learning_rate``.
    ``log_metrics`` adds ``SCHEDULER_KEYS`` to every log; ``length_key`` is the logged metric
    fed to the scheduler.
    """

    def __init__(self, *, log_metrics: bool = True, length_key: str = LENGTH_KEY, **schedule_kwargs):
        self.schedule_kwargs = schedule_kwargs
        self.log_metrics = log_metrics
        self.length_key = length_key
        self.schedule = self._new_schedule()  # validates the arguments now, not at train time
        self._trainer_scheduler: LambdaLR | None = None
        self._last_step = 0  # optimizer updates the schedule has been stepped for
        self._lr_used: float | None = None

    # ------------------------------------------------------------------ the schedule
    def _new_schedule(self) -> LengthDecayLR:
        """A LengthDecayLR on a shadow optimizer with LR 1: its LR is the factor."""
        return LengthDecayLR.standalone(**self.schedule_kwargs)

    def _advance(self, response_length: float | None) -> None:
        self.schedule.step(response_length=response_length)

    def lr_factor(self, update: int) -> float:
        """LR of optimizer update ``update`` (from 1) over ``learning_rate``."""
        return self.schedule.lr_factor(update)

    def _apply(self, update: int) -> None:
        """Write learning_rate x factor(update) into every param group and the Trainer's scheduler."""
        sched = self._trainer_scheduler
        factor = self.lr_factor(update)
        lrs = [base * factor for base in sched.base_lrs]  # the same product LambdaLR.get_lr forms
        for group, lr in zip(sched.optimizer.param_groups, lrs):
            _set_lr(group, lr)
        sched._last_lr = lrs  # what get_last_lr() (TRL's `learning_rate` log) returns

    def _replay(self, state) -> None:
        """Rebuild the schedule for a resumed run from the lengths in ``state.log_history``."""
        lengths: dict[int, float] = {}
        for entry in state.log_history:
            value = entry.get(self.length_key)
            if "step" in entry and isinstance(value, (int, float)) and math.isfinite(value):
                lengths[int(entry["step"])] = float(value)
        for t in range(1, state.global_step + 1):
            self._advance(lengths.get(t))

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        if not isinstance(lr_scheduler, LambdaLR):
            raise TypeError(
                "TimlabCallback replaces the Trainer's LambdaLR schedule, got "
                f"{type(lr_scheduler).__name__}; use lr_scheduler_type='constant' (or any LambdaLR type)"
            )
        self.schedule = self._new_schedule()
        self._replay(state)
        self._last_step = state.global_step
        self._trainer_scheduler = lr_scheduler
        # LambdaLR sets the LR for update k + 1 right after update k: hand it timlab's factor.
        # A plain function (not a bound method) so LambdaLR.state_dict stores None for it.
        lr_scheduler.lr_lambdas = [lambda k: self.lr_factor(k + 1) for _ in lr_scheduler.lr_lambdas]
        self._apply(state.global_step + 1)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._trainer_scheduler is not None:
            lr = self._trainer_scheduler.optimizer.param_groups[0]["lr"]
            self._lr_used = float(lr)

    def on_step_end(self, args, state, control, **kwargs):
        control.should_log = True  # one log (and one length) per optimizer update
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._trainer_scheduler is None or state.global_step <= self._last_step:
            return  # not a training-step log (train summary, evaluation) or already seen
        logs = logs if logs is not None else {}
        while self._last_step < state.global_step - 1:  # an update that was never logged
            self._advance(None)
            self._last_step += 1
        value = logs.get(self.length_key)
        length = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
        self._advance(length)
        t = self._last_step = state.global_step
        self._apply(t + 1)
        if not self.log_metrics:
            return
        lr = self._lr_used if self._lr_used is not None else self._trainer_scheduler.base_lrs[0] * self.lr_factor(t)
        values = (lr, self.lr_factor(t), length, self.surge_step, self.decay_period)
        extra = {key: _nan_if_none(v) for key, v in zip(SCHEDULER_KEYS, values)}
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


# ---------------------------------------------------------------------- mismatch metrics
_MAX_KEYS = ("max", "max_abs_diff")
_MIN_KEYS = ("min",)
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "num_images")


def _reduce_rank_metrics(keys: list[str], per_rank: torch.Tensor) -> dict[str, float]:
    """Combine (P, K) per-process metric values: max/min for extremes, sum for counts, else mean."""
    out = {}
    for j, key in enumerate(keys):
        col = per_rank[:, j]
        last = key.rsplit("_", 1)[-1]
        if key.endswith("max_abs_diff") or last in _MAX_KEYS:
            out[key] = float(col.max())
        elif last in _MIN_KEYS:
            out[key] = float(col.min())
        elif key.endswith("num_tokens"):
            out[key] = float(col.sum())
        else:
            out[key] = float(col.mean())
    return out


def raw_ratio_metrics(trainer_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, args) -> dict[str, float]:
    """``RAW_RATIO_KEYS`` at the level of TRL's ``vllm_importance_sampling_mode`` (token_* or
    sequence_*), with its clip_max / clip_min as the thresholds of the high / low shares."""
    level = "sequence" if str(getattr(args, "vllm_importance_sampling_mode", "sequence_mask")).startswith("sequence") else "token"
    hi = getattr(args, "vllm_importance_sampling_clip_max", None) or getattr(args, "vllm_importance_sampling_cap", None) or 3.0
    lo = getattr(args, "vllm_importance_sampling_clip_min", None)
    mode = "two_sided" if lo is not None and lo < hi else "none"  # the raw statistics do not depend on the mode
    _, m = is_weights(trainer_logp, sampling_logp, mask, level=level, mode=mode, threshold=float(hi),
                      threshold_low=float(lo) if mode == "two_sided" else None)
    return {k: m[k] for k in RAW_RATIO_KEYS}


def persistence_metrics(trainer, batch: dict, trainer_logp: torch.Tensor, sampling_logp: torch.Tensor,
                        mask: torch.Tensor) -> dict[str, float]:
    """``PERSISTENCE_KEYS`` of a training generation batch against the trainer's earlier ones, from
    its ``completion_ids`` (B, C); one ``PersistenceTracker`` per trainer (``_timlab_persistence``,
    made at the first batch, sized to the model's vocabulary). Nothing for an evaluation batch
    (``trainer.model`` not in training mode) or a batch without ``completion_ids``."""
    model = getattr(trainer, "model", None)
    if "completion_ids" not in batch or model is None or not model.training:
        return {}
    tracker = getattr(trainer, "_timlab_persistence", None)
    if tracker is None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        tracker = trainer._timlab_persistence = PersistenceTracker(int(config.vocab_size))
    return tracker.update(trainer_logp, sampling_logp, mask, batch["completion_ids"])


class TimlabMetricsMixin:
    """Adds timlab's mismatch metrics to a ``GRPOTrainer`` (list it before ``GRPOTrainer``).

    Every generation batch that carries ``sampling_per_token_logps`` gets
    ``all_metrics(trainer_logp, sampling_logp, completion_mask)`` and ``advantage_metrics`` of its
    ``advantages`` appended to TRL's metrics, so ``rollout_corr/*`` and ``mismatch/*`` show up in
    every log and logger. Also moves any
    ``TimlabCallback`` to the front of the callback list so the ``report_to`` loggers see its keys.
    Multi-process values are combined per key (max/min for extremes, sum for num_tokens, else the
    mean of the per-process values); only the single-process path was tested.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        callbacks = self.callback_handler.callbacks
        ours = [cb for cb in callbacks if isinstance(cb, TimlabCallback)]
        for cb in ours:
            callbacks.remove(cb)
        callbacks[0:0] = ours

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        sampling_logp = output.get("sampling_per_token_logps")
        if sampling_logp is None or any(k in output for k in _MULTIMODAL_KEYS):
            return output
        mode = "train" if self.model.training else "eval"
        for key, value in self.timlab_mismatch_metrics(output).items():
            self._metrics[mode][key].append(value)
        return output

    def timlab_mismatch_metrics(self, batch: dict) -> dict[str, float]:
        """``all_metrics`` on one generation batch as built by ``_generate_and_score_completions``."""
        sampling_logp = batch["sampling_per_token_logps"]  # (B, C) log mu
        trainer_logp = batch.get("old_per_token_logps")  # (B, C) log pi_old, when TRL computed it
        if trainer_logp is None:
            trainer_logp = self._timlab_trainer_logps(batch)
        mask = batch["completion_mask"]  # (B, C)
        if "tool_mask" in batch:
            mask = mask * batch["tool_mask"]
        mask = mask.bool() & torch.isfinite(sampling_logp)
        metrics = all_metrics(trainer_logp, sampling_logp, mask)
        advantages = batch.get("advantages")  # (B,) in TRL's GRPO; (B, C) in subclasses that make them per token
        if advantages is not None:
            metrics.update(advantage_metrics(trainer_logp, sampling_logp, mask, advantages))
        metrics.update(raw_ratio_metrics(trainer_logp, sampling_logp, mask, self.args))
        metrics.update(persistence_metrics(self, batch, trainer_logp, sampling_logp, mask))
        if self.accelerator.num_processes == 1:
            return metrics
        keys = list(metrics)
        local = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=sampling_logp.device)
        per_rank = self.accelerator.gather(local[None]).view(-1, len(keys))  # (P, K)
        return _reduce_rank_metrics(keys, per_rank.cpu())

    def _timlab_trainer_logps(self, batch: dict) -> torch.Tensor:
        """The current policy's per-token log-probs of the completions (no grad), as TRL's loss sees them."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # (B, P + C)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)  # (B, P + C)
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, batch["completion_ids"].size(1), batch_size=batch_size
            )
        return logps  # (B, C)


class TimlabGRPOTrainer(TimlabMetricsMixin, GRPOTrainer):
    """``GRPOTrainer`` that logs timlab's mismatch metrics (``TimlabMetricsMixin``)."""


__all__ = ["LENGTH_KEY", "SCHEDULER_KEYS", "TimlabCallback", "TimlabMetricsMixin", "TimlabGRPOTrainer", "raw_ratio_metrics",
           "persistence_metrics"]
