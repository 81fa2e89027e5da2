"""Trainer precision: fp32 master weights, a compute copy in fp32 / bf16 / fp16.

The compute model is what both the trainer's forward and the exact engine run, so the
zero-mismatch property holds in every precision. Gradients flow into the compute copy, are
copied to the fp32 master, clipped, and AdamW steps the master; the compute copy is then
re-cast. ``Precision`` only holds the copies and the loss scale and offers the pieces of the
update (``zero_grad``, ``scale_loss``, ``master_grads``, ``unscale_``, ``skip_overflow``,
``after_step``); the update itself is written out in ``RLRun._optimizer_step``. fp16 adds a dynamic loss scaler (scale 2^16, halve on overflow and skip the step,
double after ``growth_interval`` clean steps, as torch.amp.GradScaler and Qi et al.'s verl patch).
With fp32 the compute model IS the master (no copies). ``load_policy`` loads a model folder into
these copies, with its tokenizer.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from timlab.errors import UsageError
from timlab.model.hf_io import load_model, parse_dtype
from timlab.model.llama import CausalLM
from timlab.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from timlab.config import Config

PRECISIONS = ("float32", "bfloat16", "float16")


class Precision:
    def __init__(self, master: CausalLM, dtype: str, *, lm_head_fp32: bool = False,
                 init_scale: float = 2.0**16, growth_interval: int = 400):
        self.master = master
        self.dtype = parse_dtype(dtype)
        if self.dtype == torch.float32:
            self.compute = master
        else:
            self.compute = copy.deepcopy(master).to(self.dtype)
        self.compute.lm_head_fp32 = lm_head_fp32
        self.compute.train()
        self.scale = init_scale if self.dtype == torch.float16 else 1.0
        self.growth_interval = growth_interval
        self._clean_steps = 0
        self.skipped_steps = 0

    def load_master(self, state: dict) -> None:
        self.master.load_state_dict(state, strict=False)
        self._sync_compute()

    @torch.no_grad()
    def _sync_compute(self) -> None:
        if self.compute is not self.master:
            for pc, pm in zip(self.compute.parameters(), self.master.parameters()):
                pc.copy_(pm.to(pc.dtype))

    # ---------------------------------------------------------------------------- update pieces
    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the master's gradients (through the optimizer) and the compute copy's."""
        optimizer.zero_grad(set_to_none=True)
        if self.compute is not self.master:
            self.compute.zero_grad(set_to_none=True)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale (1 outside fp16), to call ``backward`` on."""
        return loss * self.scale

    def master_grads(self) -> list[torch.nn.Parameter]:
        """Copy the compute copy's gradients to the fp32 master (nothing to copy in fp32) and
        return the master parameters that have a gradient."""
        if self.compute is not self.master:
            for pc, pm in zip(self.compute.parameters(), self.master.parameters()):
                pm.grad = None if pc.grad is None else pc.grad.float()
        return [p for p in self.master.parameters() if p.grad is not None]

    def unscale_(self, params: list[torch.nn.Parameter]) -> None:
        """Divide the gradients by the loss scale, in place."""
        if self.scale != 1.0:
            for p in params:
                p.grad.div_(self.scale)

    def skip_overflow(self, optimizer: torch.optim.Optimizer) -> bool:
        """After a non-finite gradient norm: in fp16 it is a loss-scale overflow, so halve the
        scale, drop the gradients and return True (skip this update); else False (a real NaN)."""
        if self.dtype != torch.float16:
            return False
        self.scale /= 2.0
        self._clean_steps = 0
        self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        return True

    def after_step(self) -> None:
        """After ``optimizer.step()``: grow the fp16 loss scale every ``growth_interval`` clean
        steps and re-cast the compute copy from the master."""
        if self.dtype == torch.float16:
            self._clean_steps += 1
            if self._clean_steps % self.growth_interval == 0:
                self.scale *= 2.0
        self._sync_compute()

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state.get("scale", self.scale)
        self._clean_steps = state.get("clean_steps", 0)
        self.skipped_steps = state.get("skipped_steps", 0)


def load_policy(model_dir: str | Path, cfg: Config, *, device: str | torch.device) -> tuple[Tokenizer, Precision]:
    """A model folder as the trainer holds it: its tokenizer, and fp32 master weights with the
    ``model.dtype`` compute copy (``Precision``). A tokenizer larger than the model is an error."""
    tok = load_tokenizer(model_dir)
    master = load_model(model_dir, dtype="float32", device=device)
    if tok.vocab_size > master.config.vocab_size:
        raise UsageError(f"tokenizer vocabulary ({tok.vocab_size}) does not fit the model in {model_dir} "
                         f"(vocab_size {master.config.vocab_size})")
    return tok, Precision(master, cfg.model.dtype, lm_head_fp32=cfg.model.lm_head_fp32)
