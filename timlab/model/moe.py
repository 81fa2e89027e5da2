"""The sparse mixture-of-experts block of Qwen3-MoE (``Qwen3MoeSparseMoeBlock`` in transformers).

A router (one linear, no bias) scores the E experts of each token; softmax in fp32, the top k
kept (``torch.topk``, as HF, so ties break the same way), renormalized to sum to 1 when
``norm_topk_prob``, cast back to the hidden dtype. Each expert is a SwiGLU MLP; the token's
output is the weighted sum of its k experts' outputs.

Departures from HF, neither of which changes a value in fp32 beyond rounding:

- Weights are one ``nn.Linear`` per expert projection (``mlp.experts.3.gate_proj.weight``):
  the per-expert names of HF checkpoints on disk. transformers >= 5 fuses them in memory into
  ``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj`` (E, H, I) and splits them again
  when it saves; ``timlab.model.hf_io`` reads either spelling.
- Batch invariance (the exact path). HF runs each expert on the tokens routed to it and
  ``index_add_``s the weighted outputs into the result in expert-id order. Here each expert's
  three linears run on the gathered rows through the mode's linear (``invariant_linear`` in the
  exact path: a row's bits do not depend on how many other rows the expert received), and a
  token's k weighted outputs are summed in rank order (highest router probability first), a
  fixed order that depends on the token alone. So a token's bits do not depend on which other
  tokens share its batch, and a KV-cached decode step equals the trainer's forward bit for bit.

``Routing`` carries what the blocks of one forward call chose (for routing-mismatch metrics)
and, for router replay, the experts they must use instead of their own choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from timlab.model.linear import mode_linear
from timlab.model.ops import invariant_linear, silu


@dataclass
class Routing:
    """Expert choices of one forward call, keyed by decoder layer index.

    Tensors are (..., k) long over the rows the call computes, in its own layout: (B, M, k) for a
    (B, M) call, (1, N, k) for a packed one (``Step.rows``).
    """

    chosen: dict[int, torch.Tensor] = field(default_factory=dict)
    """Written by each MoE block: its router's own top k, in rank order (also where ``forced``
    overrides it, so flips against a replayed choice stay measurable)."""
    forced: dict[int, torch.Tensor] = field(default_factory=dict)
    """Read by each MoE block when it holds its layer: use these experts (router replay) with the
    router's probabilities at them, instead of the router's own top k. A row of -1 (a position the
    record does not cover) keeps the router's own choice."""


def swiglu(mode: str, x: torch.Tensor, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear
           ) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), the MLP of every model here (dense, and each expert); in the
    exact mode through ``ops.silu``, whose bits do not depend on the row count."""
    gate = mode_linear(mode, x, gate_proj)
    gate = silu(gate) if mode == "exact" else F.silu(gate)
    return mode_linear(mode, gate * mode_linear(mode, x, up_proj), down_proj)


class Expert(nn.Module):
    """One expert: a SwiGLU MLP without biases (HF's Qwen3MoeMLP at ``moe_intermediate_size``)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        return swiglu(mode, x, self.gate_proj, self.up_proj, self.down_proj)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, forced: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (weights (N, k) fp32, experts used (N, k) long, the router's own
    top k (N, k) long), HF's rule.

    Softmax in fp32 over the experts, top k by probability (rank order), renormalized when
    ``norm_topk_prob``. ``forced`` (N, k): use these experts (router replay; rows of -1 keep
    the router's choice) with the probabilities the router gives them, renormalized alike.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
    weights, own = torch.topk(probs, top_k, dim=-1)  # (N, k) each
    experts = own
    if forced is not None:
        use = forced[:, :1] >= 0  # (N, 1): rows the record covers
        experts = torch.where(use, forced, own)
        weights = torch.where(use, probs.gather(-1, experts), weights)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts, own


class SparseMoeBlock(nn.Module):
    """Router + E experts; ``forward(x (..., H), mode) -> (..., H)``. Parameter names are HF's
    (``gate.weight``, ``experts.{e}.{gate,up,down}_proj.weight``)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 layer_idx: int):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, intermediate) for _ in range(num_experts))
        self.top_k, self.norm_topk_prob, self.layer_idx = top_k, norm_topk_prob, layer_idx
        self.router_dtype: torch.dtype | None = None
        """Compute the router logits in this dtype (inputs and weight rounded to it) instead of
        the model's: the ``router_precision`` injector sets it on the rollout's copy."""

    def router_logits(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        """(N, H) -> (N, E) router logits in the hidden dtype (or ``router_dtype``)."""
        if self.router_dtype is None or self.router_dtype == x.dtype:
            return mode_linear(mode, x, self.gate)
        w = self.gate.weight.to(self.router_dtype)
        x = x.to(self.router_dtype)
        return invariant_linear(x, w) if mode == "exact" else F.linear(x, w)

    def forward(self, x: torch.Tensor, mode: str, routing: Routing | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, H)
        N, k = x2.shape[0], self.top_k
        forced = None if routing is None else routing.forced.get(self.layer_idx)
        if forced is not None:
            forced = forced.reshape(N, k)
        weights, experts, own = route(self.router_logits(x2, mode), k, self.norm_topk_prob, forced)  # (N, k) each
        if routing is not None:
            routing.chosen[self.layer_idx] = own.reshape(*shape[:-1], k)
        weights = weights.to(x.dtype)  # as HF: the weighting runs in the hidden dtype
        if N == 0:
            return torch.zeros_like(x)

        slots = experts.reshape(-1)  # (N*k,): slot n*k + r = token n's rank-r expert
        order = slots.argsort(stable=True)  # slots grouped by expert
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        outs, at = [], 0
        for e, c in enumerate(counts):
            if c:
                rows = order[at : at + c] // k  # the tokens routed to expert e
                outs.append(self.experts[e](x2[rows], mode))  # (c, H)
                at += c
        y = torch.cat(outs)[order.argsort()].view(N, k, shape[-1])  # (N, k, H): back to slot order
        out = y[:, 0] * weights[:, :1]
        for r in range(1, k):  # a fixed per-token order: rank by rank
            out = out + y[:, r] * weights[:, r : r + 1]
        return out.view(shape)
