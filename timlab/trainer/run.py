"""The zero-mismatch RL loop: one ``RLRun`` per run directory.

A step reads top to bottom as rollout -> score -> metrics -> correction -> loss -> update:

1. rollout: prompts x samples_per_prompt through the rollout engine (exact by default), with the
   configured mismatch injector applied on the rollout side only;
2. score: the trainer's forward (autograd on) gives log pi on the same tokens; in exact mode with
   no injector the zero-mismatch guard requires it to equal the rollout's log mu bit for bit;
3. metrics: verl's rollout_corr/* plus timlab's mismatch/* on (log pi_old, log mu), with the
   harm statistics of the step's advantages and the trainer's token entropies;
4. correction: optional IS weights (token / sequence / geometric x truncate / mask / two-sided,
   optionally self-normalized) and rejection sampling (verl's rules), which zeroes rejected
   tokens of the loss mask;
5. loss: PPO clipped surrogate (or REINFORCE, ``algorithm.loss_type``) with pi_old = the trainer's
   own log-probs under the rollout weights (so mu only enters through the sampled tokens and the
   IS weights), or pi_old = mu in verl's bypass mode (``correction.bypass_mode``). Unlike verl,
   bypass mode does not skip the pi_old forward: the metrics and the guard need it. IS weights
   and rejection are computed once per step from those log-probs; verl's bypass mode recomputes
   them per mini-batch from the current policy (the same when epochs = mini_batches = 1);
6. update: AdamW with gradient clipping, then the LR scheduler, fed the mean response length.

``RLRun.train_step`` calls one method per phase: ``_rollout``, ``_score``, ``_mismatch_metrics``,
``_correct``, ``_loss_batch`` + ``_update`` (whose ``_optimizer_step`` writes the update out), then
``_step_metrics``; ``_timed`` times them.

Departures from GRPO as published: clip-higher (0.2 / 0.28) and token-mean aggregation (DAPO),
no KL term by default, groups whose rewards are all equal are dropped from the loss.

Determinism: every random draw comes from a generator whose state is checkpointed, so the
same config and seed give bitwise-identical weights and (non-timing) metrics, and a run killed
at any point and resumed ends exactly like an uninterrupted one.
"""

from __future__ import annotations

import copy
import math
import random
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from timlab.config import Config, ConfigError, flatten, rollout_sampling, validate
from timlab.engines import NonFiniteLogitsError, Rollout, build_engine
from timlab.engines.device_loop import loop_for, use_loop
from timlab.errors import TimlabError, UsageError, disk_full, is_disk_full, one_line
from timlab.files import atomic_write_text
from timlab.gradcheck import in_run as gradcheck_in_run
from timlab.gradcheck.estimator import gradcheck
from timlab.injectors import build_injector
from timlab.machine import describe as describe_machine, resume_note
from timlab.progress import Progress
from timlab.metrics import (
    all_metrics,
    harm_metrics,
    mismatch_by_length,
    mismatch_by_position,
    mismatch_by_prob_bucket,
    ratio_histogram,
    routing_metrics,
)
from timlab.metrics.alarm import ALARMS, EXPERIMENTAL, AlarmWatch
from timlab.metrics.persistence import PersistenceTracker
from timlab.model.forward import token_logprobs
from timlab.model.hf_io import load_model
from timlab.model.moe import Routing
from timlab.remedies import is_weights, rejection_mask, replay_experts
from timlab.rundir import DIVERGED, FAILED, FINISHED, GUARD_FAILED, RUNNING, RunDir
from timlab.rundir.checkpoint import checkpoints_newest_first, load_state, save_checkpoint, verify_checkpoint
from timlab.rundir.metrics_log import MetricsLog
from timlab.schedulers import SCHEDULERS, scheduler_from_config
from timlab.tasks import Task, make_splits
from timlab.trainer import distributed as dist_utils
from timlab.trainer.advantages import ADVANTAGES, informative_groups
from timlab.trainer.losses import POLICY_LOSSES
from timlab.trainer.precision import load_policy
from timlab.trainer.pretrain import ensure_warm_start
from timlab.trainer.scoring import gold_logprob, greedy_accuracy, greedy_replies, rollout_rewards


class ZeroMismatchViolation(TimlabError, RuntimeError):
    """The exact engine and the trainer disagreed on some bit: the zero-mismatch setting is broken."""


class NonFiniteError(TimlabError, RuntimeError):
    """NaN/Inf in logits, loss or gradients; the message names the step and the tensor."""


RESUME_OVERRIDES = ("run.steps", "run.progress", "run.tensorboard")
"""The config keys a resume may change; any other difference from the checkpoint's config is refused."""


def resume_config_changes(saved: dict, cfg: Config) -> list[str]:
    """``key: old -> new`` for each config value that differs between a checkpoint's config and
    ``cfg``, outside ``RESUME_OVERRIDES`` (keys a checkpoint from an older timlab lacks are not
    compared, except task options)."""
    then, now = flatten(saved), cfg.to_flat_dict()
    keys = sorted(k for k in set(then) | set(now) if k in then or k.startswith("task.kwargs."))
    return [f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in keys
            if k not in RESUME_OVERRIDES and then.get(k) != now.get(k)]


STATUS_EVERY_S = 1.0
"""status.json follows a run's step at each checkpoint and at most this often in between: a file
replace costs a good part of a small model's step, so once per step would slow training."""


@dataclass
class UpdateBatch:
    """One step's inputs to the PPO update: (B, L) tensors unless noted."""

    tokens: torch.Tensor
    key_valid: torch.Tensor
    old_logp: torch.Tensor
    """pi_old of the loss, no autograd: the trainer's log-probs under the rollout weights, or the
    rollout's own (log mu) in bypass mode."""
    advantages: torch.Tensor
    """(B,): one advantage per sequence."""
    loss_mask: torch.Tensor
    """Response tokens of the sequences kept for the loss (float)."""
    kv_len: int
    """Key width of the rollout grid (the exact attention pads its keys back to it)."""
    logp: torch.Tensor | None = None
    """The same log-probs with autograd, when one update uses them (epochs = mini_batches = 1)."""
    is_weights: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    """The frozen reference policy's log-probs, for the KL penalty."""
    experts: torch.Tensor | None = None
    """Router replay: the rollout's experts (L_sparse, B, L, k) the trainer's forward uses."""


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)``, fused (one kernel over every parameter) where torch
    has the fused kernel for the parameters' device and dtype, else torch's default implementation.
    The fused step is deterministic and keeps the same state_dict layout (resume works either way);
    its bits differ from the per-parameter loop's in the last place (a different operation order),
    and it is ~4x faster on the small models here (bench/RESULTS.md)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # no fused kernel for this device / dtype
        return torch.optim.AdamW(params, **kwargs)


@dataclass
class StepOutput:
    metrics: dict
    distributions: dict | None


@dataclass
class _Scored:
    """One step's rollout cut to its realized columns (B, L) and scored by the trainer."""

    tokens: torch.Tensor
    key_valid: torch.Tensor
    mask: torch.Tensor
    """Response tokens (bool)."""
    old_logp: torch.Tensor
    """The trainer's log-probs under the rollout weights, no autograd (log pi_old)."""
    rollout_logp: torch.Tensor
    """The rollout's own log-probs (log mu)."""
    entropy: torch.Tensor
    kv_len: int
    """Key width S of the rollout grid (the exact attention pads its keys back to it)."""
    logp: torch.Tensor | None = None
    """``old_logp`` with autograd, when one update uses it (epochs = mini_batches = 1)."""
    experts: torch.Tensor | None = None
    """The rollout's experts (L_sparse, B, L, k) of a mixture-of-experts model."""
    replay: torch.Tensor | None = None
    """``experts`` when router replay forces them on the trainer's forward."""
    routing: Routing | None = None
    """The trainer's own routing record of this forward (MoE only)."""


@contextmanager
def _timed(times: dict[str, float], key: str):
    """Add the block's wall-clock seconds to ``times[key]``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        times[key] = times.get(key, 0.0) + time.perf_counter() - t


class RLRun:
    """State that lives across steps: model, optimizer, scheduler, injector, RNGs, counters."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False,
                 progress: Progress | None = None):
        task = validate(cfg)
        self.cfg = cfg
        self.rundir = RunDir(run_dir)
        self.progress = progress
        self.world = dist_utils.World.from_env(cfg.run.device)
        if cfg.rollout.prompts_per_step < self.world.size:
            raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} is fewer than the "
                              f"{self.world.size} data-parallel processes: each needs at least one prompt")
        self.device = self.world.device
        self.log: MetricsLog | None = None
        self._wrote_config = False
        self._status_time = 0.0
        created = not self.rundir.path.exists()
        if self.world.is_main:
            self.rundir.lock()  # one process per run directory, for the life of the run
        try:
            self._setup(resume, task)
        except BaseException:
            if self._wrote_config and not self.rundir.has_steps():
                self.rundir.config.unlink()  # ours, from this start: a retry is a fresh start, not a resume
            self.close()
            if self.world.is_main:
                self.rundir.remove_if_unused(created=created)  # no folder holding only run.lock
            raise

    def _setup(self, resume: bool, task: Task) -> None:
        cfg, progress = self.cfg, self.progress
        self._prepare_dir(resume)

        self.task = task
        self.train_set, self.val_set = make_splits(
            self.task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val
        )
        warm = ensure_warm_start(cfg, progress=(lambda s, n, m: progress("pretrain", s, n, m)) if progress else None)
        self.model_dir = Path(warm.path)
        self.tok, self.precision = load_policy(self.model_dir, cfg, device=self.device)
        self.model = self.precision.compute  # the trainer's forward, shared with the exact engine
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:  # frozen copy of the starting policy for the KL penalty
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        c = cfg.optim
        self.optimizer = adamw(self.precision.master.parameters(), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                               weight_decay=c.weight_decay)
        self.scheduler = scheduler_from_config(self.optimizer, cfg.scheduler, total_steps=cfg.run.steps)
        self.injector = build_injector(cfg.mismatch, self.model, default_engine=cfg.rollout.engine,
                                       eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id,
                                       tokenizer=self.tok)
        self.eval_engine = build_engine("exact", self.model, eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id)
        r = cfg.rollout
        use_loop(loop_for(r.decode_loop, engine=r.engine, sync_every=r.sync_every),
                 self.injector.engine, self.injector.base_engine, self.eval_engine)
        self.sampling = rollout_sampling(cfg)
        mcfg = self.model.config
        self.sparse_layers = [i for i in range(mcfg.num_hidden_layers) if mcfg.is_sparse(i)]
        self.record_routing = bool(self.sparse_layers) and self.injector.engine.records_routing
        if cfg.correction.router_replay and not self.record_routing:
            raise UsageError(
                "correction.router_replay needs a mixture-of-experts model (model_type qwen3_moe) and a rollout "
                f"engine that records routing (exact, fast); here model_type={mcfg.model_type!r}, rollout "
                f"engine {self.injector.engine_name!r}")

        seed = cfg.run.seed
        self.prompt_rng = random.Random(seed)
        # on the model's device: torch.multinomial needs a generator of the device it samples on
        self.rollout_gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + 17 + self.world.rank)
        torch.manual_seed(seed)
        self.step = 0
        self.grad_norm_ema: float | None = None
        self.peak_val = float("-inf")
        self.persistence = PersistenceTracker(self.model.config.vocab_size)
        self.alarm = self._build_alarm()
        self.log = MetricsLog(self.rundir.path, tensorboard=cfg.run.tensorboard and self.world.is_main) if self.world.is_main else None
        if resume:
            self._resume()

    # ---------------------------------------------------------------------------- setup
    def _prepare_dir(self, resume: bool) -> None:
        d = self.rundir
        d.check_not_file()
        if resume:
            if not d.config.exists():
                raise FileNotFoundError(f"--resume: {d.path} is not a run directory (no config.yaml)")
            return
        if self.world.is_main:  # the other ranks would see the config.yaml rank 0 has just written
            if d.has_run():
                raise UsageError(f"run directory {d.path} already holds a run; pass --resume to continue it "
                                 "or choose a new --run-dir")
            d.check_fresh()  # no status, metrics or distributions file this run did not write
            d.path.mkdir(parents=True, exist_ok=True)
            atomic_write_text(d.config, self.cfg.to_yaml())
            self._wrote_config = True
        self.world.barrier()

    def _usable_checkpoint(self) -> tuple[Path | None, dict | None, torch.nn.Module | None]:
        """The newest checkpoint that verifies and loads, with its state and weights; each one
        passed over is named in a warning. (None, None, None): none, resume from the warm start."""
        skipped = []
        for ckpt in checkpoints_newest_first(self.rundir.checkpoints):
            problem = verify_checkpoint(ckpt)
            if problem is None:
                try:
                    return ckpt, load_state(ckpt), load_model(ckpt, dtype="float32", device=self.device)
                except (TimlabError, OSError) as e:  # load_model and load_state name the file in one line
                    problem = one_line(e)
            skipped.append(ckpt.name)
            warnings.warn(f"checkpoint {ckpt} is unusable ({problem}); falling back to an older one", stacklevel=2)
        if skipped:
            warnings.warn(f"no usable checkpoint in {self.rundir.checkpoints}: resuming from step 0 (the warm start)",
                          stacklevel=2)
        return None, None, None

    def _resume(self) -> None:
        ckpt, state, resumed = self._usable_checkpoint()
        if ckpt is None:  # killed before the first checkpoint: start over from the warm start
            if self.log is not None:
                self.log.load(-1)
            return
        self.precision.load_master(resumed.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.injector.load_state_dict(state["injector"])
        self.precision.load_state_dict(state.get("precision", {}))
        self.prompt_rng.setstate(state["prompt_rng"])
        self.rollout_gen.set_state(state["rollout_gen"][self.world.rank])
        torch.set_rng_state(state["torch_rng"])
        self._check_resume_config(ckpt, state.get("config"))
        if (note := resume_note(state.get("machine"))) is not None:
            warnings.warn(f"{ckpt}: {note}", stacklevel=2)
        self.step = state["step"]
        self.grad_norm_ema = state["grad_norm_ema"]
        self.peak_val = state["peak_val"]
        if state.get("persistence") is not None:  # checkpoints before it start its statistics afresh
            self.persistence.load_state_dict(state["persistence"])
        saved_alarm = state.get("alarm")
        if self.alarm is not None and saved_alarm and saved_alarm["setting"] == self._alarm_setting():
            self.alarm.load_state_dict(saved_alarm["watch"])  # the same alarm: it goes on; another starts afresh
        self.injector.refresh()
        if self.log is not None:
            self.log.load(self.step)

    def _check_resume_config(self, ckpt: Path, saved: dict | None) -> None:
        """A resume continues the checkpoint's config: any edit (of config.yaml or by --set)
        other than ``RESUME_OVERRIDES`` is refused, as is a new run.steps under a schedule laid
        out over the run's length. An allowed change is recorded in config.yaml."""
        if not isinstance(saved, dict):
            return  # a checkpoint from before timlab recorded its config
        changes = resume_config_changes(saved, self.cfg)
        if changes:
            more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
            raise ConfigError(f"--resume: the config differs from the one {ckpt} was trained with at {changes[0]}{more}; "
                              "restore config.yaml or start a new run")
        old_steps = flatten(saved).get("run.steps")
        if old_steps != self.cfg.run.steps and "total_steps" in SCHEDULERS.get(self.cfg.scheduler.name).config_kwargs(
                self.cfg.scheduler, total_steps=1):
            raise ConfigError(f"--resume: run.steps {old_steps} -> {self.cfg.run.steps}: the {self.cfg.scheduler.name} "
                              f"LR schedule was laid out over {old_steps} steps and cannot be stretched; start a new run")
        if self.world.is_main and self.rundir.config.read_text(encoding="utf-8") != self.cfg.to_yaml():
            atomic_write_text(self.rundir.config, self.cfg.to_yaml())  # e.g. the new run.steps

    def _trainer_state(self) -> dict:
        return {
            "config": self.cfg.to_dict(),
            "machine": describe_machine(),
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "injector": self.injector.state_dict(),
            "precision": self.precision.state_dict(),
            "prompt_rng": self.prompt_rng.getstate(),
            "rollout_gen": self.world.gather_objects(self.rollout_gen.get_state()),
            "torch_rng": torch.get_rng_state(),
            "grad_norm_ema": self.grad_norm_ema,
            "peak_val": self.peak_val,
            "persistence": self.persistence.state_dict(),
            "alarm": {"setting": self._alarm_setting(), "watch": self.alarm.state_dict()} if self.alarm else None,
        }

    def checkpoint(self) -> Path | None:
        state = self._trainer_state()  # collective: every rank takes part
        if not self.world.is_main:
            return None
        return save_checkpoint(self.rundir.checkpoints, self.step, self.precision.master, str(self.model_dir),
                               state, keep=self.cfg.run.keep_checkpoints)

    # ---------------------------------------------------------------------------- one step
    def _draw_prompts(self):
        k = self.cfg.rollout.prompts_per_step
        examples = [self.train_set[self.prompt_rng.randrange(len(self.train_set))] for _ in range(k)]
        mine = examples[self.world.rank :: self.world.size]  # data parallel: this rank's shard
        return mine

    def train_step(self) -> StepOutput:
        """One RL step: rollout -> score -> metrics -> correction -> loss + update -> step metrics."""
        cfg = self.cfg
        self.step += 1
        self.injector.begin_step(self.step)  # the mismatch schedule; before start_step no part acts
        gc = cfg.run.gradcheck_every
        grad_metrics = self.gradient_check() if gc and self.step % gc == 0 and self.world.is_main else {}
        times: dict[str, float] = {}
        with _timed(times, "train/step_time_s"):
            with _timed(times, "time/rollout_s"):
                examples, rollout = self._rollout()
            G = cfg.rollout.samples_per_prompt
            rewards = rollout_rewards(self.task, self.tok, examples, rollout, dense=cfg.task.dense_reward).view(-1, G)  # (N, G)
            adv = ADVANTAGES.get(cfg.algorithm.name)(rewards).reshape(-1).to(self.device)  # (B,) one per sequence
            with _timed(times, "time/train_s"):
                scored = self._score(rollout)
                with _timed(times, "time/metrics_s"):
                    metrics, dists = self._mismatch_metrics(scored, adv)
                self.injector.observe(self.world.weighted_mean(metrics["rollout_corr/k3_kl"], float(scored.mask.sum())))
                weights, keep_tokens = self._correct(scored, metrics)
                keep = informative_groups(rewards) if cfg.algorithm.reject_equal_groups else torch.ones(rewards.shape[0], dtype=torch.bool)
                loss_metrics, grad_norm, updated = self._update(self._loss_batch(scored, adv, keep, weights, keep_tokens))
                metrics.update(loss_metrics)
                lengths = rollout.lengths.float()
                mean_len = self.world.weighted_mean(float(lengths.mean()), lengths.numel())
                lr_used = self.optimizer.param_groups[0]["lr"]
                self.scheduler.step(response_length=mean_len)
                self.injector.refresh()
            times["time/train_s"] -= times["time/metrics_s"]
        metrics.update(self._step_metrics(rollout, rewards, keep, scored, grad_norm=grad_norm, mean_len=mean_len,
                                          lr_used=lr_used, updated=updated, times=times))
        metrics.update(grad_metrics)
        metrics.update(self.scheduler.metrics())
        metrics.update(self.injector.metrics())
        if self.alarm is not None:
            metrics.update(self._alarm_metrics(metrics))
        return StepOutput(metrics, dists)

    # 1. rollout ------------------------------------------------------------------------
    def _rollout(self) -> tuple[list, Rollout]:
        """This rank's prompts, each ``samples_per_prompt`` times, through the rollout engine with the
        mismatch injector. Returns (one example per sequence, the rollout)."""
        cfg = self.cfg
        G = cfg.rollout.samples_per_prompt
        examples = [e for e in self._draw_prompts() for _ in range(G)]  # one per sequence, G per prompt
        prompts = [self.task.encode_prompt(self.tok, e) for e in examples]
        try:
            rollout = self.injector.rollout(prompts, max_new_tokens=cfg.rollout.max_new_tokens,
                                            sampling=self.sampling, generator=self.rollout_gen,
                                            record_routing=self.record_routing)
        except NonFiniteLogitsError:
            raise NonFiniteError(f"step {self.step}: non-finite values in the rollout logits") from None
        return examples, rollout

    # 2. score: the trainer's forward, autograd on ---------------------------------------
    def _score(self, rollout: Rollout) -> _Scored:
        """The trainer's log-probs of the rollout's tokens (autograd on when one update uses them),
        checked finite and, in the zero-mismatch setting, bitwise equal to the rollout's."""
        cfg = self.cfg
        # Score only the realized columns L <= S; the exact attention pads its keys back to S.
        S = rollout.tokens.shape[1]
        L = rollout.prompt_width + max(1, int(rollout.lengths.max()))
        mask = rollout.response_mask[:, :L].to(self.device)  # (B, L)
        tokens, key_valid = rollout.tokens[:, :L].to(self.device), rollout.key_valid[:, :L].to(self.device)
        single_update = cfg.algorithm.epochs == 1 and cfg.algorithm.mini_batches == 1
        experts = None if rollout.experts is None else rollout.experts[:, :, :L].to(self.device)  # (L_sparse, B, L, k)
        replay = experts if cfg.correction.router_replay else None
        routing = self._routing(replay, slice(None)) if experts is not None else None  # records the trainer's experts
        logp = None
        if single_update:
            logp, entropy = token_logprobs(self.model, tokens, key_valid, mode="exact", with_entropy=True, kv_len=S,
                                           score_mask=mask, routing=routing)
            old_logp = logp.detach()
        else:
            with torch.no_grad():
                old_logp, entropy = token_logprobs(self.model, tokens, key_valid, mode="exact", with_entropy=True,
                                                   kv_len=S, score_mask=mask, routing=routing)
        self._check_finite("trainer log-probs", old_logp[mask])
        rollout_logp = rollout.logprobs[:, :L].to(self.device)
        if cfg.run.guard and cfg.rollout.engine == "exact" and self.injector.off:  # the trainer's own model rolled out
            self._guard(old_logp, rollout_logp, mask, rollout.prompt_width)
        return _Scored(tokens, key_valid, mask, old_logp, rollout_logp, entropy, kv_len=S, logp=logp,
                       experts=experts, replay=replay, routing=routing)

    # 3. metrics --------------------------------------------------------------------------
    def _mismatch_metrics(self, scored: _Scored, adv: torch.Tensor) -> tuple[dict, dict | None]:
        """rollout_corr/* and mismatch/* on (log pi_old, log mu), with the harm statistics of the
        advantages ``adv`` (B,) and the trainer's token entropies, and on distribution steps the
        histograms and breakdowns that go to distributions.jsonl."""
        cfg = self.cfg
        old_logp, rollout_logp, mask = scored.old_logp, scored.rollout_logp, scored.mask
        maskf = mask.float()
        metrics = all_metrics(old_logp, rollout_logp, maskf, num_micro_batches=max(1, cfg.algorithm.mini_batches))
        metrics.update(harm_metrics(old_logp, rollout_logp, maskf, advantages=adv, entropy=scored.entropy.detach()))
        metrics.update(self.persistence.update(old_logp, rollout_logp, maskf, scored.tokens))
        dists = None
        if cfg.run.distributions_every and self.step % cfg.run.distributions_every == 0 and self.log is not None:
            dists = {
                "histogram": ratio_histogram(old_logp, rollout_logp, maskf),
                "by_position": mismatch_by_position(old_logp, rollout_logp, maskf),
                "by_prob": mismatch_by_prob_bucket(old_logp, rollout_logp, maskf),
                "by_length": mismatch_by_length(old_logp, rollout_logp, maskf),
            }
        if scored.routing is not None:
            flips = self._routing_metrics(scored.experts, scored.routing, old_logp, rollout_logp, mask)
            if dists is not None:
                dists["router_flip_frac_by_layer"] = flips.pop("router_flip_frac_by_layer")
            metrics.update({k: v for k, v in flips.items() if k.startswith("mismatch/")})
        return metrics, dists

    # 4. correction -----------------------------------------------------------------------
    def _correct(self, scored: _Scored, metrics: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """IS weights and rejection sampling (their metrics go into ``metrics``). Returns (the
        weights (B, L), the response tokens rejection keeps (B, L) float)."""
        c = self.cfg.correction
        maskf = scored.mask.float()
        weights, is_metrics = is_weights(
            scored.old_logp, scored.rollout_logp, maskf, level=c.level, mode=c.mode, threshold=c.threshold,
            threshold_low=c.threshold_low if c.mode == "two_sided" else None,
            veto_threshold=c.veto_threshold or None, batch_normalize=c.batch_normalize,
        )
        metrics.update(is_metrics)
        keep_tokens = maskf
        if c.rs:
            keep_tokens, rs_metrics = rejection_mask(scored.old_logp, scored.rollout_logp, maskf, rules=c.rs,
                                                     thresholds=c.rs_threshold)
            metrics.update(rs_metrics)
        return weights, keep_tokens

    # 5. loss -------------------------------------------------------------------------------
    def _loss_batch(self, scored: _Scored, adv: torch.Tensor, keep: torch.Tensor, weights: torch.Tensor,
                    keep_tokens: torch.Tensor) -> UpdateBatch:
        """The update's inputs: the advantages ``adv`` (B,), the loss mask of the kept groups' (``keep``
        (N,)) kept tokens, the IS weights the loss uses, pi_old and the reference policy's log-probs."""
        c = self.cfg.correction
        seq_keep = keep.repeat_interleave(adv.shape[0] // keep.shape[0]).to(self.device)  # (B,)
        loss_mask = keep_tokens * seq_keep[:, None].float()
        use_weights = None if c.mode == "none" and not c.veto_threshold else weights
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp, _ = token_logprobs(self.ref_model, scored.tokens, scored.key_valid, mode="exact",
                                             kv_len=scored.kv_len, score_mask=scored.mask)
        anchor_logp = scored.rollout_logp.to(scored.old_logp.dtype) if c.bypass_mode else scored.old_logp  # pi_old of the loss
        return UpdateBatch(scored.tokens, scored.key_valid, anchor_logp, adv, loss_mask, kv_len=scored.kv_len,
                           logp=scored.logp, is_weights=use_weights, ref_logp=ref_logp, experts=scored.replay)

    # logging ---------------------------------------------------------------------------------
    def _step_metrics(self, rollout: Rollout, rewards: torch.Tensor, keep: torch.Tensor, scored: _Scored, *,
                      grad_norm: float, mean_len: float, lr_used: float, updated: bool, times: dict) -> dict:
        """train/* and time/* of the step (and the grad-norm EMA it updates)."""
        ema = self.cfg.run.grad_norm_ema
        if math.isfinite(grad_norm):
            self.grad_norm_ema = grad_norm if self.grad_norm_ema is None else ema * self.grad_norm_ema + (1 - ema) * grad_norm
        maskf = scored.mask.float()
        ent = float((scored.entropy * maskf).sum() / maskf.sum().clamp(min=1))
        lengths = rollout.lengths.float()
        step_time = times["train/step_time_s"]
        return {
            "step": self.step,
            "train/reward_mean": self.world.weighted_mean(float(rewards.mean()), rewards.numel()),
            "train/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "train/response_length_mean": mean_len,
            "train/response_length_max": float(lengths.max()),
            "train/response_length_p90": float(torch.quantile(lengths, 0.9)),
            "train/finished_frac": float(rollout.finished.float().mean()),
            "train/entropy": ent,
            "train/grad_norm": grad_norm,
            "train/grad_norm_ema": self.grad_norm_ema if self.grad_norm_ema is not None else float("nan"),
            "train/lr": lr_used,
            "train/groups_kept_frac": float(keep.float().mean()),
            "train/updated": float(updated),
            "train/tokens_per_s": rollout.num_tokens / max(step_time, 1e-9),
            **times,
        }

    # the early-warning alarm (run.alarm) -------------------------------------------------------
    def _alarm_setting(self) -> list:
        c = self.cfg.run
        return [c.alarm, c.alarm_threshold, c.alarm_armed_at]

    def _build_alarm(self) -> AlarmWatch | None:
        if self.cfg.run.alarm == "off":
            return None
        rule = ALARMS.get(self.cfg.run.alarm)
        return AlarmWatch(rule=rule.rule, direction=rule.direction,
                          threshold=self.cfg.run.alarm_threshold or rule.threshold)

    def _alarm_metrics(self, metrics: dict) -> dict:
        """alarm/* of the step: the alarm watches the run's indicator once an evaluation before this
        step reached run.alarm_armed_at, and warns the first time its statistic exceeds the threshold;
        a step that updated nothing (train/updated 0, or train/grad_norm exactly 0) is skipped."""
        c = self.cfg.run
        rule = ALARMS.get(c.alarm)
        if c.alarm_armed_at > 0 and not self.peak_val >= c.alarm_armed_at:
            return {"alarm/above_threshold": 0.0, "alarm/statistic": float("nan")}
        first = self.alarm.fired_step is None
        stat, above = self.alarm.update(float(metrics.get(rule.indicator, float("nan"))), step=self.step,
                                        grad_norm=metrics["train/grad_norm"], updated=metrics["train/updated"] != 0)
        if above and first and self.world.is_main:
            shown = f"{stat:.3g}x its level over the 10 steps before" if rule.rule == "change" else f"{stat:.3g}"
            warnings.warn(f"step {self.step}: early-warning alarm {c.alarm}: {rule.indicator} at {shown} (threshold "
                          f"{self.alarm.threshold:.3g}); {EXPERIMENTAL}",
                          stacklevel=2)
        return {"alarm/above_threshold": float(above), "alarm/statistic": stat}

    def gradient_check(self) -> dict:
        """gradcheck at the current weights against this run's injector (own seeds: the run's
        trajectory is the same with or without it). Returns gradcheck/* metrics and its cost."""
        cfg = self.cfg
        times: dict[str, float] = {}
        with _timed(times, "time/gradcheck_s"):
            res = gradcheck(
                self.model, self.tok, self.task, self.train_set, self.injector, exact_engine=self.eval_engine,
                samples=cfg.run.gradcheck_samples, micro_batch=gradcheck_in_run.micro_batch(cfg),
                estimator=cfg.run.gradcheck_estimator, group_size=cfg.rollout.samples_per_prompt,
                max_new_tokens=cfg.rollout.max_new_tokens, sampling=self.sampling, dense_reward=cfg.task.dense_reward,
                score_seqs=0, n_boot=200, seed=cfg.run.seed * 1_000_003 + self.step,
            )
            out = gradcheck_in_run.run_metrics(res)
        return {**out, **times}

    def _routing(self, replay: torch.Tensor | None, rows: slice) -> Routing:
        """A routing record for the trainer's forward on sequences ``rows``, forcing the rollout's
        experts ``replay`` (L_sparse, B, L, k) when given (router replay)."""
        return Routing(forced={} if replay is None else replay_experts(replay, self.sparse_layers, rows))

    def _routing_metrics(self, experts: torch.Tensor, routing: Routing, trainer_logp: torch.Tensor,
                         rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
        """Router flips between the rollout's experts and the trainer's routers' own choices, at
        the positions that produce response tokens (``timlab.metrics.routing_metrics``)."""
        pred = torch.zeros_like(mask)  # (B, L): column c predicts a response token
        pred[:, :-1] = mask[:, 1:]
        abs_diff = torch.zeros_like(trainer_logp, dtype=torch.float64)
        abs_diff[:, :-1] = (trainer_logp.double() - rollout_logp.double()).abs()[:, 1:]  # |r| of the predicted token
        own = torch.stack([routing.chosen[i] for i in self.sparse_layers])  # (L_sparse, B, L, k)
        return routing_metrics(experts, own, pred, abs_diff, layers=self.sparse_layers)

    def _guard(self, trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, prompt_width: int) -> None:
        """Stop at the first bit of difference between the trainer's and the rollout's log-probs."""
        diff = (trainer_logp != rollout_logp) & mask
        if diff.any():
            b, t = (int(i) for i in diff.nonzero()[0])
            n = int(diff.sum())
            raise ZeroMismatchViolation(
                f"zero-mismatch guard: step {self.step}, rank {self.world.rank}, sequence {b}, response token "
                f"{t - prompt_width} (grid column {t}): trainer log-prob {trainer_logp[b, t].item()!r} != rollout "
                f"{rollout_logp[b, t].item()!r} ({n} token(s) differ)"
            )

    def _check_finite(self, name: str, t: torch.Tensor) -> None:
        if not torch.isfinite(t).all():
            raise NonFiniteError(f"step {self.step}: non-finite values in {name}")

    def _update(self, batch: UpdateBatch) -> tuple[dict, float, bool]:
        """Epochs x mini-batches of PPO updates. Returns (metrics, last grad norm, whether any update ran)."""
        a = self.cfg.algorithm
        tokens, key_valid, logp, loss_mask, is_w, ref_logp = (batch.tokens, batch.key_valid, batch.logp, batch.loss_mask,
                                                              batch.is_weights, batch.ref_logp)
        B = tokens.shape[0]
        total_tokens = self.world.sum(float(loss_mask.sum()))
        if total_tokens == 0:
            return {"train/loss": 0.0}, 0.0, False
        per = B // a.mini_batches
        out: dict = {}
        grad_norm = 0.0
        for _ in range(a.epochs):
            for mb in range(a.mini_batches):
                rows = slice(mb * per, (mb + 1) * per)
                if logp is not None:
                    lp = logp[rows]
                else:
                    routing = None if batch.experts is None else self._routing(batch.experts, rows)
                    lp, _ = token_logprobs(self.model, tokens[rows], key_valid[rows], mode="exact", kv_len=batch.kv_len,
                                           score_mask=loss_mask[rows] > 0, routing=routing)
                mb_tokens = self.world.sum(float(loss_mask[rows].sum()))
                denom = mb_tokens if a.loss_agg == "token_mean" else self.world.sum(float((loss_mask[rows].sum(-1) > 0).sum()))
                loss, m = POLICY_LOSSES[a.loss_type](
                    lp, batch.old_logp[rows], batch.advantages[rows], loss_mask[rows], clip_low=a.clip_low, clip_high=a.clip_high,
                    loss_agg=a.loss_agg, is_weights=None if is_w is None else is_w[rows],
                    kl_coef=a.kl_coef, ref_logp=None if ref_logp is None else ref_logp[rows], denom=max(denom, 1.0),
                )
                self._check_finite("loss", loss.detach())
                grad_norm = self._optimizer_step(loss)
                out = {**m, "train/loss": loss.item()}
        return out, grad_norm, True

    def _optimizer_step(self, loss: torch.Tensor) -> float:
        """One update of the master weights, in cleanrl's order: zero_grad, backward, all-reduce,
        unscale, clip, step; ``Precision`` supplies the loss scale and the master / compute
        copies. Returns the global gradient norm before clipping."""
        precision, optimizer = self.precision, self.optimizer
        precision.zero_grad(optimizer)
        precision.scale_loss(loss).backward()
        params = precision.master_grads()
        self.world.all_reduce_grads(params)
        precision.unscale_(params)
        clip = self.cfg.optim.grad_clip
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
        if not math.isfinite(grad_norm):
            if precision.skip_overflow(optimizer):  # fp16: the loss scale overflowed; skip this update
                return grad_norm
            raise NonFiniteError(f"step {self.step}: non-finite values in gradients")
        optimizer.step()
        precision.after_step()
        return grad_norm

    # ---------------------------------------------------------------------------- eval + loop
    def evaluate(self) -> dict:
        times: dict[str, float] = {}
        with _timed(times, "time/eval_s"):
            shard = self.val_set[self.world.rank :: self.world.size]
            try:
                acc, mean_len = greedy_accuracy(self.model, self.tok, self.task, shard, engine=self.eval_engine,
                                                max_new_tokens=self.cfg.rollout.max_new_tokens)
            except NonFiniteLogitsError:
                raise NonFiniteError(f"step {self.step}: non-finite values in the logits of the validation decode") from None
            gold = gold_logprob(self.model, self.tok, self.task, shard)
            acc = self.world.weighted_mean(acc, len(shard))
            self.peak_val = max(self.peak_val, acc)
        return {"val/accuracy": acc, "val/response_length_mean": self.world.weighted_mean(mean_len, len(shard)),
                "val/peak_accuracy": self.peak_val, "val/gold_logprob": self.world.weighted_mean(gold, len(shard)),
                **times}

    def log_samples(self) -> None:
        """``run.log_samples`` greedy validation replies of this step, to samples.jsonl (rank 0)."""
        n = self.cfg.run.log_samples
        if n and self.log is not None:
            self.log.append_samples(self.step, greedy_replies(self.model, self.tok, self.task, self.val_set[:n],
                                                              engine=self.eval_engine,
                                                              max_new_tokens=self.cfg.rollout.max_new_tokens))

    def write_status(self, state: str, message: str = "", *, durable: bool = True) -> None:
        self._status_time = time.monotonic()
        if self.world.is_main:
            self.rundir.write_status(state, step=self.step, total_steps=self.cfg.run.steps, message=message,
                                     durable=durable)

    def close(self) -> None:
        """Close the metrics log and release the run directory's lock (idempotent)."""
        if self.log is not None:
            self.log.close()
        self.rundir.unlock()

    def run(self) -> dict:
        """Train until run.steps; metrics every step, eval and checkpoints on schedule. Returns
        the last logged row (an earlier session's when the run had already finished)."""
        cfg = self.cfg.run
        last: dict = dict(self.log.rows[-1]) if self.log is not None and self.log.rows else {}
        try:
            self.write_status(RUNNING)
            if self.step == 0:
                row = {"step": 0, **self.evaluate()}
                self.log_samples()
                if self.log is not None:
                    self.log.append(row)
            while self.step < cfg.steps:
                out = self.train_step()
                row = out.metrics
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    row.update(self.evaluate())
                    self.log_samples()
                if self.log is not None:
                    self.log.append(row)
                    if out.distributions is not None:
                        self.log.append_distribution(self.step, out.distributions)
                saved = self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps
                if saved:
                    self.checkpoint()
                if self.step < cfg.steps and (saved or time.monotonic() - self._status_time >= STATUS_EVERY_S):
                    self.write_status(RUNNING, durable=False)  # where the run is (not fsynced: a progress note)
                last = row
                if self.progress is not None:
                    self.progress("train", self.step, cfg.steps, row)
            self.write_status(FINISHED, self.injector.note())  # e.g. the k3 controller's target not reached
        except (NonFiniteError, ZeroMismatchViolation) as e:
            self.write_status(DIVERGED if isinstance(e, NonFiniteError) else GUARD_FAILED, str(e))
            raise
        except BaseException as e:
            if isinstance(e, Exception) and is_disk_full(e):
                full = disk_full(self.rundir.path)
                self.write_status(FAILED, f"{type(full).__name__}: {one_line(full)}")
                raise full from None
            why = one_line(e) if str(e) else "interrupted"
            self.write_status(FAILED, f"{type(e).__name__}: {why}")
            raise
        finally:
            self.close()
        return last


def train(cfg: Config, run_dir: str | Path, *, resume: bool = False, progress=None) -> dict:
    """Build and run an RLRun (the library entry point behind ``timlab train``)."""
    with dist_utils.maybe_init_process_group(cfg.run.device):
        run = RLRun(cfg, run_dir, resume=resume, progress=progress)
        try:
            return run.run()
        finally:
            run.close()

