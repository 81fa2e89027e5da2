"""Teacher-forced scoring and the mask/position bookkeeping shared by trainer and engines.

Layout convention used everywhere in timlab: a batch is a (B, S) token grid. Prompts are
left-padded to a common width P, responses start at column P, and S is a fixed buffer length
(prompt width + max new tokens, rounded up to a multiple of 16). ``key_valid`` (B, S) is False
only on left padding; positions are counted over valid columns, so padding never shifts RoPE.
A query may attend to valid keys at or before its own column, and always to itself (so padded
rows stay finite and their gradients stay zero).
"""

from __future__ import annotations

import torch

from timlab.model.llama import CausalLM, Step
from timlab.model.moe import Routing
from timlab.model.ops import log_softmax

BUFFER_MULTIPLE = 16

MIN_SKIP_MACS = 1 << 24
"""Skip unneeded positions (``token_logprobs(score_mask=...)``) only when that saves at least this
many multiply-adds; below it the gathers and scatters cost more than they save (measured on the
smoke preset's 45k-parameter model: bench/RESULTS.md)."""


def buffer_length(prompt_width: int, max_new_tokens: int) -> int:
    """S for a batch: prompt width + new tokens, rounded up to a multiple of 16."""
    n = prompt_width + max_new_tokens
    return -(-n // BUFFER_MULTIPLE) * BUFFER_MULTIPLE


def teacher_forced_batch(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, key_valid, completion_mask), each (B, P + longest completion): prompts left-padded
    to a common width P, each completion from column P, right-padded with ``pad_token_id``."""
    P = max(len(p) for p in prompts)
    S = P + max(len(c) for c in completions)
    B = len(prompts)
    tokens = torch.full((B, S), pad_token_id, dtype=torch.long)
    key_valid = torch.ones(B, S, dtype=torch.bool)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        tokens[b, P - len(p) : P] = torch.tensor(p)
        key_valid[b, : P - len(p)] = False
        tokens[b, P : P + len(c)] = torch.tensor(c)
        mask[b, P : P + len(c)] = True
    return tokens, key_valid, mask


def positions_from_valid(key_valid: torch.Tensor) -> torch.Tensor:
    """RoPE positions (B, S): index among valid columns; 0 on left padding."""
    return (key_valid.long().cumsum(-1) - 1).clamp(min=0)


def attention_mask(key_valid: torch.Tensor, start: int, num_queries: int, width: int | None = None) -> torch.Tensor:
    """(B, 1, M, W) bool: query at column start+i may see valid key j <= start+i, and itself.

    W is the number of key columns (the buffer length S by default); columns beyond
    key_valid's width count as not valid.
    """
    B, S = key_valid.shape
    W = S if width is None else width
    dev = key_valid.device
    if W > S:
        key_valid = torch.cat([key_valid, key_valid.new_zeros(B, W - S)], dim=1)
    q_col = torch.arange(start, start + num_queries, device=dev)[:, None]  # (M, 1)
    k_col = torch.arange(W, device=dev)[None, :]  # (1, W)
    causal = k_col <= q_col  # (M, W)
    allowed = causal[None] & key_valid[:, None, :W]  # (B, M, W)
    allowed = allowed | (k_col == q_col)[None]
    return allowed[:, None]  # (B, 1, M, W)


def needed_positions(key_valid: torch.Tensor, score_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the positions the log-probs at ``score_mask`` (B, L) depend on.

    The log-prob at column c comes from the logits at c - 1, which see valid keys up to c - 1;
    so a row needs its valid columns before its last scored column, and none after it.
    """
    col = torch.arange(key_valid.shape[1], device=key_valid.device)
    last = torch.where(score_mask, col, -1).amax(-1)  # (B,): last scored column, -1 if none
    return key_valid & (col[None] < last[:, None])


def full_step(key_valid: torch.Tensor, kv_len: int | None = None, needed: torch.Tensor | None = None) -> Step:
    """The Step for a teacher-forced forward over the (B, L) grid.

    ``kv_len`` (>= L) is the attention buffer length S the rollout decoded with. A trainer that
    scores only the first L columns (the realized lengths) passes it, and the exact attention
    zero-pads its keys and values to S: keys past L are masked for every query, so they add
    exact zeros, and the query at column c runs against the first ``ops.attention_keys(c, S)``
    keys, the count its decode step used.
    ``needed`` (B, L) bool: compute only these positions (see ``Step.rows``).
    """
    L = key_valid.shape[1]
    rows = None if needed is None else needed.reshape(-1).nonzero().squeeze(1)  # (N,)
    return Step(positions=positions_from_valid(key_valid), start=0, allowed=attention_mask(key_valid, 0, L, kv_len),
                rows=rows)


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token_t | tokens_<t) from teacher-forced logits (B, L, V): (logp (B, L) with column 0
    set to 0, since it has no prefix; and the full next-token log-probs (B, L-1, V))."""
    logp_all = log_softmax(logits[:, :-1], dim=-1)  # (B, L-1, V)
    logp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, L-1)
    return torch.cat([logp.new_zeros(tokens.shape[0], 1), logp], dim=1), logp_all  # (B, L)


def token_logprobs(
    model: CausalLM,
    tokens: torch.Tensor,
    key_valid: torch.Tensor,
    *,
    mode: str = "exact",
    with_entropy: bool = False,
    kv_len: int | None = None,
    score_mask: torch.Tensor | None = None,
    routing: Routing | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Trainer-side log pi(token_t | tokens_<t) for every column, differentiable.

    tokens, key_valid: (B, L). Returns logp (B, L) with column 0 set to 0 (it has no prefix)
    and, if asked, the entropy (B, L) of each next-token distribution (detached). ``kv_len``:
    see ``full_step`` (only the exact mode uses it). ``score_mask`` (B, L) bool, exact mode: the
    columns whose log-probs are wanted; the forward then skips the positions they do not depend
    on (left padding, columns after a row's last scored one) when that saves at least
    ``MIN_SKIP_MACS``, with the same bits where wanted; elsewhere logp and entropy are finite but
    meaningless. ``routing`` (MoE models): records each sparse layer's router choices (B, L, k)
    and applies its ``forced`` experts (B, L, k) (router replay); every position is then computed.
    """
    exact = mode == "exact"
    skip = exact and score_mask is not None and not model.hooks and routing is None
    needed = needed_positions(key_valid, score_mask) if skip else None
    if needed is not None and int((~needed).sum()) * model.config.layer_macs_per_token < MIN_SKIP_MACS:
        needed = None  # too little to save: compute every position
    step = full_step(key_valid, kv_len if exact else None, needed)
    step.routing = routing
    logits = model(tokens, step, mode=mode)  # (B, L, V)
    logp, logp_all = gather_logprobs(logits, tokens)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)  # (B, S-1)
            entropy = torch.cat([ent.new_zeros(tokens.shape[0], 1), ent], dim=1)
    return logp, entropy
