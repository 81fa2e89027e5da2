"""Learning-rate schedulers on the torch ``LRScheduler`` contract, picked by name.

- ``constant``: flat LR (the seed paper's baseline).
- ``cosine``: ``CosineWithFloorLR``, linear warmup then cosine to a floor.
- ``length_decay``: ``LengthDecayLR``, Beyond-Precision Algorithm 1 (halve every P updates, floor
  0.1), with P set by hand or from the response-length surge (``SurgeDetector``).

Pure torch; imports nothing from timlab but ``timlab.registry``.
"""

from __future__ import annotations

from torch.optim import Optimizer

from timlab.schedulers.base import SCHEDULERS, ConstantLR, CosineWithFloorLR, FactorLR
from timlab.schedulers.length_decay import LengthDecayLR, SurgeDetector


def build_scheduler(name: str, optimizer: Optimizer, **kwargs) -> FactorLR:
    """``SCHEDULERS.get(name)(optimizer, **kwargs)``; unknown names list the valid ones."""
    return SCHEDULERS.get(name)(optimizer, **kwargs)


def scheduler_from_config(optimizer: Optimizer, section, *, total_steps: int) -> FactorLR:
    """The schedule a run's scheduler section names (``section.name``), built from that section
    by the schedule itself (``FactorLR.from_config``)."""
    return SCHEDULERS.get(section.name).from_config(optimizer, section, total_steps=total_steps)


__all__ = [
    "SCHEDULERS",
    "FactorLR",
    "ConstantLR",
    "CosineWithFloorLR",
    "LengthDecayLR",
    "SurgeDetector",
    "build_scheduler",
    "scheduler_from_config",
]
