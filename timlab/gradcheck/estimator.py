"""The policy gradient estimated twice, from exact and from mismatched rollouts (``timlab gradcheck``).

At one set of weights, estimate the policy gradient twice from many sampled sequences:

    g_exact = E_{y ~ pi}[ w(y) grad log pi(y|x) ]     (on-policy; Beyond Precision Eq. 2)
    g_tim   = E_{y ~ mu}[ w(y) grad log pi(y|x) ]     (what a mismatched sampler gives; Eq. 3)

with w = R (``reinforce``, the papers' estimator, R in [0, 1]) or the leave-one-out advantage
(``rloo``, groups of ``group_size`` samples per prompt). pi is the exact engine on the trainer's
weights (bitwise equal to the trainer); mu is the configured injector. Both are sampled with the
same prompts and the same random numbers (``full_batch_decode``), so with no mismatch the two
estimates are identical and every bias is exactly 0.

A second estimate of the bias uses mu's samples alone: g_tim - g_exact = E_mu[(1 - rho) w s]
with rho = pi(y) / mu(y) the exact (untruncated) sequence ratio; for a small mismatch rho is
near 1 everywhere and this estimate is much less noisy than the paired difference.

Reported (``timlab.metrics.gradients``): cosine, relative bias ||g_tim - g_exact|| / ||g_exact||
with bootstrap confidence intervals and its noise floor, the per-sequence gradient SNR under pi
and mu, all per response-length bucket (prompts bucketed by their reference answer's length)
and pooled. Then the T^2 bound of Beyond Precision Theorem 3.1 / B.1,

    ||g_tim - g_exact|| <= 2 B Delta T^2     (REINFORCE, R in [0, 1]),

with Delta = the largest per-token TV distance between pi and mu, computed exactly from the
full next-token distributions at every state mu visited (not from sampled tokens), B = the
largest per-token score norm ||grad log pi(a|s)|| measured on a subset of mu's sequences, and
T = the longest response in the bucket. Measured B and Delta are maxima over visited states,
so they can only underestimate the theorem's suprema: a measured bias above the bound would
falsify it; one far below says how loose it is.

Memory: the K = samples / micro_batch micro-batch gradient means of each side are kept
(2 K D float32 for D selected parameters, 3 K D with the importance-weighted estimate, plus
at most 256 MiB of float64 blocks while the Gram matrices are formed; ``param_filter``
narrows D for large models); all statistics come from K x K Gram matrices. Delta is taken from mu's logits after the injector and before the rollout's
temperature / top-k / top-p, i.e. between the two models' distributions (exact at the default
temperature 1 with no truncation).
"""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import asdict, dataclass, field

import torch

from timlab.engines import Engine, NonFiniteLogitsError, SamplingParams, build_engine, full_batch_decode
from timlab.errors import TimlabError
from timlab.injectors import RolloutInjector
from timlab.metrics import all_metrics
from timlab.metrics.gradients import MIN_MICRO_BATCHES, fit_power_law, gradient_stats, gram, pair_grams, tv_distance
from timlab.model.forward import full_step, gather_logprobs
from timlab.model.llama import CausalLM
from timlab.tasks import Example, Task
from timlab.tokenizer import Tokenizer
from timlab.trainer.advantages import rloo
from timlab.trainer.scoring import rollout_rewards
from timlab.progress import Progress

__all__ = ["ESTIMATORS", "GradcheckError", "GradcheckResult", "GradcheckSettings", "gradcheck", "length_buckets", "select_params"]

ESTIMATORS = ("reinforce", "rloo")
ESS_MIN = 0.5
"""Below this effective-sample-size fraction of the ratios pi(y)/mu(y), the importance-weighted
bias estimate is flagged as unreliable (its bootstrap interval misses rare large weights)."""
REWARD_MAX = 1.0
"""Every timlab task's reward lies in [0, 1] (the theorem's R in {0, 1} generalizes to this)."""



class GradcheckError(TimlabError, ValueError):
    """Bad gradcheck input; a one-line message naming the setting and the valid choices."""


MAX_SAMPLES = 1 << 20
"""Most sequences per side (``samples``, ``score_seqs``): a typo such as 1e9 is refused before any work."""
MAX_BOOT = 10_000
"""Most bootstrap replicates (``n_boot``): the resampling holds replicates x micro-batches numbers."""


# ------------------------------------------------------------------------------------ buckets
def length_buckets(pool: list[Example], n: int) -> list[list[Example]]:
    """Split prompts into ``n`` buckets of contiguous reference-answer lengths, of similar sizes."""
    if n < 1:
        raise GradcheckError(f"buckets must be >= 1, got {n}")
    if n == 1:
        return [list(pool)]
    by_len: dict[int, list[Example]] = {}
    for ex in pool:
        by_len.setdefault(len(ex.answer), []).append(ex)
    lengths = sorted(by_len)
    if len(lengths) < n:
        raise GradcheckError(f"buckets={n}, but the task's answers have only {len(lengths)} distinct lengths "
                             f"({lengths}); use buckets <= {len(lengths)}")
    buckets: list[list[Example]] = []
    remaining = len(pool)
    i = 0
    for b in range(n):
        target = remaining / (n - b)
        cur: list[Example] = []
        while i < len(lengths) and (not cur or len(cur) + len(by_len[lengths[i]]) / 2 <= target) \
                and len(lengths) - i > n - b - 1:
            cur.extend(by_len[lengths[i]])
            i += 1
        if b == n - 1:
            while i < len(lengths):
                cur.extend(by_len[lengths[i]])
                i += 1
        buckets.append(cur)
        remaining -= len(cur)
    return buckets


# ------------------------------------------------------------------------------------ gradients
def select_params(model: CausalLM, param_filter: str | None) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters whose name matches ``param_filter`` (a regex; None = all)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if param_filter:
        try:
            rx = re.compile(param_filter)
        except re.error as e:
            raise GradcheckError(f"param_filter {param_filter!r} is not a valid regex ({e})") from None
        named = [(n, p) for n, p in named if rx.search(n)]
    if not named:
        raise GradcheckError(f"param_filter {param_filter!r} matches no trainable parameter; names look like "
                             f"{', '.join(n for n, _ in list(model.named_parameters())[:3])}")
    return named


def _flat(grads, params) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float().cpu()
                      for g, p in zip(grads, params)])


def sequence_logprobs(model: CausalLM, tokens: torch.Tensor, key_valid: torch.Tensor, mask: torch.Tensor,
                      kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer forward (exact mode, autograd on): per-token log pi (B, L) and the logits (B, L, V).

    Column c's log-prob comes from logits[:, c - 1]; column 0 gets 0; off-mask columns get 0.
    """
    logits = model(tokens, full_step(key_valid, kv_len), mode="exact")  # (B, L, V) fp32
    logp, _ = gather_logprobs(logits, tokens)
    return logp * mask, logits


def sample_weights(rewards: torch.Tensor, estimator: str, group_size: int) -> torch.Tensor:
    """Per-sequence weight w: the reward (reinforce) or the leave-one-out advantage (rloo)."""
    if estimator == "reinforce":
        return rewards
    return rloo(rewards.view(-1, group_size)).reshape(-1)  # (groups, G) -> (B,)


@dataclass
class _Side:
    """One side's rollout of a chunk, scored by the trainer."""

    tokens: torch.Tensor
    key_valid: torch.Tensor
    mask: torch.Tensor  # (B, L) float
    rollout_logp: torch.Tensor  # (B, L) log mu / log pi from the engine
    weights: torch.Tensor  # (B,)
    lengths: torch.Tensor  # (B,)
    kv_len: int


def _score_side(rollout, rewards: torch.Tensor, estimator: str, group_size: int) -> _Side:
    L = rollout.prompt_width + max(1, int(rollout.lengths.max()))
    return _Side(
        tokens=rollout.tokens[:, :L], key_valid=rollout.key_valid[:, :L],
        mask=rollout.response_mask[:, :L].float(), rollout_logp=rollout.logprobs[:, :L],
        weights=sample_weights(rewards, estimator, group_size).to(rollout.tokens.device),
        lengths=rollout.lengths.cpu(), kv_len=rollout.tokens.shape[1],
    )


def score_norms(model: CausalLM, params: list[torch.nn.Parameter], side: _Side, row: int) -> tuple[list[float], float]:
    """Per-token score norms ||grad log pi(y_t | s_t)|| of one sequence, and its sequence score norm."""
    sl = slice(row, row + 1)
    logp, _ = sequence_logprobs(model, side.tokens[sl], side.key_valid[sl], side.mask[sl], side.kv_len)
    cols = torch.nonzero(side.mask[row]).flatten().tolist()
    total = None
    norms = []
    for i, c in enumerate(cols):
        g = _flat(torch.autograd.grad(logp[0, c], params, retain_graph=i < len(cols) - 1, allow_unused=True), params)
        norms.append(float(g.norm()))
        total = g if total is None else total + g
    return norms, float(total.norm()) if total is not None else 0.0


# ------------------------------------------------------------------------------------ result
@dataclass
class GradcheckResult:
    """What ``gradcheck`` measured; ``to_dict()`` is JSON-ready."""

    settings: dict
    pooled: dict
    buckets: list[dict]
    bound: dict
    mismatch: dict
    cost: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------ the estimator
@dataclass(frozen=True)
class GradcheckSettings:
    """What one gradcheck draws and how it summarizes it (``gradcheck``'s keyword arguments, whose
    defaults live in its signature); a one-line ``GradcheckError`` for any it cannot run with."""

    samples: int
    """Sequences per side (pi and mu), a multiple of ``micro_batch * buckets``."""
    micro_batch: int
    """Sequences per gradient micro-batch mean (a multiple of the rloo group)."""
    rollout_batch: int
    """Sequences sampled per engine call (rounded down to whole micro-batches, at least one)."""
    buckets: int
    """Response-length buckets (prompts split by their reference answer's length)."""
    estimator: str
    """``reinforce`` (w = R, the bound's setting) or ``rloo`` (leave-one-out advantage)."""
    group_size: int
    """rloo: samples per prompt."""
    max_new_tokens: int
    """Longest response sampled."""
    sampling: SamplingParams
    """Temperature / top-p / top-k of both sides."""
    dense_reward: bool
    """Partial-credit reward instead of 0/1."""
    score_seqs: int
    """Sequences whose per-token score norms estimate B (0: the bound is not evaluated)."""
    n_boot: int
    """Bootstrap replicates of the confidence intervals (>= 100)."""
    ci: float
    """Confidence level of the intervals."""
    seed: int
    """Seed of the prompt draws, the samplers and the bootstrap."""
    param_filter: str | None
    """Regex: only parameters whose name matches (None = all)."""
    importance_weighted: bool
    """Also estimate the bias from mu's samples alone, E_mu[(1 - rho) w s] (default sampling only)."""

    def __post_init__(self) -> None:
        if self.buckets < 1:
            raise GradcheckError(f"buckets must be >= 1, got {self.buckets}")
        if self.score_seqs < 0:
            raise GradcheckError(f"score_seqs must be >= 0, got {self.score_seqs}")
        if self.n_boot < 100:
            raise GradcheckError(f"n_boot must be >= 100 for a bootstrap interval, got {self.n_boot}")
        if self.n_boot > MAX_BOOT:
            raise GradcheckError(f"n_boot (--boot) must be at most {MAX_BOOT}, got {self.n_boot}")
        for name in ("samples", "score_seqs"):
            if getattr(self, name) > MAX_SAMPLES:
                raise GradcheckError(f"{name} must be at most {MAX_SAMPLES}, got {getattr(self, name)}")

        if self.estimator not in ESTIMATORS:
            raise GradcheckError(f"unknown estimator {self.estimator!r}; valid choices: {', '.join(ESTIMATORS)}")
        if self.estimator == "rloo" and self.group_size < 2:
            raise GradcheckError(f"estimator rloo needs group_size >= 2, got {self.group_size}")
        G, mb = self.group, self.micro_batch
        if mb < 1 or mb % G:
            raise GradcheckError(f"micro_batch ({mb}) must be a positive multiple of group_size ({G})")
        if self.samples < 1 or self.samples % mb:
            raise GradcheckError(f"samples ({self.samples}) must be a positive multiple of micro_batch ({mb})")
        K = self.micro_batches
        if K % self.buckets or K // self.buckets < MIN_MICRO_BATCHES:
            raise GradcheckError(
                f"samples={self.samples} gives {K // self.buckets} micro-batches of {mb} per length bucket; a "
                f"confidence interval needs >= {MIN_MICRO_BATCHES} per bucket (samples a multiple of {mb * self.buckets}"
                f", at least {MIN_MICRO_BATCHES * mb * self.buckets})")

    @property
    def group(self) -> int:
        """Sequences per prompt G: ``group_size`` for rloo, else 1."""
        return self.group_size if self.estimator == "rloo" else 1

    @property
    def micro_batches(self) -> int:
        """K = samples / micro_batch."""
        return self.samples // self.micro_batch

    @property
    def per_chunk(self) -> int:
        """Micro-batches per engine call: ``rollout_batch`` rounded down to whole micro-batches (>= 1)."""
        return max(self.rollout_batch, self.micro_batch) // self.micro_batch

    @property
    def default_sampling(self) -> bool:
        """Temperature 1, no top-p / top-k: the importance-weighted estimate needs it."""
        return self.sampling.temperature == 1.0 and self.sampling.top_p == 1.0 and self.sampling.top_k == 0


def _sample_pair(pi_engine: Engine, injector: RolloutInjector, prompts: list[list[int]], *, max_new_tokens: int,
                 sampling: SamplingParams, seed: int):
    """The same prompts sampled from pi (the exact engine) and from mu (the injector) with equal
    generator seeds and full-batch decodes, so the two are coupled row by row. Returns
    (pi's rollout, mu's rollout, mu's logits (B, V) per grid column)."""
    recorded: dict[int, torch.Tensor] = {}

    def observe(logits: torch.Tensor, col: torch.Tensor) -> None:
        recorded[int(col[0])] = logits.detach().float().clone()  # (B, V): mu's distribution at col

    device = pi_engine.model.device
    try:
        with full_batch_decode(pi_engine, injector.engine):
            r_pi = pi_engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                      generator=torch.Generator(device=device).manual_seed(seed))
            r_mu = injector.rollout(prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                    generator=torch.Generator(device=device).manual_seed(seed), observe=observe)
    except NonFiniteLogitsError:
        raise NonFiniteLogitsError("gradcheck: non-finite logits while sampling (diverged weights?)") from None
    return r_pi, r_mu, recorded


@dataclass
class _Gradients:
    """What the gradient loop accumulates over the K micro-batches."""

    X: torch.Tensor  # (K, D) exact-side micro-batch means
    Y: torch.Tensor  # (K, D) mismatched side
    Z: torch.Tensor | None  # (K, D) (1-rho) w s on the mismatched side; None: no importance-weighted estimate
    per_bucket: list[dict]  # per length bucket: lengths, per-token TV, per-sequence TV, identical responses
    rhos: list[torch.Tensor] = field(default_factory=list)  # sequence ratios pi(y)/mu(y)
    is_overflow: bool = False  # a ratio overflowed float64
    trainer_lp: list[torch.Tensor] = field(default_factory=list)  # mu's samples: log pi, log mu, mask
    rollout_lp: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    tok_norms: list[float] = field(default_factory=list)  # per-token score norms (first score_seqs micro-batches)
    seq_norms: list[float] = field(default_factory=list)  # their sequences' score norms


def _gradients(acc: _Gradients, model: CausalLM, params: list[torch.nn.Parameter], pi_side: _Side, mu_side: _Side,
               recorded: dict[int, torch.Tensor], same: list[bool], js: list[int], *, micro_batch: int) -> None:
    """The micro-batch gradients of one chunk (micro-batches ``js``): (1/m) sum_i w_i grad log pi(y_i)
    on pi's samples into X[j] and on mu's into Y[j], (1/m) sum_i (1 - rho_i) w_i grad log pi(y_i)
    into Z[j], and each bucket's lengths, TV and identical-response count."""
    buckets = len(acc.per_bucket)
    for i, j in enumerate(js):
        rows = slice(i * micro_batch, (i + 1) * micro_batch)
        st = acc.per_bucket[j % buckets]
        for out, side in ((acc.X, pi_side), (acc.Y, mu_side)):
            logp, logits = sequence_logprobs(model, side.tokens[rows], side.key_valid[rows], side.mask[rows],
                                             side.kv_len)
            w = side.weights[rows]
            v = None
            if side is mu_side and acc.Z is not None:
                # (1 - rho) w with rho = pi(y) / mu(y): E_mu[(1 - rho) w s] = g_tim - g_exact, unbiased
                log_rho = (logp.detach().double() - side.rollout_logp[rows].double()).sum(-1)  # (m,)
                rho = torch.exp(log_rho)
                if torch.isfinite(rho).all():
                    v = (1.0 - rho).float() * w
                    acc.rhos.append(rho)
                else:
                    acc.is_overflow = True
            need_v = v is not None and bool((v != 0).any())
            if bool((w != 0).any()):
                obj = (w[:, None] * logp).sum() / micro_batch  # (1/m) sum_i w_i log pi(y_i)
                out[j] = _flat(torch.autograd.grad(obj, params, allow_unused=True, retain_graph=need_v), params)
            if need_v:
                obj = (v[:, None] * logp).sum() / micro_batch
                acc.Z[j] = _flat(torch.autograd.grad(obj, params, allow_unused=True), params)
            st["lengths"].extend(side.lengths[rows].tolist())
            if side is mu_side:
                tv_rows = _tv_rows(logits.detach(), recorded, side, rows)
                st["tv"].extend(torch.cat(tv_rows).tolist() if tv_rows else [])
                st["tv_seq"].extend(float(t.sum()) for t in tv_rows)
                acc.trainer_lp.append(logp.detach())
                acc.rollout_lp.append(side.rollout_logp[rows])
                acc.masks.append(side.mask[rows])
        st["same"] += sum(same[rows])
        st["n"] += micro_batch


def gradcheck(
    model: CausalLM,
    tok: Tokenizer,
    task: Task,
    pool: list[Example],
    injector: RolloutInjector,
    *,
    exact_engine: Engine | None = None,
    samples: int = 256,
    micro_batch: int = 8,
    rollout_batch: int = 64,
    buckets: int = 1,
    estimator: str = "reinforce",
    group_size: int = 8,
    max_new_tokens: int = 40,
    sampling: SamplingParams = SamplingParams(),
    dense_reward: bool = False,
    score_seqs: int = 8,
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int = 0,
    param_filter: str | None = None,
    importance_weighted: bool = True,
    progress: Progress | None = None,
) -> GradcheckResult:
    """Estimate g_exact and g_tim at the model's current weights and compare them (module docstring).

    ``pool``: the prompts to draw from (uniformly, with replacement); ``injector``: mu, built on
    ``model``; ``exact_engine``: pi's sampler (default: a new exact engine on ``model``). The
    model's weights and ``.grad`` fields are left untouched; the injector's random state is
    restored afterwards, so a training run that calls this stays bitwise on its own trajectory.
    Three stages: draw the prompts of each chunk (``_draw``), sample and differentiate them
    (``_run``), summarize the gradients into statistics, the bound and notes (``_summarize``).
    """
    t_start = time.perf_counter()
    st = GradcheckSettings(samples=samples, micro_batch=micro_batch, rollout_batch=rollout_batch, buckets=buckets,
                           estimator=estimator, group_size=group_size, max_new_tokens=max_new_tokens,
                           sampling=sampling, dense_reward=dense_reward, score_seqs=score_seqs, n_boot=n_boot, ci=ci,
                           seed=seed, param_filter=param_filter, importance_weighted=importance_weighted)
    if not pool:
        raise GradcheckError("no prompts to draw from")
    bucket_pools = length_buckets(pool, buckets)
    named = select_params(model, param_filter)
    params = [p for _, p in named]
    pi_engine = exact_engine or build_engine("exact", model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cost: dict = {}
    acc = _run(st, model, params, tok, task, pi_engine, injector, _draw(st, bucket_pools), cost=cost, progress=progress)
    return _summarize(st, acc, bucket_pools, injector, t_start=t_start, cost=cost)


def _draw(st: GradcheckSettings, bucket_pools: list[list[Example]]):
    """Per engine call (chunk): (its micro-batch indices js, one example per sequence). Micro-batch
    j draws from length bucket j % buckets, ``micro_batch / G`` prompts each repeated G times.
    A generator: each chunk is drawn when the loop reaches it (one seeded ``random.Random``)."""
    K, per, G, buckets = st.micro_batches, st.per_chunk, st.group, st.buckets
    prompt_rng = random.Random(st.seed)
    for c in range(math.ceil(K / per)):
        js = list(range(c * per, min(K, (c + 1) * per)))
        examples: list[Example] = []
        for j in js:
            bp = bucket_pools[j % buckets]
            for _ in range(st.micro_batch // G):
                ex = bp[prompt_rng.randrange(len(bp))]
                examples.extend([ex] * G)
        yield js, examples


def _run(st: GradcheckSettings, model: CausalLM, params: list[torch.nn.Parameter], tok: Tokenizer, task: Task,
         pi_engine: Engine, injector: RolloutInjector, chunks, *, cost: dict,
         progress: Progress | None) -> _Gradients:
    """Sample each chunk from pi and mu with coupled seeds, score both sides, accumulate the
    micro-batch gradients (and, for the first ``score_seqs`` micro-batches, score norms). Times
    go into ``cost``; the model's mode and the injector's state are restored."""
    K, D, G, buckets = st.micro_batches, sum(p.numel() for p in params), st.group, st.buckets
    acc = _Gradients(
        X=torch.zeros(K, D, dtype=torch.float32), Y=torch.zeros(K, D, dtype=torch.float32),
        Z=torch.zeros(K, D, dtype=torch.float32) if st.importance_weighted and st.default_sampling else None,
        per_bucket=[dict(lengths=[], tv=[], tv_seq=[], same=0, n=0) for _ in range(buckets)])
    n_chunks = math.ceil(K / st.per_chunk)
    injector_state = injector.state_dict()
    was_training = model.training
    model.eval()
    t_roll = t_grad = t_score = 0.0
    try:
        for c, (js, examples) in enumerate(chunks):
            t0 = time.perf_counter()
            r_pi, r_mu, recorded = _sample_pair(pi_engine, injector, [task.encode_prompt(tok, ex) for ex in examples],
                                                max_new_tokens=st.max_new_tokens, sampling=st.sampling,
                                                seed=st.seed * 1_000_003 + 7919 * c + 1)
            t_roll += time.perf_counter() - t0
            pi_side = _score_side(r_pi, rollout_rewards(task, tok, examples, r_pi, dense=st.dense_reward), st.estimator, G)
            mu_side = _score_side(r_mu, rollout_rewards(task, tok, examples, r_mu, dense=st.dense_reward), st.estimator, G)
            same = [a == b for a, b in zip(r_pi.responses(), r_mu.responses())]

            t0 = time.perf_counter()
            _gradients(acc, model, params, pi_side, mu_side, recorded, same, js, micro_batch=st.micro_batch)
            t_grad += time.perf_counter() - t0

            t0 = time.perf_counter()
            for i, j in enumerate(js):
                if j < st.score_seqs:
                    norms, sn = score_norms(model, params, mu_side, i * st.micro_batch)
                    acc.tok_norms.extend(norms)
                    acc.seq_norms.append(sn)
            t_score += time.perf_counter() - t0
            if progress is not None:
                progress("gradcheck", c + 1, n_chunks, {})
    finally:
        injector.load_state_dict(injector_state)
        model.train(was_training)
    cost.update(rollout_s=t_roll, gradient_s=t_grad, score_norm_s=t_score)
    return acc


def _summarize(st: GradcheckSettings, acc: _Gradients, bucket_pools: list[list[Example]], injector: RolloutInjector,
               *, t_start: float, cost: dict) -> GradcheckResult:
    """Statistics pooled and per length bucket, the T^2 bound, the mismatch of mu's samples and
    the notes, as a ``GradcheckResult``."""
    K, buckets, D = st.micro_batches, st.buckets, acc.X.shape[1]
    strata = torch.tensor([j % buckets for j in range(K)])
    t0 = time.perf_counter()
    gzz = gram(acc.Z) if acc.Z is not None and not acc.is_overflow else None
    pooled, bucket_rows = _statistics(acc.X, acc.Y, gzz, strata=strata, per_bucket=acc.per_bucket,
                                      bucket_pools=bucket_pools, micro_batch=st.micro_batch, n_boot=st.n_boot,
                                      ci=st.ci, seed=st.seed)
    t_stats = time.perf_counter() - t0

    bound = _bound(bucket_rows, [v for b in acc.per_bucket for v in b["tv"]], acc.tok_norms, acc.seq_norms,
                   reinforce=st.estimator == "reinforce")

    mismatch = {k: float(v) for k, v in all_metrics(_pad_cat(acc.trainer_lp), _pad_cat(acc.rollout_lp),
                                                    _pad_cat(acc.masks)).items()
                if k in ("rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff", "mismatch/max_abs_diff",
                         "mismatch/abs_diff_mean", "mismatch/frac_bitwise_equal")}
    if acc.rhos and gzz is not None:  # effective sample size of the sequence ratios pi/mu
        r = torch.cat(acc.rhos)
        pooled["is_ess_frac"] = float(r.sum() ** 2 / (r.numel() * (r * r).sum()))
    notes = _notes(pooled, bucket_rows, bound, samples=st.samples, buckets=buckets, estimator=st.estimator,
                   importance_weighted=st.importance_weighted, default_sampling=st.default_sampling,
                   is_overflow=acc.is_overflow, scored=bool(acc.tok_norms))
    return GradcheckResult(
        settings={"samples": st.samples, "micro_batch": st.micro_batch, "dense_reward": st.dense_reward,
                  "micro_batches": K, "buckets": buckets, "estimator": st.estimator, "group_size": st.group,
                  "max_new_tokens": st.max_new_tokens, "seed": st.seed, "n_boot": st.n_boot, "ci": st.ci, "params": D,
                  "param_filter": st.param_filter, "score_seqs": st.score_seqs,
                  "injector": "+".join(injector.parts) or "none", "magnitude": injector.settings.magnitude,
                  "sampling": asdict(st.sampling), "importance_weighted": gzz is not None},
        pooled=pooled, buckets=bucket_rows, bound=bound, mismatch=mismatch,
        cost={"total_s": time.perf_counter() - t_start, **cost, "stats_s": t_stats,
              "vector_bytes": (2 + (acc.Z is not None)) * K * D * 4},
        notes=notes,
    )


def _statistics(X: torch.Tensor, Y: torch.Tensor, gzz: torch.Tensor | None, *, strata: torch.Tensor,
                per_bucket: list[dict], bucket_pools: list[list[Example]], micro_batch: int, n_boot: int, ci: float,
                seed: int) -> tuple[dict, list[dict]]:
    """Pooled statistics of the (K, D) micro-batch gradients X (exact) and Y (mismatched), and one
    row per length bucket (its own statistics, lengths, TV and identical-response fraction)."""
    gxx, gyy, gdd, gxy = pair_grams(X, Y)
    kw = dict(micro_batch=micro_batch, n_boot=n_boot, ci=ci, seed=seed)
    pooled = gradient_stats(gxx, gyy, gdd, gxy, strata=strata, gzz=gzz, **kw)
    buckets = len(per_bucket)
    bucket_rows = []
    for b in range(buckets):
        idx = torch.nonzero(strata == b).flatten()
        sub = [g[idx][:, idx] for g in (gxx, gyy, gdd, gxy)]
        stats = gradient_stats(*sub, gzz=None if gzz is None else gzz[idx][:, idx], **kw) if buckets > 1 else dict(pooled)
        st = per_bucket[b]
        ans = [len(ex.answer) for ex in bucket_pools[b]]
        tv = torch.tensor(st["tv"] or [0.0], dtype=torch.float64)
        bucket_rows.append({
            "bucket": b, "answer_len_min": min(ans), "answer_len_max": max(ans),
            "T_mean": float(sum(st["lengths"]) / max(len(st["lengths"]), 1)), "T_max": int(max(st["lengths"] or [0])),
            "tv_max": float(tv.max()), "tv_mean": float(tv.mean()),
            "tv_seq_mean": float(sum(st["tv_seq"]) / max(len(st["tv_seq"]), 1)),
            "same_response_frac": st["same"] / max(st["n"], 1),
            **stats,
        })
    return pooled, bucket_rows


def _bound(bucket_rows: list[dict], all_tv: list[float], tok_norms: list[float], seq_norms: list[float], *,
           reinforce: bool) -> dict:
    """The T^2 bound ||g_tim - g_exact|| <= 2 R_max B delta T^2 (module docstring) from the largest
    per-token TV ``all_tv`` and score norm ``tok_norms``; each bucket row gets its bound and
    tightness, and the bias's power law in T is fitted where every bucket resolves the bias."""
    delta = max(all_tv) if all_tv else 0.0
    B_hat = max(tok_norms) if tok_norms else float("nan")
    bound: dict = {"applies": reinforce and bool(tok_norms), "delta_max": delta,
                   "delta_mean": sum(all_tv) / max(len(all_tv), 1), "score_norm_max": B_hat,
                   "score_norm_mean": sum(tok_norms) / max(len(tok_norms), 1),
                   "seq_score_norm_max": max(seq_norms) if seq_norms else float("nan"),
                   "score_tokens": len(tok_norms), "reward_max": REWARD_MAX}
    C = 2 * REWARD_MAX * B_hat * delta
    bound["C"] = C if bound["applies"] else float("nan")
    for row in bucket_rows:
        if bound["applies"]:
            row["bound"] = C * row["T_max"] ** 2
            row["tightness"] = row["bias_norm"] / row["bound"] if row["bound"] > 0 else 0.0  # 0 / 0: no mismatch
            row["tightness_hi"] = row["bias_norm_hi"] / row["bound"] if row["bound"] > 0 else 0.0
        else:
            row["bound"] = row["tightness"] = row["tightness_hi"] = float("nan")
    resolved = len(bucket_rows) > 2 and all(r["bias_norm_lo"] > 0 for r in bucket_rows)
    bound["bias_exponent"] = fit_power_law([r["T_mean"] for r in bucket_rows], [r["bias_norm"] for r in bucket_rows]) \
        if resolved else float("nan")
    bound["holds"] = all(not (r["bias_norm"] > r["bound"]) for r in bucket_rows) if bound["applies"] else None
    return bound


def _notes(pooled: dict, bucket_rows: list[dict], bound: dict, *, samples: int, buckets: int, estimator: str,
           importance_weighted: bool, default_sampling: bool, is_overflow: bool, scored: bool) -> list[str]:
    """What the numbers of a gradcheck cannot say, in words: an unseen mismatch, unresolved
    intervals, heavy-tailed ratios, estimates or bounds that were not computed."""
    delta = bound["delta_max"]
    resolved = buckets > 2 and all(r["bias_norm_lo"] > 0 for r in bucket_rows)
    notes = []
    if all(r["same_response_frac"] == 1.0 for r in bucket_rows) and pooled["bias_norm_plugin"] == 0.0:
        notes.append("zero mismatch: mu and pi gave identical distributions, responses and gradients" if delta == 0.0 else
                     f"no sampled token differed between mu and pi (per-token TV max {delta:.2g}), so the gradients are "
                     f"identical: this mismatch is below what {samples} samples can see")
    if buckets > 2 and not resolved:
        notes.append("the bias is not resolved (interval reaching 0) in every length bucket: no T-exponent is fitted")
    if not pooled["grad_norm_exact_lo"] > 0 and pooled["bias_norm_plugin"] > 0:
        notes.append(f"the exact gradient is not resolved at {samples} samples (the interval of ||g_exact|| reaches 0; "
                     f"SNR per sequence {pooled['snr_exact']:.2g}): relative bias and cosine are noise-dominated; "
                     f"draw more samples")
    ess = pooled.get("is_ess_frac")
    if ess is not None and ess < ESS_MIN:
        notes.append(f"the sequence ratios pi/mu are heavy-tailed (effective sample size {ess:.0%} of the samples): "
                     f"the importance-weighted bias and its interval are unreliable here; read the paired estimate")
    if importance_weighted and not default_sampling:
        notes.append("the importance-weighted bias estimate needs temperature 1 and no top-k/top-p; not computed")
    if is_overflow:
        notes.append("a sequence ratio pi(y)/mu(y) overflowed float64: no importance-weighted bias estimate")
    if estimator != "reinforce":
        notes.append("the T^2 bound is stated for REINFORCE with R in [0, 1]; it is not evaluated for rloo")
    elif not scored:
        notes.append("score_seqs=0: no score norms measured, so the T^2 bound is not evaluated")
    return notes


def _tv_rows(logits: torch.Tensor, recorded: dict[int, torch.Tensor], side: _Side, rows: slice) -> list[torch.Tensor]:
    """Per-sequence TV(pi(.|s_t), mu(.|s_t)) at each response token of ``rows`` (a list of (len,) tensors)."""
    out = []
    start = rows.start
    for i in range(logits.shape[0]):
        cols = torch.nonzero(side.mask[start + i]).flatten()
        if cols.numel() == 0:
            out.append(torch.zeros(0, dtype=torch.float64))
            continue
        pi_l = logits[i, cols - 1]  # (n, V): logits at column c-1 predict column c
        mu_l = torch.stack([recorded[int(c)][start + i] for c in cols])  # (n, V)
        out.append(tv_distance(pi_l, mu_l).cpu())
    return out


def _pad_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    L = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p.float(), (0, L - p.shape[1])) for p in parts])
