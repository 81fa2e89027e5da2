"""The native engines' decode loop with its bookkeeping on the device, for GPU speed.

Used by ``timlab.engines.native`` when an engine's ``device_loop`` is a ``DeviceLoop``; the loop
it replaces is ``Engine._generate`` (``timlab.engines.base``, "the host loop"), which reads the
host once per step (are all rows done, should finished rows leave the batch?). On a GPU that read
drains the launch queue every step, and a step whose batch size changes whenever rows finish
cannot be captured as one CUDA graph. Here:

- Sampling, EOS detection, the finished flags and the grids (tokens, log-probs, response mask;
  lengths are the mask's row sums) are tensors updated in place at each step's column. The host
  reads the device once every ``sync_every`` steps: it stops when every row has finished and
  moves the live rows to a smaller bucket when they fit one.
- The decode batch holds a bucket's number of rows (``bucket_for``): the live rows, then padding
  rows that copy a held row's state and write to a scratch row of the grids, dropped at the end.
  In the exact mode every op gives a row the same bits whatever rows share its batch
  (``timlab.model.ops``, ``timlab.kernels``), so padding and the moment of compaction change no
  held row's bits.
- Random numbers. The host loop's step draws one uniform number per row it holds, and which rows
  it holds follows its compaction rule (``Engine.compact_below``), applied every step. This loop
  draws every number that loop could use at once (B x max_new_tokens), replays the rule on the
  device to know which number each row takes (``_HostLoopDraws``), and leaves the generator where
  the host loop leaves it. On the CPU a draw of n + m numbers gives the numbers of a draw of n,
  then m, so the exact engine's rollouts (tokens, log-probs, generator state) equal the host
  loop's bit for bit, for any bucket sizes and any ``sync_every`` (tests/test_device_loop.py).
  On CUDA the Philox generator's offsets do not add up that way: the tokens are as random, but
  other ones than the host loop's for the same seed; the log-probs still equal the trainer's.
- The fast mode's stock kernels give a row other bits in another batch, so its rollouts here are
  close to the host loop's, not equal.

``DeviceLoop(cuda_graphs=True)`` runs the model's decode step on static buffers, one set per
(bucket, buffer length), through ``GraphedStep``: on CUDA it is captured once as a
``torch.cuda.CUDAGraph`` and replayed; elsewhere the same static-buffer step runs eagerly (the
capture is skipped). Mixture-of-experts models route tokens with data-dependent shapes, so their
step is never captured, and their decode steps read the host inside the MoE block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from timlab.engines.base import NonFiniteLogitsError, Rollout, SamplingParams, sample_next, uniforms
from timlab.errors import UsageError
from timlab.model.llama import KVCache, Step

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Decode batch sizes: powers of two, one captured graph each (vLLM captures a similar ladder)."""


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The decode batch size that holds ``rows`` rows: the smallest of ``buckets`` (ascending) that
    is at least ``rows``, else ``rows`` rounded up to a multiple of the largest."""
    for b in buckets:
        if b >= rows:
            return b
    top = buckets[-1]
    return -(-rows // top) * top


@dataclass(frozen=True)
class DeviceLoop:
    """Settings of the device-side decode loop (``ExactEngine.device_loop``, ``FastEngine.device_loop``)."""

    sync_every: int = 8
    """Steps between the loop's host reads (its only host syncs): at each it stops if every row
    has finished and moves the live rows to a smaller bucket. Each read idles the GPU for one
    launch round trip; between reads up to sync_every - 1 steps run for rows already finished."""
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    """Decode batch sizes, ascending; a batch is padded to the smallest that holds it (``bucket_for``)."""
    cuda_graphs: bool = False
    """Replay the model's decode step as one captured CUDA graph per bucket (``GraphedStep``);
    on other devices, and for mixture-of-experts models, the same static-buffer step runs eagerly."""

    def __post_init__(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise UsageError(f"device_loop.sync_every must be an integer >= 1, got {self.sync_every!r}")
        buckets = tuple(self.buckets)
        if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets) \
                or list(buckets) != sorted(set(buckets)):
            raise UsageError(f"device_loop.buckets must be distinct integers >= 1 in ascending order, got {self.buckets!r}")
        object.__setattr__(self, "buckets", buckets)


DECODE_LOOPS = ("host", "device", "graphs")
"""``rollout.decode_loop``'s choices: the engine's host loop, ``DeviceLoop``, ``DeviceLoop`` with CUDA graphs."""
NATIVE_ENGINES = ("exact", "fast")
"""The engines with a ``device_loop`` (``timlab.engines.native``)."""


def loop_for(choice: str, *, engine: str, sync_every: int = DeviceLoop.sync_every,
             names: tuple[str, str] = ("rollout.decode_loop", "rollout.engine")) -> DeviceLoop | None:
    """The ``DeviceLoop`` that ``choice`` (one of ``DECODE_LOOPS``) asks for on the engine named
    ``engine``, None for the host loop; a one-line error, naming the setting and the engine's by
    ``names``, for another choice or a non-native engine."""
    if choice not in DECODE_LOOPS:
        raise UsageError(f"unknown {names[0]} {choice!r}; valid choices: {', '.join(DECODE_LOOPS)}")
    if choice == "host":
        return None
    if engine not in NATIVE_ENGINES:
        raise UsageError(f"{names[0]} {choice} needs a native engine; {names[1]} is {engine!r} "
                         f"(valid choices: {', '.join(NATIVE_ENGINES)}, or {names[0]} host)")
    return DeviceLoop(sync_every=sync_every, cuda_graphs=choice == "graphs")


def use_loop(loop: DeviceLoop | None, *engines) -> None:
    """Give each engine (None entries skipped) ``loop``; an engine without a device loop (an
    injector's hf or vllm engine) is a one-line error unless ``loop`` is None."""
    for engine in engines:
        if engine is None:
            continue
        if not hasattr(engine, "device_loop"):
            if loop is None:
                continue
            raise UsageError(f"the device decode loop needs a native engine ({', '.join(NATIVE_ENGINES)}); this run "
                             f"rolls out with {type(engine).__name__}: use the host loop")
        engine.device_loop = loop


class _HostLoopDraws:
    """The uniform numbers the host loop gives each row, replayed on the device.

    The host loop's step i draws one number per row it holds, in row order, and holds every row
    until, after a step, at most ``compact_below`` of the held rows are live; then it holds the
    live ones. It stops drawing once no row is live. This draws all B x T numbers at once and
    tracks on the device which rows that loop holds and how many numbers it has drawn.
    """

    def __init__(self, B: int, T: int, compact_below: float, generator: torch.Generator, device):
        self.generator, self.saved = generator, generator.get_state()
        self.pool = uniforms(B * T, generator, device)  # (B*T,)
        self.compact_below = compact_below
        self.held = torch.ones(B + 1, dtype=torch.bool, device=device)  # (B+1,): the host loop's rows;
        self.held[B] = False  # the scratch row, never held
        self.count = torch.tensor(B, device=device)  # how many rows it holds
        self.used = torch.tensor(0, device=device)  # numbers it has drawn
        self.drawing = torch.tensor(True, device=device)  # whether it runs the current step

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) fp32: this step's number for each grid row in ``rows`` (n,) (scratch: any)."""
        rank = self.held.cumsum(0) - 1  # (B+1,): a held row's place among the held rows
        return self.pool[(self.used + rank[rows]).clamp_(0, self.pool.numel() - 1)]

    def advance(self, live: torch.Tensor) -> None:
        """After a step, with ``live`` (B,) the rows still generating: the host loop's draws and rows."""
        self.used = self.used + torch.where(self.drawing, self.count, 0)
        n_live = live.sum()
        if self.compact_below > 0:  # the host loop's rule, in float64 as Python compares it
            compact = self.drawing & (n_live > 0) & (n_live.double() <= self.count.double() * self.compact_below)
            self.held[:-1] = torch.where(compact, live, self.held[:-1])
            self.count = torch.where(compact, n_live, self.count)
        self.drawing = self.drawing & (n_live > 0)

    def finish(self) -> None:
        """Leave the generator where the host loop leaves it (one host read)."""
        used = int(self.used)
        self.generator.set_state(self.saved)
        uniforms(used, self.generator, self.pool.device)


class GraphedStep:
    """The model's decode step for one bucket (``rows`` rows, an S-long buffer) on static buffers.

    Inputs are copied into fixed tensors before each call (token ids, the column, its positions,
    RoPE values and mask row); the key/value write goes to a device column (``Step.write_at``) and
    attention runs over all S columns. On CUDA the step is captured once as a CUDA graph (after
    ``WARMUP_CALLS`` eager calls, which compile the Triton kernels) and replayed; otherwise it runs
    eagerly on the same buffers. The graph reads the model's parameters in place, so optimizer
    steps are seen; a model whose parameters move (``.to``) needs new graphs (``GraphedSteps``).
    """

    WARMUP_CALLS = 2

    def __init__(self, model, mode: str, rows: int, length: int, pool=None):
        cfg, dev, dtype = model.config, model.device, model.dtype
        self.model, self.mode, self.pool = model, mode, pool
        self.cache = KVCache.empty(cfg, rows, length, dtype, dev)
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.column = torch.zeros(1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.cos = torch.zeros(rows, 1, 1, cfg.dim_per_head, dtype=dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.allowed = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=dev)
        self.capture = dev.type == "cuda" and not cfg.is_moe
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def load(self, cache: KVCache, index: torch.Tensor) -> KVCache:
        """Copy the rows ``index`` (long, (rows,)) of ``cache`` into the static cache; returns it."""
        for dst, src in zip(self.cache.keys + self.cache.values, cache.keys + cache.values):
            torch.index_select(src, 0, index, out=dst)
        return self.cache

    def _forward(self, start: int) -> torch.Tensor:
        step = Step(positions=self.positions, start=start, allowed=self.allowed, cos=self.cos, sin=self.sin,
                    write_at=self.column)
        h = self.model.hidden_states(self.ids, step, self.cache, self.mode)
        return self.model.logits_from_hidden(h[:, -1], self.mode)  # (rows, V)

    def __call__(self, state, ids: torch.Tensor, col: int) -> torch.Tensor:
        """Logits (rows, V) after the tokens ``ids`` (rows, 1) at column ``col`` of ``state``."""
        s = state.step(col, True)  # the column's positions, RoPE values and mask row over all S keys
        self.ids.copy_(ids)
        self.column.fill_(col)
        self.positions.copy_(s.positions)
        self.cos.copy_(s.cos)
        self.sin.copy_(s.sin)
        self.allowed.copy_(s.allowed)
        if not self.capture:
            return self._forward(col)
        if self.graph is None:
            self._capture(col)
        self.graph.replay()
        return self.logits

    def _capture(self, col: int) -> None:
        """Warm up on a side stream, then record ``_forward``. The warm-up calls rewrite column
        ``col``'s keys and values with the same values; the capture itself runs nothing."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_CALLS):
                self._forward(col)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.logits = self._forward(col)


class GraphedSteps:
    """An engine's ``GraphedStep`` per (rows, buffer length), kept across rollouts, all captured
    into one memory pool; rebuilt when the model's parameters move or change dtype."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: dict[tuple[int, int], GraphedStep] = {}
        self.key: tuple | None = None
        self.pool = None

    def get(self, rows: int, length: int) -> GraphedStep:
        model = self.engine.model
        key = (self.engine.mode, tuple((p.data_ptr(), p.dtype) for p in model.parameters()))
        if key != self.key:  # new weights' storage: captured graphs would read the old one
            self.steps.clear()
            self.key = key
            self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        if (rows, length) not in self.steps:
            self.steps[(rows, length)] = GraphedStep(model, self.engine.mode, rows, length, self.pool)
        return self.steps[(rows, length)]

    def place(self, state, keep: torch.Tensor):
        """The decode state of the rows ``keep`` with its cache in the bucket's static one."""
        step = self.get(keep.shape[0], state.cache.length)
        return state.select(keep, cache=step.load(state.cache, keep))

    def __call__(self, state, ids: torch.Tensor, col: int) -> torch.Tensor:
        return self.get(ids.shape[0], state.cache.length)(state, ids, col)


class _EagerSteps:
    """The model's decode step as the host loop runs it, on the rollout's own buffers."""

    def __init__(self, engine):
        self.engine = engine

    def place(self, state, keep: torch.Tensor):
        return state.select(keep)

    def __call__(self, state, ids: torch.Tensor, col: int) -> torch.Tensor:
        return self.engine._decode_ids(state, ids, col)


def steps_for(engine, loop: DeviceLoop):
    """The decode-step runner of ``engine`` under ``loop``."""
    if not loop.cuda_graphs:
        return _EagerSteps(engine)
    if getattr(engine, "_graphed_steps", None) is None:
        engine._graphed_steps = GraphedSteps(engine)
    return engine._graphed_steps


class _Grids:
    """The rollout's (B + 1, S) buffers, written one column per step; row B is the scratch row
    that padding slots write to."""

    def __init__(self, tokens: torch.Tensor, pad: int):
        B, S = tokens.shape
        dev = tokens.device
        self.tokens = torch.cat([tokens, tokens.new_full((1, S), pad)])  # (B+1, S)
        self.logp = torch.zeros(B + 1, S, dtype=torch.float32, device=dev)
        self.logp_s = torch.zeros(B + 1, S, dtype=torch.float32, device=dev)
        self.mask = torch.zeros(B + 1, S, dtype=torch.bool, device=dev)
        self.finished = torch.zeros(B + 1, dtype=torch.bool, device=dev)


@torch.no_grad()
def generate(engine, tokens: torch.Tensor, key_valid: torch.Tensor, P: int, *, max_new_tokens: int,
             sampling: SamplingParams, generator: torch.Generator, loop: DeviceLoop) -> Rollout:
    """The rollout of the packed (B, S) grid (``Engine.pack``) by ``engine`` (a native engine:
    ``_prefill``, ``_decode_ids``, decode states with ``select``)."""
    B = tokens.shape[0]
    grids = _Grids(tokens, engine.pad_token_id)
    draws = None if sampling.temperature == 0 else _HostLoopDraws(B, max_new_tokens, engine.compact_below,
                                                                  generator, tokens.device)
    logits, state = engine._prefill(tokens, key_valid, P)  # (B, V)
    decode_loop(engine, steps_for(engine, loop), loop, grids, draws, state, logits, P=P,
                max_new_tokens=max_new_tokens, sampling=sampling)
    if draws is not None:
        draws.finish()
    logp, mask = grids.logp[:B], grids.mask[:B]
    if not bool(torch.isfinite(logp[mask]).all()):  # NaN/Inf logits make a row's log-probs NaN
        raise NonFiniteLogitsError("non-finite values in the rollout's logits")
    return engine._rollout(grids.tokens[:B], key_valid, P, response_mask=mask, logprobs=logp,
                           sampling_logprobs=grids.logp_s[:B], finished=grids.finished[:B])


def decode_loop(engine, steps, loop: DeviceLoop, grids: _Grids, draws: _HostLoopDraws | None, state,
                logits: torch.Tensor, *, P: int, max_new_tokens: int, sampling: SamplingParams) -> None:
    """Fill columns P.. of ``grids`` from the prefill's ``logits`` (B, V) and decode ``state``.

    The host reads the device only every ``loop.sync_every`` steps (``live.nonzero()``); every
    other step is a fixed sequence of device ops on a bucket's number of rows."""
    B = grids.finished.shape[0] - 1
    dev = logits.device
    pad, eos = engine.pad_token_id, engine.eos_token_id
    slots = bucket_for(B, loop.buckets)
    rows = torch.arange(slots, device=dev).clamp_(max=B)  # (slots,): the grid row each slot writes
    live = rows < B  # (slots,): slots whose row is still generating
    if slots > B or loop.cuda_graphs:
        keep = torch.where(live, rows, 0)  # padding slots copy row 0
        state, logits = steps.place(state, keep), logits[keep]
    for i in range(max_new_tokens):
        col = P + i
        u = None if draws is None else draws.take(rows)
        tok, lp, lps = sample_next(logits, sampling, None, check_finite=False, u=u)  # (slots,) each
        tok = torch.where(live, tok, pad)
        ended = live & (tok == eos)
        grids.tokens[rows, col] = tok
        grids.logp[rows, col] = torch.where(live, lp, 0.0)
        grids.logp_s[rows, col] = torch.where(live, lps, 0.0)
        grids.mask[rows, col] = live
        grids.finished[rows] = grids.finished[rows] | ended
        live = live & ~ended
        if draws is not None:
            draws.advance(~grids.finished[:B])
        if i == max_new_tokens - 1:
            break
        if (i + 1) % loop.sync_every == 0:
            held = live.nonzero().squeeze(1)  # the loop's one host read every sync_every steps
            n = held.shape[0]
            if n == 0:
                break
            target = bucket_for(n, loop.buckets)
            if engine.compact_below > 0 and target < slots:  # the live rows, then copies of the first
                keep = torch.cat([held, held[:1].expand(target - n)])
                state, tok = steps.place(state, keep), tok[keep]
                rows = torch.cat([rows[held], rows.new_full((target - n,), B)])
                live = torch.arange(target, device=dev) < n
                slots = target
        logits = steps(state, tok[:, None], col)  # (slots, V)
