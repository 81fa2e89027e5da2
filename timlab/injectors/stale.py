"""``stale``: the rollout uses the policy of k training steps ago (``mismatch.magnitude`` = k, an
integer >= 1): the off-policy lag of asynchronous RL, where the inference engine serves weights
that trail the trainer's.

Unlike the other parts, this mismatch is coupled to the optimization: its size is the change of
the weights over k updates, so it grows with the LR and the update size (the coupling Beyond
Precision argues real TIM has). The part keeps a ring of the trainer's weights at the start of
the last k + 1 steps (a version is the number of training steps done); step s rolls out with
version max(s - 1 - k, 0), so the first k steps, which have no older policy, roll out with the
starting weights. Every other part maps the lagged weights (``source_model``), so
'stale+precision' is a bf16 copy of the old policy. The ring is the part's checkpoint state
(plain tensors keyed by version), so a resumed run rolls out with the same old weights.

Under a mismatch schedule the lag is the scheduled value rounded half up (1.5 -> 2); the ring
holds enough versions for the larger end of the ramp. Outside a training run (``timlab gradcheck``
or a probe on a model folder: no ``begin_step``) there is no older policy and the lag is 0.
"""

from __future__ import annotations

import copy

import torch

from timlab.errors import UsageError
from timlab.injectors.base import Injector, register
from timlab.injectors.schedule import round_half_up
from timlab.model.llama import CausalLM


@register("stale")
class Stale(Injector):
    order = 5  # the source of the weights every later part maps
    copies_weights = True
    magnitude_kind = "integer"

    def __init__(self, settings):
        super().__init__(settings)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        """Training steps done -> the trainer's parameters then (detached copies)."""
        self.lagged: CausalLM | None = None
        """The old policy the rollout side maps; None until the first ``begin_step``."""
        self.loaded: int | None = None
        """The version ``lagged`` holds."""
        ends = [settings.magnitude] if settings.schedule == "constant" else [settings.magnitude, settings.magnitude_end]
        self.max_lag = max(round_half_up(m) for m in ends)
        """The largest lag of the run (a ramp is monotone between its ends): how far back the ring reaches."""

    def check(self) -> None:
        keys = ["magnitude"] if self.settings.schedule == "constant" else ["magnitude", "magnitude_end"]
        for key in keys:
            value = getattr(self.settings, key)
            if value != int(value) or value < 1:
                raise UsageError(f"mismatch.{key} for stale is the lag k in training steps: an integer >= 1, got {value}")

    def transform_model(self, rollout_model: CausalLM, model: CausalLM) -> CausalLM:
        self.lagged = copy.deepcopy(model).requires_grad_(False)
        return rollout_model

    def begin_step(self, step: int, model: CausalLM) -> bool:
        done = step - 1  # updates the trainer's weights have had
        if done not in self.versions:
            self.versions[done] = {n: p.detach().clone() for n, p in model.named_parameters()}  # updates are in place
        for v in [v for v in self.versions if v < done - self.max_lag]:
            del self.versions[v]
        want = max(done - round_half_up(self.settings.magnitude), min(self.versions))
        if want == self.loaded:
            return False
        self._load(want)
        return True

    def source_model(self, model: CausalLM) -> CausalLM:
        return model if self.loaded is None else self.lagged

    @torch.no_grad()
    def _load(self, version: int | None) -> None:
        if version is not None:
            for n, p in self.lagged.named_parameters():
                p.copy_(self.versions[version][n])
        self.loaded = version

    def state_dict(self) -> dict:
        return {"versions": self.versions, "loaded": self.loaded}

    def load_state_dict(self, state: dict) -> None:
        self.versions = {int(v): w for v, w in state["versions"].items()}
        self._load(state["loaded"])
