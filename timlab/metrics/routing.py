"""Routing mismatch of mixture-of-experts models: how often two numeric paths send a token to
different experts, and how much of |r| comes with it (pure torch).

In an MoE model a tiny difference in the router's logits can change which experts a token
goes to, and then its whole MLP output differs: a discrete source of training-inference
mismatch (the one routing replay, verl's R3, removes). Inputs are the experts each path chose,
stacked over the sparse layers: (L, B, T, k) long, in any rank order (a flip is a change of the
top-k *set*; the same set in another order is not one).

Not from a paper's code: VeXact and verl log the resulting log-prob mismatch, not the flips.
Metric definitions are in docs/metrics.md.
"""

from __future__ import annotations

import torch


def router_flips(experts_a: torch.Tensor, experts_b: torch.Tensor) -> torch.Tensor:
    """(L, B, T, k) twice -> (L, B, T) bool: True where the two top-k expert sets differ."""
    if experts_a.shape != experts_b.shape:
        raise ValueError(f"expert choices differ in shape: {tuple(experts_a.shape)} vs {tuple(experts_b.shape)}")
    return (experts_a.sort(-1).values != experts_b.sort(-1).values).any(-1)


def routing_metrics(experts_a: torch.Tensor, experts_b: torch.Tensor, mask: torch.Tensor,
                    abs_diff: torch.Tensor | None = None, layers: list[int] | None = None) -> dict:
    """Router flip rates between two paths over the positions ``mask`` (B, T) selects.

    experts_a, experts_b: (L, B, T, k) the experts of each sparse layer at each position.
    abs_diff: optional (B, T) |r| of the token each position produces (aligned with the
    positions: for a position that predicts the next token, that token's |r|); splits mean |r|
    by whether any layer flipped at the position. ``layers``: the L layers' indices (default
    0..L-1), the keys of the per-layer breakdown.

    Returns ``mismatch/router_flip_frac`` (flipped (position, layer) pairs / all pairs),
    ``mismatch/router_flip_frac_any_layer`` (positions with a flip in some layer),
    ``router_flip_frac_by_layer`` ({layer: fraction}) and, with ``abs_diff``,
    ``mismatch/abs_diff_mean_router_flipped`` / ``..._unflipped`` (0 when no such position) with
    the counts ``router_flipped_tokens`` / ``router_unflipped_tokens``.
    """
    flips = router_flips(experts_a, experts_b)  # (L, B, T)
    mask = mask.bool()
    L = flips.shape[0]
    layers = list(range(L)) if layers is None else list(layers)
    if len(layers) != L:
        raise ValueError(f"layers names {len(layers)} layers, the choices have {L}")
    n = mask.sum().double().clamp(min=1)
    per_layer = (flips & mask).sum(dim=(1, 2)).double() / n  # (L,)
    any_layer = flips.any(0) & mask  # (B, T)
    stats = [per_layer.mean() if L else per_layer.new_zeros(()), any_layer.sum().double() / n, per_layer]
    if abs_diff is not None:
        a = abs_diff.double()
        flipped, kept = any_layer, mask & ~any_layer
        stats += [(a * flipped).sum() / flipped.sum().clamp(min=1), (a * kept).sum() / kept.sum().clamp(min=1),
                  flipped.sum().double(), kept.sum().double()]
    values = torch.cat([s.reshape(-1) for s in stats]).tolist()  # one host sync
    out = {
        "mismatch/router_flip_frac": values[0],
        "mismatch/router_flip_frac_any_layer": values[1],
        "router_flip_frac_by_layer": {int(i): v for i, v in zip(layers, values[2 : 2 + L])},
    }
    if abs_diff is not None:
        rest = values[2 + L :]
        out.update({"mismatch/abs_diff_mean_router_flipped": rest[0], "mismatch/abs_diff_mean_router_unflipped": rest[1],
                    "router_flipped_tokens": int(rest[2]), "router_unflipped_tokens": int(rest[3])})
    return out
