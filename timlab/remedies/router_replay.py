"""Router replay: the trainer's forward uses the experts the rollout's routers chose.

In a mixture-of-experts model a router flip (the rollout and the trainer picking different
top-k experts for a token) changes the token's whole MLP output, so a small numerical mismatch
in the router becomes a large one in the log-probs. Replay removes that discrete part: the
rollout records each sparse layer's top-k experts per position (``Rollout.experts``) and the
trainer's MoE blocks use them, weighted by the trainer's own router probabilities at those
experts (renormalized as the model does), so the router still gets a gradient. This is verl's
R3 (rollout routing replay) and AReaL's R3; what remains is the mismatch of everything but the
expert choice, including the router weights themselves.

Used by ``timlab.trainer.run`` (``correction.router_replay``), which hands the result to
``token_logprobs(routing=Routing(forced=...))``. Pure torch.
"""

from __future__ import annotations

import torch


def replay_experts(experts: torch.Tensor, layers: list[int], rows: slice | torch.Tensor = slice(None),
                   columns: int | None = None) -> dict[int, torch.Tensor]:
    """The rollout's record (L, B, S, k) -> {layer: (b, columns, k)} for the trainer's forward on
    the sequences ``rows`` and the first ``columns`` columns. Entries of -1 (positions the rollout
    did not compute) let the trainer's router choose there."""
    if experts.shape[0] != len(layers):
        raise ValueError(f"the record has {experts.shape[0]} sparse layers, the model {len(layers)}")
    cols = slice(None) if columns is None else slice(0, columns)
    return {layer: experts[j, rows, cols] for j, layer in enumerate(layers)}
