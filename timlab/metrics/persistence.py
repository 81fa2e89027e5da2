"""How long a mismatch's bias points one way: its persistence across training steps (pure torch).

k3 measures the size of a mismatch at one step. Studies P1 and P2 (docs/FINDINGS.md) found a second
axis it does not see: at one held k3, and again at one held perturbation size, a bias that points
the same way for the whole run costs about three times what one redrawn every step costs. These
statistics put a number on that axis from what a trainer holds each step, with no extra forward
pass. The tokens differ from step to step, so the bias is compared per vocabulary entry:

- m_s(v): the mean log-ratio r = log pi - log mu over the valid tokens of step s whose id is v.
- ``mismatch/persistence_lag1``: the Pearson correlation over the vocabulary entries seen at both
  steps between m_s and m_{s-1}. A bias that favours the same tokens step after step gives ~1; a
  fresh direction every step gives ~0.
- ``mismatch/persistence_ema``: the same correlation between m_s and an exponential moving average
  of the earlier steps' per-entry sums and counts (weight ``EMA_ALPHA`` on the newest step, a
  horizon of ~10 steps). A direction redrawn every 25 steps stays near 1 at lag 1 but falls here
  after each redraw, so this one separates persistence over several steps too.

- ``mismatch/persistence_reliability``: how much of one step's m_s is signal rather than sampling
  noise: the correlation of m computed on the even and on the odd sequences of the step, stepped
  up to the whole step (Spearman-Brown, 2c / (1 + c)). A low persistence with a high reliability
  says the bias changes direction between steps; with a low reliability, that it cannot be seen.

Each is NaN on the first step (the reliability excepted), where fewer than ``MIN_SHARED`` entries
were seen at both, or where either side is constant (the zero-mismatch setting, where r is
exactly 0 everywhere). Inputs are
(B, T) as everywhere in ``timlab.metrics`` plus the token ids (B, T); ``PersistenceTracker`` keeps
the state between steps, and its ``state_dict`` goes into checkpoints so that a resumed run logs
what an uninterrupted one does. Not from a paper; whether it predicts harm out of sample is open
(docs/metrics.md, "persistence").
"""

from __future__ import annotations

import math

import torch

from timlab.errors import UsageError
from timlab.metrics._inputs import check_inputs

EMA_ALPHA = 0.1
"""Weight of the newest step in ``mismatch/persistence_ema``'s moving average (horizon ~10 steps)."""

MIN_SHARED = 3
"""Fewest vocabulary entries seen on both sides for a correlation; NaN below it."""

PERSISTENCE_KEYS = ("mismatch/persistence_lag1", "mismatch/persistence_ema", "mismatch/persistence_reliability")
"""Keys ``PersistenceTracker.update`` returns."""


def _valid_ratios(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The valid tokens' ids, their r = log pi - log mu and their sequence (row) indices, each (N,),
    in row-major order; the inputs checked once."""
    p = check_inputs(train_logp, rollout_logp, mask)
    if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != tuple(p.valid.shape):
        raise UsageError(f"tokens must be a tensor of shape {tuple(p.valid.shape)} like the log-probs, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    ids = tokens.to(p.valid.device)[p.valid].long()  # (N,)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise UsageError(f"tokens holds ids outside [0, {vocab_size}) at valid positions")
    rows = p.valid.nonzero()[:, 0]  # (N,) the sequence of each valid token
    return ids, (p.train - p.rollout)[p.valid], rows


def _sums(ids: torch.Tensor, r: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per vocabulary entry, the sum of ``r`` over the tokens with that id, and their count (float64)."""
    sums = torch.zeros(vocab_size, dtype=torch.float64, device=r.device).index_add_(0, ids, r)
    counts = torch.zeros(vocab_size, dtype=torch.float64, device=r.device).index_add_(0, ids, torch.ones_like(r))
    return sums, counts


def token_sums(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor,
               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per vocabulary entry, the sum of r = log pi - log mu over the valid tokens with that id, and
    their count: two float64 (vocab_size,) tensors."""
    with torch.no_grad():
        ids, r, _ = _valid_ratios(train_logp, rollout_logp, mask, tokens, vocab_size)
        return _sums(ids, r, vocab_size)


def correlation(sums_a: torch.Tensor, counts_a: torch.Tensor, sums_b: torch.Tensor, counts_b: torch.Tensor) -> float:
    """Pearson correlation over the entries counted on both sides between their mean log-ratios;
    NaN with fewer than ``MIN_SHARED`` such entries or a constant side."""
    shared = (counts_a > 0) & (counts_b > 0)
    if int(shared.sum()) < MIN_SHARED:
        return math.nan
    a = sums_a[shared] / counts_a[shared]
    b = sums_b[shared] / counts_b[shared]
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float(a.dot(b)) / den if den > 0 else math.nan


class PersistenceTracker:
    """The state behind ``PERSISTENCE_KEYS``: the last step's per-entry sums and counts, and their
    moving average over the earlier steps."""

    def __init__(self, vocab_size: int, alpha: float = EMA_ALPHA):
        if vocab_size < 1 or not 0 < alpha <= 1:
            raise UsageError(f"PersistenceTracker: vocab_size {vocab_size} must be >= 1 and alpha {alpha} in (0, 1]")
        self.vocab_size, self.alpha = vocab_size, alpha
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.ema: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
               tokens: torch.Tensor) -> dict[str, float]:
        """This step's persistence against the last step and the moving average; then take it in."""
        with torch.no_grad():
            ids, r, rows = _valid_ratios(train_logp, rollout_logp, mask, tokens, self.vocab_size)
        sums, counts = _sums(ids, r, self.vocab_size)
        even = rows % 2 == 0  # (N,) the tokens of the even sequences
        half = correlation(*_sums(ids[even], r[even], self.vocab_size), *_sums(ids[~even], r[~even], self.vocab_size))
        out = {PERSISTENCE_KEYS[0]: math.nan if self.last is None else correlation(sums, counts, *self.last),
               PERSISTENCE_KEYS[1]: math.nan if self.ema is None else correlation(sums, counts, *self.ema),
               PERSISTENCE_KEYS[2]: 2 * half / (1 + half) if half > -1 else math.nan}
        sums, counts = sums.cpu(), counts.cpu()
        self.last = (sums, counts)
        if self.ema is None:
            self.ema = (sums.clone(), counts.clone())
        else:
            a = self.alpha
            self.ema = ((1 - a) * self.ema[0] + a * sums, (1 - a) * self.ema[1] + a * counts)
        return out

    def state_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "alpha": self.alpha, "last": self.last, "ema": self.ema}

    def load_state_dict(self, state: dict) -> None:
        if state.get("vocab_size") != self.vocab_size:
            raise UsageError(f"persistence state for a vocabulary of {state.get('vocab_size')}, not {self.vocab_size}")
        self.alpha, self.last, self.ema = state["alpha"], state["last"], state["ema"]


__all__ = ["EMA_ALPHA", "MIN_SHARED", "PERSISTENCE_KEYS", "token_sums", "correlation", "PersistenceTracker"]
