"""timlab's own KV-cached engines: ``exact`` (bitwise equal to the trainer) and ``fast``.

Both run the same model code and the same decode loop; they differ only in the numeric path
(``timlab.model.llama``): ``exact`` uses batch-invariant linears and fixed-length attention over
the S-long KV buffer, exactly what the trainer's forward uses; ``fast`` uses stock linears on
the rows at hand and SDPA over the keys written so far, like a production engine.
"""

from __future__ import annotations

import torch

from timlab.engines import device_loop
from timlab.engines.base import ENGINES, Engine
from timlab.engines.device_loop import DeviceLoop
from timlab.model.forward import MIN_SKIP_MACS, attention_mask, positions_from_valid
from timlab.model.llama import KVCache, Step


MAX_MASK_ELEMENTS = 1 << 26
"""Build a rollout's whole (B, 1, S, S) attention mask once when it has at most this many elements
(64 MiB of bool); above it each decode step builds its (B, 1, 1, S) row."""


class _DecodeState:
    """What the decode steps of one rollout share: the KV cache; built once per rollout, the
    positions, RoPE cos/sin and attention mask of every column, which each step slices (views);
    and the exact attention's reusable buffers (``Step.workspace``)."""

    __slots__ = ("cache", "key_valid", "positions", "cos", "sin", "allowed", "workspace")

    def __init__(self, cache: KVCache, key_valid, positions, cos, sin, allowed):
        self.cache, self.key_valid, self.positions = cache, key_valid, positions
        self.cos, self.sin, self.allowed = cos, sin, allowed
        self.workspace: dict = {}  # buffers sized for this batch; a select() starts a new one

    @classmethod
    def build(cls, model, cache: KVCache, key_valid: torch.Tensor) -> "_DecodeState":
        B, S = key_valid.shape
        positions = positions_from_valid(key_valid)  # (B, S)
        cos, sin = model.rope_at(positions, model.dtype)  # (B, 1, S, D)
        allowed = attention_mask(key_valid, 0, S) if B * S * S <= MAX_MASK_ELEMENTS else None  # (B, 1, S, S)
        return cls(cache, key_valid, positions, cos, sin, allowed)

    def select(self, keep: torch.Tensor, cache: KVCache | None = None) -> "_DecodeState":
        """The rows ``keep`` (a bool mask or indices, repeats allowed); ``cache``: theirs, already gathered."""
        return _DecodeState(self.cache.rows(keep) if cache is None else cache, self.key_valid[keep],
                            self.positions[keep], self.cos[keep], self.sin[keep],
                            None if self.allowed is None else self.allowed[keep])

    def step(self, col: int, exact: bool) -> Step:
        """The Step of the decode call at column ``col``: the same values as ``_step(key_valid, col, 1)``."""
        width = self.key_valid.shape[1] if exact else col + 1
        if self.allowed is not None:
            allowed = self.allowed[:, :, col : col + 1, :width]  # (B, 1, 1, width)
        else:
            allowed = attention_mask(self.key_valid, col, 1, width)
        return Step(positions=self.positions[:, col : col + 1], start=col, allowed=allowed,
                    cos=self.cos[:, :, col : col + 1], sin=self.sin[:, :, col : col + 1], workspace=self.workspace)


class _KVCachedEngine(Engine):
    mode = "exact"
    records_routing = True
    compact_below = 0.75

    def _select(self, state: _DecodeState, keep: torch.Tensor) -> _DecodeState:
        return state.select(keep)

    def _step(self, key_valid: torch.Tensor, start: int, num: int) -> Step:
        width = key_valid.shape[1] if self.mode == "exact" else start + num
        positions = positions_from_valid(key_valid)[:, start : start + num]
        return Step(positions=positions, start=start, allowed=attention_mask(key_valid, start, num, width))

    share_prefill = False
    """Prefill each distinct prompt once and copy its KV cache and logits to the rows that share
    it (the samples of a group), when that saves at least ``forward.MIN_SKIP_MACS``. Only where
    the prefill is batch-invariant (the exact mode)."""

    def _prefill(self, tokens, key_valid, P):
        B, S = tokens.shape
        first, inverse = None, None
        full_valid = key_valid
        if self.share_prefill and not self.model.hooks:  # op hooks record one row per sequence
            key = torch.cat([tokens[:, :P], key_valid[:, :P].long()], dim=1)  # (B, 2P): a row's prompt
            _, inverse = torch.unique(key, dim=0, return_inverse=True)  # (B,): which distinct prompt
            n = int(inverse.max()) + 1
            if n < B and (B - n) * P * self.model.config.layer_macs_per_token >= MIN_SKIP_MACS:  # first row of each
                rows = torch.arange(B, device=tokens.device)
                first = torch.full((n,), B, device=tokens.device).scatter_reduce(0, inverse, rows, "amin")
                tokens, key_valid = tokens[first], key_valid[first]  # (n, S)
        cache = KVCache.empty(self.model.config, tokens.shape[0], S, self.model.dtype, self.model.device)
        step = self._step(key_valid, 0, P)
        step.routing = self.routing  # None unless the decode loop records MoE routing
        h = self.model.hidden_states(tokens[:, :P], step, cache, self.mode)
        logits = self.model.logits_from_hidden(h[:, -1], self.mode)  # (n, V)
        if first is not None:  # back to one row per sequence: (B, ...)
            logits = logits[inverse]
            cache = cache.rows(inverse)
            if self.routing is not None:
                self.routing.chosen = {i: t[inverse] for i, t in self.routing.chosen.items()}
        return logits, _DecodeState.build(self.model, cache, full_valid)  # (B, V), the decode state

    def _decode(self, state: _DecodeState, tokens, key_valid, col):
        """Logits (B, V) after column ``col``; the held rows' ``key_valid`` is the state's own."""
        return self._decode_ids(state, tokens[:, col : col + 1], col)

    def _decode_ids(self, state: _DecodeState, ids: torch.Tensor, col: int) -> torch.Tensor:
        """Logits (B, V) after the tokens ``ids`` (B, 1) at column ``col``."""
        step = state.step(col, self.mode == "exact")
        step.routing = self.routing
        h = self.model.hidden_states(ids, step, state.cache, self.mode)
        return self.model.logits_from_hidden(h[:, -1], self.mode)  # (B, V)

    device_loop: DeviceLoop | None = None
    """None: the decode loop of ``Engine._generate`` (a host read every step). A ``DeviceLoop``:
    its loop, with the bookkeeping on the device (``timlab.engines.device_loop``), for rollouts
    without a logits processor, routing record or op hooks."""

    def _generate(self, prompts, tokens, key_valid, P, *, max_new_tokens, sampling, generator, logits_processor):
        loop = self.device_loop
        if loop is None or logits_processor is not None or self._routing_record is not None or self.model.hooks:
            return super()._generate(prompts, tokens, key_valid, P, max_new_tokens=max_new_tokens, sampling=sampling,
                                     generator=generator, logits_processor=logits_processor)
        return device_loop.generate(self, tokens, key_valid, P, max_new_tokens=max_new_tokens, sampling=sampling,
                                    generator=generator, loop=loop)


@ENGINES.register("exact")
class ExactEngine(_KVCachedEngine):
    """KV-cached decoding whose log-probs are bitwise equal to the trainer's forward."""

    name = "exact"
    mode = "exact"
    share_prefill = True  # exact: a row's prefill bits do not depend on the other rows


@ENGINES.register("fast")
class FastEngine(_KVCachedEngine):
    """The ordinary production path: SDPA, stock matmuls, a growing KV cache. Small real TIM."""

    name = "fast"
    mode = "fast"
