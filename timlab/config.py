"""Run configuration: frozen dataclasses, one section per concern.

Each field's default and its help text live here and nowhere else. YAML files, presets and
``--set section.key=value`` overrides are validated against these dataclasses: an unknown
section or key, or a value of the wrong type, is a one-line error naming the key and the valid
choices. Every value is checked here, before any work: floats must be finite (a NaN dose would
end a run as "diverged"), integers whole and within ``INT_RANGES`` (seeds fit a torch seed,
counts stay below 10^9), booleans booleans, and each section's ``__post_init__`` checks its own
ranges (run.steps >= 1, optim.lr > 0, ...), ``Config``'s those that span sections. YAML is read by ``timlab.yaml_io`` (duplicate
keys and alias bombs refused). ``resolve(...)`` merges, in order: defaults < preset < YAML file < ``--set``.
``validate(cfg)`` checks the rest before anything runs (the trainer, a sweep's expansion and
gradcheck call it): the names that pick a registered component (task, engine, injector, IS mode,
scheduler, advantage estimator, ...) against their registries, which it imports on its first
call (so reading a config imports no torch), the device, the task's options and what the warm
start can be built with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from timlab.errors import TimlabError, UsageError, one_line
from timlab.yaml_io import load_yaml

if TYPE_CHECKING:
    from timlab.engines import SamplingParams
    from timlab.tasks import Task


def _at_least_one(section: str, values: Any, keys: tuple[str, ...]) -> None:
    """A section's range check (from its ``__post_init__``): ConfigError for the first of ``keys`` below 1."""
    for key in keys:
        value = getattr(values, key)
        if value < 1:
            raise ConfigError(f"{section}.{key} must be >= 1, got {value}")


@dataclass(frozen=True)
class ModelSection:
    path: str = ""
    """HF model folder to start RL from. Empty: the SFT warm-start model for the task (built by
    `timlab pretrain` with the settings below, cached by their hash)."""
    dtype: str = "float32"
    """Trainer precision (and the exact engine's): float32, bfloat16 or float16."""
    lm_head_fp32: bool = False
    """Compute the LM head in fp32 even when the body runs in bf16/fp16 (a precision remedy)."""
    model_type: str = "llama"
    """Architecture of the warm-start model: llama, qwen2, qwen3 or qwen3_moe (sparse MLPs, the
    num_experts fields below)."""
    hidden_size: int = 128
    """Warm-start model: width of the residual stream."""
    num_layers: int = 4
    """Warm-start model: decoder layers."""
    num_heads: int = 4
    """Warm-start model: attention (query) heads."""
    num_kv_heads: int = 2
    """Warm-start model: key/value heads (grouped-query attention; divides num_heads)."""
    intermediate_size: int = 384
    """Warm-start model: width of the MLP's hidden layer."""
    max_position_embeddings: int = 256
    """Warm-start model: the longest sequence (prompt + answer) it can take."""
    num_experts: int = 0
    """Warm-start model, qwen3_moe: experts in each layer's sparse MLP (0 = dense MLPs)."""
    num_experts_per_tok: int = 0
    """Warm-start model, qwen3_moe: experts each token is routed to (top k)."""
    moe_intermediate_size: int = 0
    """Warm-start model, qwen3_moe: each expert's SwiGLU width (intermediate_size stays the dense MLPs')."""
    norm_topk_prob: bool = True
    """Warm-start model, qwen3_moe: renormalize the top-k router probabilities to sum to 1
    (Qwen3-30B-A3B's setting)."""
    pretrain_steps: int = 400
    """SFT steps for the warm start (tuned so validation accuracy leaves room for RL)."""
    pretrain_batch: int = 64
    """SFT examples per step."""
    pretrain_lr: float = 3e-3
    """SFT learning rate (AdamW)."""
    pretrain_seed: int = 0
    """Seed of the SFT warm start (initial weights and batches)."""
    pretrain_init: str = ""
    """A local model folder (``timlab pretrain --out``, ``timlab export`` or transformers'
    ``save_pretrained``) whose weights the SFT warm start continues from instead of a random init:
    a curriculum, e.g. short answers first, then long ones. Its architecture and vocabulary must be
    the warm start's (this section's architecture fields and the task's alphabet); steps, batch, LR
    schedule and the batches' seed are as without it. The warm start's cache key holds the SHA-256
    of its weight files, not the path, so the folder must stay readable while a command looks that
    warm start up. Empty: random init."""


@dataclass(frozen=True)
class TaskSection:
    name: str = "reverse"
    """A registered task (the synthetic ones' prompt formats: docs/cli.md, "Prompt files"), or dataset
    (a local JSONL/Parquet/CSV file; needs model.path)."""
    kwargs: dict = field(default_factory=dict)
    """Task options, e.g. {min_len: 4, max_len: 24} (each task lists its own)."""
    dense_reward: bool = False
    """Partial-credit reward in [0, 1] instead of 0/1 exact match."""
    n_train: int = 20000
    """Prompts in the RL training pool."""
    n_val: int = 128
    """Prompts in the validation set (disjoint from the training pool). Drawn first, so changing
    it also changes which prompts train: an SFT warm start built with another n_val is another
    model (its cache key holds n_val)."""
    split_seed: int = 1234
    """Seed that draws the train and validation prompts."""


@dataclass(frozen=True)
class RolloutSection:
    engine: str = "exact"
    """Rollout engine: exact (bitwise equal to the trainer) or another of ``timlab.engines.ENGINES``."""
    prompts_per_step: int = 16
    """Prompts per RL step."""
    samples_per_prompt: int = 8
    """Responses sampled per prompt (the group size of grpo and rloo)."""
    max_new_tokens: int = 40
    """Longest response; a response that reaches it without EOS is cut there."""
    temperature: float = 1.0
    """Sampling temperature of the rollout."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability (1.0 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    decode_loop: str = "host"
    """How the native engines (exact, fast) run their decode loop, rollouts and evaluations alike:
    host (a host read every step; the fastest on a CPU), device (sampling, EOS and finished rows
    stay on the device, a host read every sync_every steps) or graphs (device, with the decode step
    replayed as CUDA graphs: 1.8-1.9x host on an H200 at batch 128-256, bench/RESULTS.md; run
    eagerly off CUDA). On the CPU all three give the same bits; on CUDA device and graphs sample
    other (equally random) tokens than host for a seed, with log-probs still equal to the trainer's."""
    sync_every: int = 8
    """decode_loop device or graphs: decode steps between host reads."""

    def __post_init__(self):
        _at_least_one("rollout", self, ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "sync_every"))


@dataclass(frozen=True)
class AlgorithmSection:
    name: str = "grpo"
    """Advantage estimator: grpo (group mean/std), rloo (leave-one-out), reinforce (group-mean baseline)."""
    clip_low: float = 0.2
    """PPO clip: the ratio pi/pi_old is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """PPO clip: the ratio pi/pi_old is clipped above at 1 + clip_high (DAPO's clip-higher)."""
    loss_agg: str = "token_mean"
    """token_mean (all valid tokens of the batch weigh the same) or seq_mean (mean per sequence, then over sequences)."""
    kl_coef: float = 0.0
    """k3 KL penalty to the frozen starting policy (GRPO's reference model); 0 = off, the seed papers' setting."""
    reject_equal_groups: bool = True
    """Drop groups whose rewards are all equal (they carry no advantage signal)."""
    epochs: int = 1
    """Passes over each rollout batch; 1 with mini_batches 1 is fully on-policy."""
    mini_batches: int = 1
    """Optimizer updates per epoch (the batch is split into this many mini-batches)."""
    loss_type: str = "ppo_clip"
    """Policy loss: ppo_clip (clipped surrogate of pi / pi_old) or reinforce (-A * w * log pi, no
    clipping; w = the IS weights when correction.mode is not none), verl's loss_type."""

    def __post_init__(self):
        _at_least_one("algorithm", self, ("epochs", "mini_batches"))


@dataclass(frozen=True)
class OptimSection:
    lr: float = 3e-5
    """AdamW learning rate: one at which the default preset's zero-mismatch control keeps its warm
    start's accuracy (at 3e-4 it collapses; the LR scan: bench/RESULTS.md). The presets set their own."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = no clipping)."""

    def __post_init__(self):
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"optim.lr must be a finite number > 0, got {self.lr}")


@dataclass(frozen=True)
class SchedulerSection:
    """The schedule picks the keys its ``__init__`` takes (``FactorLR.from_config``). The values
    below are the schedules' own defaults, kept here so a run's config.yaml records every value
    it used (tests/test_schedulers.py fails if they drift from ``LengthDecayLR`` and
    ``CosineWithFloorLR``); their meaning is documented there."""

    name: str = "constant"
    """LR schedule: constant, cosine (with a floor), length_decay (Beyond-Precision Algorithm 1)."""
    decay_period: int = 0
    """length_decay: halve the LR every P updates; 0 = automatic (P = surge_factor x surge step): the
    LR stays at optim.lr until a response-length surge is detected, so on a task whose answers do
    not surge it never changes (timlab train says so at the end of such a run)."""
    min_lr_ratio: float = 0.1
    """cosine, length_decay: the LR never goes below this fraction of optim.lr."""
    surge_factor: float = 1.8
    """length_decay, automatic mode: P = round(surge_factor x the surge step)."""
    surge_ratio: float = 2.0
    """Automatic mode: mean response length must grow this many times over its recent minimum."""
    surge_window: int = 10
    """Automatic mode: the rise must happen within this many updates."""
    warmup_steps: int = 0
    """cosine: linear warmup over this many updates."""


@dataclass(frozen=True)
class MismatchSection:
    injector: str = "none"
    """Rollout-side TIM: none, precision, engine, logit_noise, temperature, head_perturb,
    weight_rounding, fp8, kv_cache, stale, router_precision (MoE models); combine with '+', e.g.
    'precision+logit_noise'."""
    magnitude: float = 0.0
    """Size of the injected mismatch (std for logit_noise, T-1 for temperature, relative size for
    head_perturb, the lag k >= 1 in training steps for stale, log2 of an fp8 kv_cache's scale)."""
    dtype: str = "bfloat16"
    """precision / weight_rounding / kv_cache / router_precision: the rollout's dtype (bfloat16,
    float16; weight_rounding also int8; kv_cache also fp8 (e4m3) and fp8_e5m2; router_precision:
    the routers' logits only)."""
    scale_granularity: str = "per_tensor"
    """fp8: per_tensor (one scale per weight and per activation tensor) or per_channel (per output
    channel for weights, per token for activations)."""
    schedule: str = "constant"
    """How the magnitude moves over training steps: constant, linear or geometric (from magnitude at
    start_step to magnitude_end ramp_steps later, held after). stale rounds it half up."""
    start_step: int = 0
    """Steps before this one roll out exactly (k3 exactly 0, the guard holds); 0 = from the first step;
    with an injector, at most run.steps."""
    ramp_steps: int = 0
    """linear / geometric: steps the ramp from magnitude to magnitude_end takes (>= 1)."""
    magnitude_end: float = 0.0
    """linear / geometric: the magnitude at the end of the ramp."""
    engine: str = "fast"
    """engine injector: the rollout engine used instead (one of ``timlab.injectors.engine_swap.SWAP_ENGINES``)."""
    prob_below: float = 1.0
    """Scope: inject only on tokens whose trainer probability is below this (1.0 = everywhere)."""
    entropy_min: float = 0.0
    """Scope: inject only at decode steps whose unperturbed next-token entropy (nats) is at least
    this: the "decision" tokens (0 = no lower bound). logit_noise, temperature and head_perturb."""
    entropy_max: float = 0.0
    """Scope: inject only at decode steps whose unperturbed next-token entropy (nats) is below this:
    the near-deterministic tokens (0 = no upper bound). logit_noise, temperature and head_perturb."""
    position_min: int = 0
    """Scope: inject only at response tokens whose index (from 0) is at least this (0 = from the
    first). logit_noise, temperature and head_perturb; the other tokens are the trainer's, bit for bit."""
    position_max: int = 0
    """Scope: inject only at response tokens whose index (from 0) is below this (0 = no upper bound).
    logit_noise, temperature and head_perturb."""
    after_text: str = ""
    """Scope: inject only at decode steps whose response so far contains this text, one token of the
    model's vocabulary ('' = off): for scratch_add, ':' confines the mismatch to the worked answer
    after the restated operands. logit_noise, temperature and head_perturb."""
    before_text: str = ""
    """Scope: inject only at decode steps whose response so far does not yet contain this text (one
    token; '' = off): the complement of after_text, the marker's own step included. logit_noise,
    temperature and head_perturb."""
    seed: int = 0
    """Seed of the injector's own randomness (noise draws, the fixed head perturbation)."""
    redraw_every: int = 0
    """head_perturb: draw a new direction R every this many training steps (steps 1..n use the
    first, n+1..2n the next, ...; 1 = a fresh one every step); 0 = one R for the whole run, a
    persistent mismatch. Each draw comes from (seed, its index), so a resumed run draws the same.
    Holds the size and moves only how long the mismatch points one way."""
    target_k3: float = 0.0
    """> 0: hold the realized k3 at this target (0 = off): a feedback controller sets each step's
    magnitude from the k3 the previous step realized (timlab.injectors.controller); magnitude is the
    first step's value (0: 0.1), and the schedule moves the target (to target_k3_end) instead of the magnitude.
    Continuous parts only (head_perturb, kv_cache, logit_noise, temperature). The magnitude is capped at 100, where
    each part has saturated: a target k3 still above the realized k3 there is not reached, and the
    finished run's status says "target not reached"."""
    target_k3_end: float = 0.0
    """linear / geometric schedule with target_k3: the target at the end of the ramp."""
    target_gain: float = 0.5
    """target_k3: the controller's gain in (0, 1]; 0.5 halves the log error each step when k3 ~ magnitude^2."""
    target_max_change: float = 2.0
    """target_k3: the largest factor the magnitude may change by in one step (> 1)."""
    target_adapt: bool = False
    """target_k3: adapt the controller's step (Rprop): the largest step halves when a move it cut short
    overshot (the log error changed sign) and grows back 1.2x while the error keeps its sign, between
    2% and target_max_change. For sharp policies, whose k3 jumps by orders of magnitude within a
    factor 2 of magnitude and makes the fixed step oscillate; off keeps the law of earlier runs
    (timlab.injectors.controller)."""


@dataclass(frozen=True)
class CorrectionSection:
    level: str = "token"
    """IS ratio level: token, sequence, geometric."""
    mode: str = "none"
    """none, truncate (TIS), mask (MIS), two_sided (IcePop)."""
    threshold: float = 2.0
    """IS ratio cap C: truncate clips ratios at C, mask drops tokens or sequences above it,
    two_sided keeps [threshold_low, C]."""
    threshold_low: float = 0.5
    """two_sided: lower bound of the kept ratio band."""
    veto_threshold: float = 0.0
    """Drop a sequence if any token ratio is below this (0 = off; 1e-4 is the value common in other stacks)."""
    batch_normalize: bool = False
    """Self-normalized IS: divide the weights by their batch mean after truncation (verl's rollout_is_batch_normalize)."""
    rs: str = ""
    """Rejection sampling, verl's rollout_rs: comma-separated rules, all of which a token must pass
    (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3; timlab.remedies.rejection); empty = off."""
    rs_threshold: str = ""
    """verl's rollout_rs_threshold: one entry for all rules or one per rule, comma-separated; k1 rules
    take 'lo_hi' ratio bounds (or 'hi', lo = 1/hi), the others one upper bound, e.g. '0.5_2.0,0.01'."""
    bypass_mode: bool = False
    """verl's bypass mode: pi_old = pi_rollout, so the PPO ratio is pi / mu (with ppo_clip it is the
    correction itself, so IS weights must be off) and IS / RS compare pi with mu as usual."""
    router_replay: bool = False
    """MoE models: the trainer's forward uses the experts the rollout's routers chose (verl's R3);
    needs a rollout engine running timlab's model code (exact, fast)."""


@dataclass(frozen=True)
class RunSection:
    steps: int = 200
    """RL steps (updates) of the run; raise it with --resume --set run.steps=N to continue a finished run."""
    seed: int = 0
    """Seed of the run: prompt order, sampling and everything else random in the RL loop."""
    eval_every: int = 10
    """Validation (greedy decoding of the trainer's policy, no injector) every this many steps."""
    checkpoint_every: int = 25
    """Save a checkpoint every this many steps (and at the last step)."""
    keep_checkpoints: int = 2
    """Checkpoints kept: the newest this many (0 = keep all)."""
    device: str = "cpu"
    """cpu or cuda (cuda needs the Triton kernels: pip install 'timlab[gpu]')."""
    guard: bool = True
    """Zero-mismatch guard: in exact mode stop on any bit of difference between rollout and trainer."""
    grad_norm_ema: float = 0.9
    """Smoothing of train/grad_norm_ema."""
    tensorboard: bool = False
    """Also write TensorBoard event files (pip install 'timlab[tensorboard]')."""
    progress: bool = True
    """Show progress bars (the CLI's --quiet turns them off)."""
    distributions_every: int = 1
    """Write the per-step histogram of r and mismatch by position/probability bucket every N steps."""
    log_samples: int = 0
    """At each evaluation, write the greedy replies to the first N validation prompts to samples.jsonl
    in the run directory, one line each with the prompt, the reply, the reference answer and the
    reward (0 = off). The exact engine decodes each prompt alone as it does in the accuracy batch,
    so the replies are the ones val/accuracy scored, and no number of the run changes."""
    gradcheck_every: int = 0
    """Every N steps, before the rollout, compare the policy gradient under exact rollouts with the
    one under this run's injector (gradcheck/* metrics: cosine, relative bias, SNR); 0 = off."""
    gradcheck_samples: int = 64
    """Sequences per side for each in-run gradcheck (a multiple of 8, at least 64)."""
    gradcheck_estimator: str = "reinforce"
    """In-run gradcheck estimator: reinforce (w = R) or rloo (groups of rollout.samples_per_prompt)."""
    alarm: str = "off"
    """Early-warning alarm, EXPERIMENTAL: off, or a rule of timlab.metrics.alarm.ALARMS, e.g. grad_norm_change
    (the grad norm's mean over the last 5 steps against the 10 before, either way). No rule passed the
    re-registered benchmark (late falls, false alarms per 10,000 steps): grad_norm_change caught 2 of 19
    held-out falls there and raised ~26 false alarms per 10,000 steps (docs/metrics.md, "Early-warning alarm"). Logs
    alarm/above_threshold (0/1) and alarm/statistic each step and warns once, the first time it fires;
    a step that updated nothing (train/updated 0, or train/grad_norm exactly 0) is skipped."""
    alarm_threshold: float = 0.0
    """run.alarm: fire when the statistic exceeds this (a mean for a level rule, above 0; a fold change for
    a change rule, above 1); 0 = the threshold measured for the rule (ALARMS)."""
    alarm_armed_at: float = 0.5
    """run.alarm: watch only the steps after an evaluation reached this val/accuracy (as measured: the
    plateau rule's learned_at); 0 = from the first step."""

    def __post_init__(self):
        _at_least_one("run", self, ("steps", "eval_every", "checkpoint_every"))
        if self.gradcheck_every < 0:
            raise ConfigError(f"run.gradcheck_every must be >= 0, got {self.gradcheck_every}")
        if not 0 <= self.alarm_armed_at <= 1:
            raise ConfigError(f"run.alarm_armed_at must be in [0, 1] (a val/accuracy), got {self.alarm_armed_at}")
        if not (math.isfinite(self.alarm_threshold) and self.alarm_threshold >= 0):  # the rule's floor: validate()
            raise ConfigError(f"run.alarm_threshold must be 0 (the rule's measured threshold) or a positive number, "
                              f"got {self.alarm_threshold}")


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimSection = field(default_factory=OptimSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    mismatch: MismatchSection = field(default_factory=MismatchSection)
    correction: CorrectionSection = field(default_factory=CorrectionSection)
    run: RunSection = field(default_factory=RunSection)

    def __post_init__(self):
        """The ranges that span sections."""
        if self.rollout.samples_per_prompt < 2:
            raise ConfigError(f"rollout.samples_per_prompt=1 with algorithm.name={self.algorithm.name}: a group of one "
                              "sequence has zero advantage, so no step would update the policy; use 2 or more")
        if self.mismatch.injector != "none" and self.mismatch.start_step > self.run.steps:
            raise ConfigError(f"mismatch.start_step={self.mismatch.start_step} is after the run's last step "
                              f"(run.steps={self.run.steps}): mismatch.injector={self.mismatch.injector} would never act "
                              "and the run would be a control; set mismatch.start_step <= run.steps")
        n = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if n % self.algorithm.mini_batches:
            raise ConfigError(f"algorithm.mini_batches={self.algorithm.mini_batches} must divide the batch of {n} sequences")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_flat_dict(self) -> dict:
        """Every field under its dotted key (``task.kwargs.max_len``), as ``--set`` names it."""
        return flatten(self.to_dict())

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def hash(self, *sections: str) -> str:
        """Short stable hash of the given sections (all when none given). A field of
        ``UNHASHED_AT_DEFAULT`` left at its default is not hashed, so such a config keeps the hash it
        had before the field existed."""
        d = self.to_dict()
        for key, default in UNHASHED_AT_DEFAULT.items():
            section, name = key.split(".")
            if d[section][name] == default:
                del d[section][name]
        if sections:
            d = {s: d[s] for s in sections}
        return short_hash(d, 12)


UNHASHED_AT_DEFAULT: dict[str, Any] = {"mismatch.target_adapt": False, "mismatch.redraw_every": 0,
                                       "rollout.decode_loop": "host", "rollout.sync_every": 8}
"""Fields added after runs were committed, with the default that keeps the earlier behaviour:
``Config.hash`` leaves them out at that default."""


def short_hash(obj: Any, length: int) -> str:
    """The first ``length`` hex digits of the SHA-256 of ``obj`` as sorted-key JSON (values JSON
    cannot hold are written as ``str``): the one hash of configs and of a sweep run's overrides."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:length]


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested mapping as one level of dotted keys; an empty sub-mapping contributes nothing."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        elif not isinstance(v, dict):
            out[key] = v
    return out

PRESETS: dict[str, dict] = {
    "smoke": {
        "model": {"hidden_size": 48, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "intermediate_size": 96, "pretrain_steps": 400, "pretrain_batch": 32},
        "task": {"kwargs": {"min_len": 2, "max_len": 6}, "n_train": 500, "n_val": 16},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 10},
        "optim": {"lr": 3e-4},  # a plumbing check of 4 steps: a large LR makes every step move the weights
        "run": {"steps": 4, "eval_every": 2, "checkpoint_every": 2, "progress": False},
    },
    "default": {},
    # The demo's testbed (docs/claims.md): a 0.15M-parameter decoder reversing strings of
    # 3-14 characters (answers end in EOS), SFT to ~0.77 greedy accuracy, then GRPO at an LR where
    # the zero-mismatch control is stable (1e-4; at 3e-4 the control itself dips to 0.09).
    "demo": {
        "model": {"hidden_size": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
                  "intermediate_size": 192, "pretrain_steps": 350, "pretrain_batch": 64},
        "task": {"name": "reverse", "kwargs": {"min_len": 3, "max_len": 14}, "n_val": 128},
        "rollout": {"prompts_per_step": 16, "samples_per_prompt": 8, "max_new_tokens": 24},
        "optim": {"lr": 1e-4},
        "run": {"steps": 150, "eval_every": 10, "checkpoint_every": 50},
    },
    # The surge testbed: addition of up to 4-digit numbers, which the 0.15M-parameter SFT warm start
    # gets right 99% of the time when it works the sum out on a scratchpad and 33% of the time when
    # it answers tersely. SFT shows the scratchpad on 20% of examples, so the warm start samples it
    # ~19% of the time and answers tersely under greedy decoding. RL that learns to work it out
    # raises greedy accuracy (0.33 -> ~0.97) and makes answers ~2.4x longer: a response-length surge.
    "surge": {
        "model": {"hidden_size": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
                  "intermediate_size": 192, "pretrain_steps": 1500, "pretrain_batch": 64},
        "task": {"name": "scratch_add", "kwargs": {"max_digits": 4, "scratch_frac": 0.2}, "n_val": 128},
        "rollout": {"prompts_per_step": 16, "samples_per_prompt": 8, "max_new_tokens": 32},
        "optim": {"lr": 2e-4},
        # The surge here is gentler than the papers' (length ~10 -> ~20 over ~40 updates): a 1.5x
        # rise within 20 updates marks it (the detector's 2x-in-10 defaults never fire on it).
        "scheduler": {"surge_ratio": 1.5, "surge_window": 20},
        "run": {"steps": 150, "eval_every": 10, "checkpoint_every": 50},
    },
    # Beyond Precision's Table 1 settings, scaled to the tiny model: RLOO,
    # clip 0.2/0.28, wd 0.01, grad clip 1, fully on-policy, reject all-0/all-1 groups,
    # 16 rollouts per prompt, temperature 1, KL 0. LR and batch are scaled down for the tiny model.
    "beyond-precision": {
        "algorithm": {"name": "rloo", "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0,
                      "reject_equal_groups": True, "epochs": 1, "mini_batches": 1},
        "optim": {"weight_decay": 0.01, "grad_clip": 1.0},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 16, "temperature": 1.0},
        "scheduler": {"name": "length_decay", "decay_period": 0, "min_lr_ratio": 0.1},
        "correction": {"level": "token", "mode": "truncate", "threshold": 2.0},
    },
}


# The MoE surge testbed: the surge preset with a Qwen3-MoE policy whose active parameters match the
# dense surge policy's: each of the 3 layers routes every token to 2 of 8 SwiGLU experts of width 96
# (2 x 3 x 64 x 96 = the dense 3 x 64 x 192 MLP weights per token), plus a 64 x 8 router. With 3x
# the dense total parameters, 1500 SFT steps answer tersely at 0.90 and leave RL no room; 1000 steps
# give 0.77 terse and 1.00 worked out (bench/RESULTS.md). Routing flips are the mismatch a bf16
# rollout causes here (docs/FINDINGS.md, "MoE study").
PRESETS["surge_moe"] = {**PRESETS["surge"], "model": {
    **PRESETS["surge"]["model"], "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 96, "pretrain_steps": 1000}}


def _verl(is_level: str | None = None, is_threshold: float | str = 2.0, rs: str = "", rs_threshold: str = "",
          bypass: bool = False, loss: str = "ppo_clip") -> dict:
    """A verl ``RolloutCorrectionConfig`` factory's settings as timlab config sections."""
    corr: dict = {"level": "token", "mode": "none", "threshold": 2.0, "threshold_low": 0.5, "batch_normalize": False,
                  "rs": rs, "rs_threshold": rs_threshold, "bypass_mode": bypass}
    if is_level is not None:
        if isinstance(is_threshold, str):  # "lo_hi": IcePop
            lo, hi = is_threshold.split("_")
            corr.update(level=is_level, mode="two_sided", threshold=float(hi), threshold_low=float(lo))
        else:
            corr.update(level=is_level, mode="truncate", threshold=float(is_threshold))
    return {"correction": corr, "algorithm": {"loss_type": loss}}


_GEO, _K3 = ("seq_mean_k1", "0.999_1.001"), ("seq_mean_k3", "0.01")
VERL_PRESETS: dict[str, dict] = {
    "disabled": _verl(),
    "decoupled_token_is": _verl("token"),
    "decoupled_seq_is": _verl("sequence"),
    "decoupled_token_icepop": _verl("token", "0.5_5.0"),
    "decoupled_seq_is_rs": _verl("sequence", rs="seq_sum_k1", rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": _verl(None, rs=_GEO[0], rs_threshold=_GEO[1]),
    "decoupled_geo_rs_seq_tis": _verl("sequence", rs=_GEO[0], rs_threshold=_GEO[1]),
    "decoupled_geo_rs_token_tis": _verl("token", rs=_GEO[0], rs_threshold=_GEO[1]),
    "decoupled_k3_rs": _verl(None, rs=_K3[0], rs_threshold=_K3[1]),
    "decoupled_k3_rs_seq_tis": _verl("sequence", rs=_K3[0], rs_threshold=_K3[1]),
    "decoupled_k3_rs_token_tis": _verl("token", rs=_K3[0], rs_threshold=_K3[1]),
    "bypass_ppo_clip": _verl(bypass=True),
    "bypass_ppo_clip_geo_rs": _verl(None, rs=_GEO[0], rs_threshold=_GEO[1], bypass=True),
    "bypass_ppo_clip_k3_rs": _verl(None, rs=_K3[0], rs_threshold=_K3[1], bypass=True),
    "bypass_pg_is": _verl("sequence", bypass=True, loss="reinforce"),
    "bypass_pg_token_icepop": _verl("token", "0.5_5.0", bypass=True, loss="reinforce"),
    "bypass_pg_geo_rs": _verl(None, rs=_GEO[0], rs_threshold=_GEO[1], bypass=True, loss="reinforce"),
    "bypass_pg_geo_rs_seq_tis": _verl("sequence", rs=_GEO[0], rs_threshold=_GEO[1], bypass=True, loss="reinforce"),
    "bypass_pg_geo_rs_token_tis": _verl("token", rs=_GEO[0], rs_threshold=_GEO[1], bypass=True, loss="reinforce"),
}
"""verl 0.9.1's ``RolloutCorrectionConfig`` factories by name, with verl's default thresholds; each
sets every correction field and algorithm.loss_type. Compose with a testbed preset:
``--preset surge+decoupled_k3_rs`` (later presets override earlier ones)."""
PRESETS.update(VERL_PRESETS)


class ConfigError(TimlabError, ValueError):
    """A bad config key or value; the message is one line naming the key and the valid choices."""


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


SEED_RANGE = (0, 2**32 - 1)
INT_RANGES: dict[str, tuple[int, int]] = {
    "model.pretrain_seed": SEED_RANGE, "task.split_seed": SEED_RANGE, "mismatch.seed": SEED_RANGE,
    "run.seed": SEED_RANGE,
    "model.hidden_size": (1, 1 << 16), "model.num_layers": (1, 1024), "model.num_heads": (1, 1024),
    "model.num_kv_heads": (1, 1024), "model.intermediate_size": (1, 1 << 18),
    "model.max_position_embeddings": (1, 1 << 20),
}
"""Allowed range of each integer field; any other integer field is a count in ``[0, INT_MAX]``."""
INT_MAX = 10**9


def _show(value: Any) -> str:
    """``repr(value)``, cut to keep an error on one short line (a 400-digit number)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _to_int(key: str, value: Any) -> int:
    bad = ConfigError(f"{key}: expected an integer, got {_show(value)}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        n = value
    else:
        try:
            f = float(value)
        except (TypeError, ValueError, OverflowError):
            raise bad from None
        if not math.isfinite(f) or f != int(f):
            raise bad
        n = int(f)
    lo, hi = INT_RANGES.get(key, (0, INT_MAX))
    if not lo <= n <= hi:
        raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {_show(value)}")
    return n


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert a YAML/CLI value to the field's type or raise ConfigError naming the key."""
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        return _to_int(key, value)
    if typ is float:
        try:
            if isinstance(value, bool):
                raise TypeError(value)
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {_show(value)}") from None
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise ConfigError(f"{key}: expected a finite number, got {_show(value)}")
        return f
    if typ is str:
        return str(value)
    if typ is dict or origin is dict:
        if isinstance(value, str):
            value = load_yaml(value, key, ConfigError) if value.strip() else {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    return value


def _merge(base: dict, over: dict, where: str) -> dict:
    """Validate ``over`` against the sections/keys present in ``base`` and merge it in."""
    out = {k: dict(v) for k, v in base.items()}
    if not isinstance(over, dict):
        raise ConfigError(f"{where}: expected a mapping of sections, got {type(over).__name__}")
    for section, values in over.items():
        if section not in SECTIONS:
            raise ConfigError(f"{where}: unknown section {section!r}; valid choices: {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: section {section!r} must be a mapping")
        types = _field_types(SECTIONS[section])
        for key, value in values.items():
            if key not in types:
                raise ConfigError(
                    f"{where}: unknown key {section}.{key}; valid choices: {', '.join(types)}"
                )
            value = _coerce(f"{section}.{key}", value, types[key])
            if isinstance(value, dict) and isinstance(out[section].get(key), dict):
                value = {**out[section][key], **value}
            out[section][key] = value
    return out


def parse_set(items: list[str]) -> dict:
    """``["optim.lr=1e-4", "task.kwargs.max_len=30"]`` -> nested override dict (values YAML-parsed,
    but a text field's value is the text as written, less one pair of enclosing quotes, so that
    ``mismatch.after_text=:`` is the text ':' and not a YAML error)."""
    over: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"--set {item!r}: expected section.key=value (e.g. optim.lr=1e-4)")
        text_field = len(parts) == 2 and parts[0] in SECTIONS and _field_types(SECTIONS[parts[0]]).get(parts[1]) is str
        if text_field:
            value = _unquote(raw)
        else:
            value = load_yaml(raw, f"--set {key.strip()}", ConfigError) if raw.strip() else ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "_" in raw:
            value = raw.strip()  # YAML 1.1 reads "0.5_2.0" as the number 0.52; keep verl's "lo_hi" text
        node = over
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return over


def _unquote(raw: str) -> str:
    """``'":"'`` -> ``':'``: a text with one pair of enclosing quotes (single or double) removed."""
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return raw


def from_dict(d: dict) -> Config:
    sections = {name: SECTIONS[name](**values) for name, values in d.items()}
    return Config(**sections)


def _read_yaml(p: Path) -> Any:
    """A YAML file's content; one-line ConfigError naming the file when it is not UTF-8 or not YAML."""
    try:
        return load_yaml(p.read_text(encoding="utf-8"), str(p), ConfigError) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a folder, not a YAML file") from None


def resolve(
    yaml_path: str | Path | None = None,
    preset: str | None = None,
    overrides: list[str] | dict | None = None,
    *,
    task: str | None = None,
) -> Config:
    """defaults < preset(s) < YAML file < ``task`` < overrides; every layer validated. ``preset``
    may join several names with '+' (``surge+decoupled_k3_rs``), applied left to right.

    ``task`` (the CLI's ``--task``) picks the task by name; when it is not the task the presets
    and the YAML file chose, their ``task.kwargs`` (that other task's options) are dropped. A YAML
    file or ``--set task.name`` that switches the task keeps only the earlier layers' options the
    new task takes (``--preset smoke --set task.name=dataset`` drops smoke's reverse lengths;
    ``task.name=sort`` keeps them)."""
    d = Config().to_dict()
    for name in preset.split("+") if preset else []:
        name = name.strip()
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; valid choices: {', '.join(PRESETS)} (combine with '+')")
        d = _merge(d, PRESETS[name], f"preset {name}")
    if yaml_path:
        p = Path(yaml_path)
        if not p.exists():
            raise FileNotFoundError(f"config file not found: {p}")
        layer = _read_yaml(p)
        d = _merge(_switch_task(d, layer), layer, str(p))
    if task and task != d["task"]["name"]:
        d["task"] = {**d["task"], "name": task, "kwargs": {}}
    if overrides:
        over = parse_set(overrides) if isinstance(overrides, list) else overrides
        d = _merge(_switch_task(d, over), over, "--set")
    return from_dict(d)


def _switch_task(d: dict, layer) -> dict:
    """``d`` with only the ``task.kwargs`` that ``layer``'s ``task.name`` takes, when ``layer``
    switches to another registered task (the earlier layers' options were another task's)."""
    from timlab.tasks import TASKS

    section = layer.get("task") if isinstance(layer, dict) else None
    name = section.get("name") if isinstance(section, dict) else None
    if not isinstance(name, str) or name == d["task"]["name"] or name not in TASKS or not d["task"]["kwargs"]:
        return d
    takes = {f.name for f in dataclasses.fields(TASKS.get(name)) if f.init}
    return {**d, "task": {**d["task"], "kwargs": {k: v for k, v in d["task"]["kwargs"].items() if k in takes}}}


def load_run_config(run_dir: str | Path, overrides: dict | None = None) -> Config:
    """The fully resolved config.yaml a run directory was started with, plus ``overrides``
    (a nested dict as ``parse_set`` returns, validated like any other layer)."""
    from timlab.rundir import RunDir

    p = RunDir(run_dir).config
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml (not a timlab run directory)")
    d = _merge(Config().to_dict(), _read_yaml(p), str(p))
    if overrides:
        d = _merge(d, overrides, "--set")
    return from_dict(d)


# ------------------------------------------------------------------------------- validation
def validate(cfg: Config) -> Task:
    """Check every registry-backed name, the device, the task and the warm start before anything
    runs (the ranges are checked when the config is built: each section's ``__post_init__`` and
    ``Config.__post_init__``). Returns the task, which the checks build (a caller uses it instead
    of building it again)."""
    from timlab.engines import ENGINES
    from timlab.engines.device_loop import loop_for
    from timlab.injectors import check_section
    from timlab.kernels import check_device
    from timlab.metrics.alarm import ALARMS, check_threshold
    from timlab.remedies import IS_LEVELS, IS_MODES
    from timlab.schedulers import SCHEDULERS
    from timlab.tasks import TASKS, build_task
    from timlab.trainer.advantages import ADVANTAGES
    from timlab.trainer.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
    from timlab.trainer.precision import PRECISIONS

    checks = [
        ("task.name", cfg.task.name, TASKS),
        ("rollout.engine", cfg.rollout.engine, ENGINES),
        ("algorithm.name", cfg.algorithm.name, ADVANTAGES),
        ("scheduler.name", cfg.scheduler.name, SCHEDULERS),
        ("correction.level", cfg.correction.level, IS_LEVELS),
        ("correction.mode", cfg.correction.mode, IS_MODES),
    ]
    for key, value, reg in checks:
        if value not in reg:
            raise ConfigError(f"unknown {key} {value!r}; valid choices: {', '.join(reg.names())}")
    check_section(cfg.mismatch, default_engine=cfg.rollout.engine)  # the injector's settings, before any model loads
    if cfg.algorithm.loss_agg not in LOSS_AGGREGATIONS:
        raise ConfigError(f"unknown algorithm.loss_agg {cfg.algorithm.loss_agg!r}; valid choices: {', '.join(LOSS_AGGREGATIONS)}")
    if cfg.algorithm.loss_type not in POLICY_LOSSES:
        raise ConfigError(f"unknown algorithm.loss_type {cfg.algorithm.loss_type!r}; valid choices: {', '.join(POLICY_LOSSES)}")
    validate_correction(cfg)
    if cfg.run.alarm != "off" and cfg.run.alarm not in ALARMS:
        raise ConfigError(f"unknown run.alarm {cfg.run.alarm!r}; valid choices: off, {', '.join(ALARMS.names())}")
    if cfg.run.alarm != "off" and cfg.run.alarm_threshold:
        rule = ALARMS.get(cfg.run.alarm)
        try:
            check_threshold(rule.rule, rule.direction, cfg.run.alarm_threshold)
        except UsageError as e:
            raise ConfigError(f"run.{e} (run.alarm={cfg.run.alarm})".replace("alarm threshold", "alarm_threshold", 1)) from None
    if cfg.model.dtype not in PRECISIONS:
        raise ConfigError(f"unknown model.dtype {cfg.model.dtype!r}; valid choices: {', '.join(PRECISIONS)}")
    try:
        loop_for(cfg.rollout.decode_loop, engine=cfg.rollout.engine, sync_every=cfg.rollout.sync_every)
    except UsageError as e:
        raise ConfigError(str(e)) from None
    try:
        check_device(cfg.run.device, what="run.device")
    except UsageError as e:
        raise ConfigError(str(e)) from None
    task = build_task(cfg)
    check_warm_start(cfg, task)
    check_gradcheck(cfg)
    try:
        sampling = rollout_sampling(cfg)
    except UsageError as e:
        raise ConfigError(f"rollout.{e}") from None
    if sampling.temperature == 0:
        warnings.warn("rollout.temperature=0 (greedy): every sample of a prompt is the same sequence, so every group "
                      "has zero advantage and no step updates the policy", stacklevel=2)
    return task


def validate_correction(cfg: Config) -> None:
    """The correction section's rejection rules and thresholds, and bypass mode's loss."""
    from timlab.remedies import parse_rules, parse_thresholds

    c = cfg.correction
    if c.rs or c.rs_threshold:
        if not (c.rs and c.rs_threshold):
            raise ConfigError("correction.rs and correction.rs_threshold go together (verl's rollout_rs / "
                              f"rollout_rs_threshold); got rs={c.rs!r} rs_threshold={c.rs_threshold!r}")
        try:
            parse_thresholds(parse_rules(c.rs), c.rs_threshold)
        except TimlabError as e:
            raise ConfigError(f"correction.rs / correction.rs_threshold: {one_line(e)}") from None
    if c.bypass_mode and cfg.algorithm.loss_type == "ppo_clip" and (c.mode != "none" or c.veto_threshold):
        raise ConfigError("correction.bypass_mode with algorithm.loss_type=ppo_clip: the PPO ratio pi / mu already is the "
                          "IS correction, weights would count it twice; set correction.mode=none (verl's "
                          "bypass_ppo_clip) or algorithm.loss_type=reinforce (bypass_pg_is)")


MAX_WARM_START_CONTEXT = 8192
"""The longest prompt + answer (in characters) a warm start is built for: the tiny decoder's
attention is quadratic in it, and a task that needs more is a typo (task.kwargs.max_len=100000)."""


def check_warm_start(cfg: Config, task: Task) -> None:
    """One-line errors for model and task settings the warm start cannot be built with."""
    m = cfg.model
    if not m.path and task.needs_model_path:
        raise UsageError(f"task {cfg.task.name!r} starts from a model folder of yours: set model.path (a local HF "
                         "model folder with config.json and tokenizer.json); the char-level warm start is not built for it")
    if not m.path:
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "pretrain_steps",
                    "pretrain_batch"):
            if getattr(m, key) < 1:
                raise UsageError(f"model.{key} must be >= 1, got {getattr(m, key)}")
        if m.model_type == "qwen3_moe" and not m.num_experts:
            raise UsageError("model.model_type='qwen3_moe' needs model.num_experts >= 1 (with num_experts_per_tok "
                             "and moe_intermediate_size)")
        if m.num_experts and m.model_type != "qwen3_moe":
            raise UsageError(f"model.num_experts={m.num_experts} needs model.model_type='qwen3_moe', got {m.model_type!r}")
        if m.num_experts and not 1 <= m.num_experts_per_tok <= m.num_experts:
            raise UsageError(f"model.num_experts_per_tok must be in 1..model.num_experts={m.num_experts}, "
                             f"got {m.num_experts_per_tok}")
        if m.num_experts and m.moe_intermediate_size < 1:
            raise UsageError(f"model.moe_intermediate_size must be >= 1, got {m.moe_intermediate_size}")
        if m.hidden_size % m.num_heads:
            raise UsageError(f"model.hidden_size={m.hidden_size} must be a multiple of model.num_heads={m.num_heads}")
        if m.num_heads % m.num_kv_heads:
            raise UsageError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
        if not (math.isfinite(m.pretrain_lr) and m.pretrain_lr > 0):
            raise UsageError(f"model.pretrain_lr must be a finite number > 0, got {m.pretrain_lr}")
    for key in ("n_train", "n_val"):
        if getattr(cfg.task, key) < 1:
            raise UsageError(f"task.{key} must be >= 1, got {getattr(cfg.task, key)}")
    context = task.max_prompt_chars + task.max_answer_chars
    if not m.path and context > MAX_WARM_START_CONTEXT:
        raise UsageError(f"task {cfg.task.name!r} with task.kwargs={cfg.task.kwargs} needs {context} characters of "
                         f"prompt + answer; the warm start supports up to {MAX_WARM_START_CONTEXT}")
    if m.pretrain_init:
        if m.path:
            raise UsageError(f"model.pretrain_init={m.pretrain_init!r} with model.path={m.path!r}: RL starts from "
                             "model.path and builds no warm start, so the init would not be used; set one of them")
        from timlab.trainer.pretrain_init import check_pretrain_init

        check_pretrain_init(cfg, task)


def check_gradcheck(cfg: Config) -> None:
    """When run.gradcheck_every is on, the in-run gradcheck's estimator and sample count."""
    from timlab.gradcheck.estimator import ESTIMATORS
    from timlab.gradcheck.in_run import micro_batch

    if cfg.run.gradcheck_every:
        if cfg.run.gradcheck_estimator not in ESTIMATORS:
            raise ConfigError(f"unknown run.gradcheck_estimator {cfg.run.gradcheck_estimator!r}; "
                              f"valid choices: {', '.join(ESTIMATORS)}")
        mb = micro_batch(cfg)
        if cfg.run.gradcheck_samples % mb or cfg.run.gradcheck_samples < 8 * mb:
            raise ConfigError(f"run.gradcheck_samples must be a multiple of {mb} and >= {8 * mb} (8 micro-batches "
                              f"for a confidence interval), got {cfg.run.gradcheck_samples}")


def rollout_sampling(cfg: Config) -> SamplingParams:
    """How the rollout section says to draw tokens."""
    from timlab.engines import SamplingParams

    return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
