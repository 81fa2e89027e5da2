"""The rollout-engine interface and the sampling step every engine shares.

An engine turns prompts into a ``Rollout``: the (B, S) token grid in timlab's layout (prompts
left-padded to width P, responses from column P, see ``timlab.model.forward``), the log-prob of
each sampled token under the model's distribution (temperature 1, no truncation; this is the
``log mu`` that mismatch metrics compare with the trainer's ``log pi``), the log-prob under
the distribution actually sampled from (after temperature, top-k, top-p), and EOS-terminated
lengths. Truncation is a separate, non-numerical source of mismatch, so both are reported.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from timlab.errors import TimlabError, UsageError
from timlab.model.forward import buffer_length
from timlab.model.llama import CausalLM
from timlab.model.moe import Routing
from timlab.model.ops import log_softmax
from timlab.registry import Registry

ENGINES: Registry[type["Engine"]] = Registry("engine")

LogitsProcessor = Callable[..., torch.Tensor]
"""``processor(logits (B, V) fp32, column_index (B,) long) -> logits``: a rollout-side change
of the model's distribution (an injected mismatch). It defines the engine's log mu. A processor
whose attribute ``reads_tokens`` is true is called with a third argument, the (B, col) tokens of
its rows before the column being sampled (the P-wide left-padded prompt, then the response so
far; pad after a row's EOS): ``call_processor`` is the one place that decides."""


def reads_tokens(processor: LogitsProcessor | None) -> bool:
    """True when ``processor`` takes the tokens so far as a third argument."""
    return bool(getattr(processor, "reads_tokens", False))


def call_processor(processor: LogitsProcessor, logits: torch.Tensor, col: int,
                   tokens: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Apply ``processor`` to the (B, V) ``logits`` of column ``col``; ``tokens()`` gives the (B, col)
    tokens so far, and is called only for a processor that ``reads_tokens`` (no work otherwise)."""
    cols = torch.full((logits.shape[0],), col, dtype=torch.long, device=logits.device)  # (B,)
    if reads_tokens(processor):
        return processor(logits, cols, tokens())
    return processor(logits, cols)


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
"""Sampling temperatures outside this band (other than 0) overflow fp32 logits / T to inf or flatten
them to uniform noise; logits of ~100 at T = 1e-3 are 1e5, still finite in fp32 softmax."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. temperature 0 means greedy; top_k 0 and top_p 1 disable truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if not (math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise UsageError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class Rollout:
    """A batch of sampled responses in timlab's (B, S) layout."""

    tokens: torch.Tensor  # (B, S) long: left-padded prompt | response | pad
    key_valid: torch.Tensor  # (B, S) bool: False on left padding only
    response_mask: torch.Tensor  # (B, S) bool: response tokens up to and including EOS
    logprobs: torch.Tensor  # (B, S) fp32: log mu(token) under the model's distribution; 0 off-mask
    sampling_logprobs: torch.Tensor  # (B, S) fp32: log-prob under the sampling distribution
    lengths: torch.Tensor  # (B,) long: response length including EOS
    finished: torch.Tensor  # (B,) bool: ended with EOS within max_new_tokens
    prompt_width: int
    experts: torch.Tensor | None = None
    """MoE models, when asked (``generate(record_routing=True)``): (L, B, S, k) long, the top-k
    experts each of the L sparse layers' routers chose at each column, rank order; -1 where the
    rollout computed nothing (columns after a finished row left the decode batch, the last one)."""

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def responses(self) -> list[list[int]]:
        """Response token ids per sequence, EOS included when present."""
        return [row[m].tolist() for row, m in zip(self.tokens, self.response_mask)]


class NonFiniteLogitsError(TimlabError, ValueError):
    """The model produced NaN/Inf logits while decoding (diverged weights, overflow)."""


def import_backend(module: str, error: type[Exception], message: str):
    """``import module`` for an engine built on an optional package; ``error(message)`` (one line,
    no traceback chain) when the package is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(message) from None


def truncate(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p, on temperature-scaled logits z (B, V): the dropped tokens set to -inf.

    Top-k keeps every token tied with the k-th largest value; top-p keeps the shortest run of
    tokens (largest first) whose probability reaches ``top_p``, and always the first one.
    """
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]  # (B, 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        p = torch.softmax(sorted_z, dim=-1)  # (B, V), largest first
        drop_sorted = p.cumsum(-1) - p >= params.top_p  # keep the first token always
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


_U_MAX = 1.0 - 2.0**-22
"""Upper end of the uniform draws of ``draw_tokens``: with u <= _U_MAX in fp32, u * total < total
for every positive finite total (the rounding error of the product is below total * 2^-24)."""


def uniforms(n: int, generator: torch.Generator, device=None, dtype=torch.float32) -> torch.Tensor:
    """n uniform numbers in [0, _U_MAX] from ``generator``: the draws of ``draw_tokens`` (fp32
    probabilities). On the CPU a draw of n + m numbers gives the numbers of a draw of n, then m."""
    return torch.empty(n, dtype=dtype, device=device).uniform_(0.0, _U_MAX, generator=generator)


def draw_tokens(probs: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs`` (B, V) (non-negative, unnormalized is fine) by inverse CDF.

    Row b takes the b-th of B uniform numbers from ``generator``, u in [0, _U_MAX], scales it by
    the row's total mass and picks the first token whose cumulative mass exceeds it. Since
    u * total < total, that token exists and has a cumulative mass above the previous token's,
    so a token of zero probability is never drawn (cumsum rounding cannot land on one). Same
    generator state, same tokens; row b's token depends only on row b and its number. ``u``
    (B,) fp32, from ``uniforms``: the numbers drawn beforehand (then ``generator`` is not used).
    """
    cdf = probs.cumsum(-1)  # (B, V)
    if u is None:
        u = uniforms(probs.shape[0], generator, cdf.device, cdf.dtype)[:, None]  # (B, 1)
    else:
        u = u.view(-1, 1).to(cdf.dtype, copy=True)  # (B, 1), a copy: mul_ below writes into it
    token = torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True)  # (B, 1): first with cdf > u
    return token.clamp_(max=probs.shape[-1] - 1).squeeze(-1)  # the clamp only matters for NaN rows


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, *, check_finite: bool = True,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: (B, V) fp32.

    Returns token (B,), its log-prob under the model's distribution log_softmax(logits) (B,),
    and its log-prob under the sampling distribution (B,). Order: temperature, top-k, top-p
    (the order HF applies them in); the draw is ``draw_tokens``. ``check_finite=False`` skips the
    NaN/Inf check (and its host sync): the decode loop checks the log-probs of a rollout once
    instead (non-finite logits make a row's log-probs NaN). ``u`` (B,): the draw's uniform numbers,
    drawn beforehand (``draw_tokens``).
    """
    if check_finite and not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogitsError("non-finite values in the rollout's logits")
    logp_model = log_softmax(logits, dim=-1)  # (B, V): the same kernel as the trainer's
    if params.temperature == 0:
        token = logits.argmax(-1)
        lp = logp_model.gather(-1, token[:, None]).squeeze(-1)
        return token, lp, torch.zeros_like(lp)
    if params.temperature == 1.0 and not params.top_k and params.top_p >= 1.0:
        logp_sample = logp_model  # nothing changes the distribution: the same log-probs
    else:
        z = logits / params.temperature if params.temperature != 1.0 else logits
        logp_sample = torch.log_softmax(truncate(z, params), dim=-1)  # (B, V)
    token = draw_tokens(logp_sample.exp(), generator, u)
    lp = logp_model.gather(-1, token[:, None]).squeeze(-1)
    return token, lp, lp if logp_sample is logp_model else logp_sample.gather(-1, token[:, None]).squeeze(-1)


class Engine:
    """Base class: prompt packing, the decode loop's bookkeeping, and the Rollout assembly.

    Subclasses implement ``_prefill`` and ``_decode``; each returns fp32 logits (B, V) for the
    next token. The native engines hold a reference to the model, so weight updates are seen at
    once; engines that keep their own copy (hf) refresh it in ``sync_weights``.
    """

    name = "base"

    def __init__(self, model: CausalLM, *, eos_token_id: int, pad_token_id: int | None = None):
        self.model = model
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(self.eos_token_id if pad_token_id is None else pad_token_id)

    def sync_weights(self) -> None:
        """Called after each optimizer step; engines that keep their own copy refresh it."""

    copies_weights = False
    """True for engines that serve their own copy of the weights (hf, vllm): ``sync_weights``
    records ``_fingerprint()`` in ``_synced``, and a call finding the model changed since syncs again."""

    _synced: tuple | None = None

    def _fingerprint(self) -> tuple:
        """Identity of the model's current weights; any in-place update changes a ``_version``."""
        return tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in self.model.parameters())

    def _sync_if_stale(self) -> None:
        if self.copies_weights and self._fingerprint() != self._synced:
            self.sync_weights()

    # -- layout ---------------------------------------------------------------------------
    def pack(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Left-pad prompts into a (B, S) grid. Returns tokens, key_valid, prompt width P."""
        if not prompts:
            raise UsageError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise UsageError("empty prompt: every prompt needs at least one token")
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        P = max(len(p) for p in prompts)
        S = buffer_length(P, max_new_tokens)
        limit = self.model.config.max_position_embeddings
        if P + max_new_tokens > limit:
            raise UsageError(
                f"prompt length {P} + max_new_tokens {max_new_tokens} exceeds the model's context "
                f"(max_position_embeddings={limit})"
            )
        vocab = self.model.config.vocab_size
        dev = self.model.device
        tokens = torch.full((len(prompts), S), self.pad_token_id, dtype=torch.long, device=dev)
        key_valid = torch.ones(len(prompts), S, dtype=torch.bool, device=dev)
        for b, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise UsageError(f"prompt {b} has token id {bad[0]} outside the model's vocabulary (size {vocab})")
            tokens[b, P - len(p) : P] = torch.tensor(p, dtype=torch.long, device=dev)
            key_valid[b, : P - len(p)] = False
        return tokens, key_valid, P

    # -- subclass hooks -------------------------------------------------------------------
    def _prefill(self, tokens: torch.Tensor, key_valid: torch.Tensor, P: int):  # -> (logits, state)
        raise NotImplementedError

    def _decode(self, state, tokens: torch.Tensor, key_valid: torch.Tensor, col: int) -> torch.Tensor:
        raise NotImplementedError

    compact_below = 0.0
    """Drop finished rows from the decode batch once at most this fraction of the held rows is
    still generating (0 = never). Engines that support it implement ``_select``."""

    def _select(self, state, keep: torch.Tensor):
        """Keep only the rows ``keep`` (bool, (n,)) of the decode state."""
        raise NotImplementedError

    # -- generation ---------------------------------------------------------------------
    records_routing = False
    """True for engines that run timlab's model code and can record an MoE model's expert choices."""

    routing: Routing | None = None
    """While a recording ``generate`` runs: the record the current model call writes into (the
    subclass attaches it to the call's Step)."""

    refuses_logits_processor: str | None = None
    """The one-line error for an engine that cannot apply a timlab ``LogitsProcessor`` (None: it can)."""

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        generator: torch.Generator | None = None,
        logits_processor: LogitsProcessor | None = None,
        record_routing: bool = False,
    ) -> Rollout:
        """Up to ``max_new_tokens`` sampled after each prompt (token ids), drawn with ``generator``
        (default: a fresh one seeded 0) and, where given, ``logits_processor`` applied to the logits.
        ``record_routing`` (MoE models, engines with ``records_routing``): fill ``Rollout.experts``."""
        if logits_processor is not None and self.refuses_logits_processor:
            raise UsageError(self.refuses_logits_processor)
        if record_routing and not (self.records_routing and self.model.config.is_moe):
            raise UsageError(f"engine {self.name!r} cannot record expert routing here: it needs a "
                             "mixture-of-experts model and an engine running timlab's model code (exact, fast)")
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self._sync_if_stale()
        tokens, key_valid, P = self.pack(prompts, max_new_tokens)
        if not record_routing:
            return self._generate(prompts, tokens, key_valid, P, max_new_tokens=max_new_tokens, sampling=sampling,
                                  generator=generator, logits_processor=logits_processor)
        cfg = self.model.config
        sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)]
        experts = torch.full((len(sparse), *tokens.shape, cfg.num_experts_per_tok), -1, dtype=torch.long,
                             device=tokens.device)  # (L, B, S, k)
        self._routing_record = (sparse, experts)
        try:
            r = self._generate(prompts, tokens, key_valid, P, max_new_tokens=max_new_tokens, sampling=sampling,
                               generator=generator, logits_processor=logits_processor)
        finally:
            self._routing_record, self.routing = None, None
        r.experts = experts.to(r.tokens.device)
        return r

    _routing_record: tuple[list[int], torch.Tensor] | None = None

    def _start_call(self) -> None:
        """Before a model call of the decode loop: a fresh routing record when recording."""
        if self._routing_record is not None:
            self.routing = Routing()

    def _end_call(self, rows, start: int, num: int) -> None:
        """After a model call on grid rows ``rows`` (a slice or indices) and columns start..start+num-1:
        copy the call's expert choices into the rollout's record."""
        if self._routing_record is None:
            return
        sparse, experts = self._routing_record
        for j, layer in enumerate(sparse):
            experts[j, rows, start : start + num] = self.routing.chosen[layer]  # (n, num, k)

    def _rollout(self, tokens, key_valid, P: int, *, response_mask, logprobs, sampling_logprobs, finished) -> Rollout:
        """The Rollout of a filled (B, S) grid, on the model's device."""
        dev = self.model.device
        return Rollout(
            tokens=tokens.to(dev),
            key_valid=key_valid.to(dev),
            response_mask=response_mask.to(dev),
            logprobs=logprobs.to(dev),
            sampling_logprobs=sampling_logprobs.to(dev),
            lengths=response_mask.sum(-1).to(dev),
            finished=finished.to(dev),
            prompt_width=P,
        )

    def _generate(self, prompts: list[list[int]], tokens: torch.Tensor, key_valid: torch.Tensor, P: int, *,
                  max_new_tokens: int, sampling: SamplingParams, generator: torch.Generator,
                  logits_processor: LogitsProcessor | None) -> Rollout:
        """The decode loop on the packed (B, S) grid (``_prefill``, then ``_decode`` per token).

        Per step it only writes column ``col`` of the grids (finished rows get pad, log-prob 0,
        mask False) and reads the host once (are all rows done?); the non-finite check runs once,
        on the rollout's log-probs."""
        B, S = tokens.shape
        dev = tokens.device
        logp = torch.zeros(B, S, dtype=torch.float32, device=dev)
        logp_s = torch.zeros(B, S, dtype=torch.float32, device=dev)
        mask = torch.zeros(B, S, dtype=torch.bool, device=dev)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        rows = None  # the full-batch rows the decode state holds, in order (None: all B)
        live = ~finished  # (n,): held rows still generating
        held_valid = key_valid
        self._start_call()
        logits, state = self._prefill(tokens, key_valid, P)
        self._end_call(slice(None), 0, P)
        for i in range(max_new_tokens):
            col = P + i
            if logits_processor is not None:
                logits = call_processor(logits_processor, logits, col,
                                        lambda: (tokens if rows is None else tokens[rows])[:, :col])  # (n, col)
            tok, lp, lps = sample_next(logits, sampling, generator, check_finite=False)  # (n,) each
            tok = torch.where(live, tok, self.pad_token_id)
            ended = live & (tok == self.eos_token_id)
            held = slice(None) if rows is None else rows  # the grid rows the decode batch holds
            tokens[held, col] = tok
            logp[held, col] = torch.where(live, lp, 0.0)
            logp_s[held, col] = torch.where(live, lps, 0.0)
            mask[held, col] = live
            finished[held] |= ended
            live = live & ~ended
            if i == max_new_tokens - 1:
                break
            n_live = int(live.sum())  # the step's one host read
            if n_live == 0:  # rows not held are finished
                break
            if self.compact_below > 0 and n_live <= self.compact_below * live.shape[0]:
                # Drop finished rows from the decode batch. Exactness is unaffected: every op
                # of the exact path gives a row the same bits whatever rows share its batch.
                state = self._select(state, live)
                rows = (torch.arange(B, device=dev) if rows is None else rows)[live]
                held_valid = key_valid[rows]
                live = live[live]
            self._start_call()
            logits = self._decode(state, tokens if rows is None else tokens[rows], held_valid, col)
            self._end_call(slice(None) if rows is None else rows, col, 1)
        if not bool(torch.isfinite(logp[mask]).all()):  # NaN/Inf logits make a row's log-probs NaN
            raise NonFiniteLogitsError("non-finite values in the rollout's logits")
        return self._rollout(tokens, key_valid, P, response_mask=mask, logprobs=logp, sampling_logprobs=logp_s,
                             finished=finished)


@contextlib.contextmanager
def full_batch_decode(*engines: Engine) -> Iterator[None]:
    """Keep every row in the decode batch until the end (no compaction of finished rows).

    Then each decode step draws the same random numbers for the same row whatever the other
    rows did, so two engines sampled with equal generator seeds are coupled row by row (common
    random numbers), and a logits processor sees all B rows at every step.
    """
    saved = [e.__dict__.get("compact_below") for e in engines]
    try:
        for e in engines:
            e.compact_below = 0.0
        yield
    finally:
        for e, old in zip(engines, saved):
            if old is None:
                e.__dict__.pop("compact_below", None)
            else:
                e.compact_below = old
