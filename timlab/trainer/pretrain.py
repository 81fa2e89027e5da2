"""SFT warm start: a tiny decoder trained on a task's (prompt, answer, EOS) pairs.

RL from scratch with a sparse 0/1 reward never sees a success on these tasks (pilot runs,
docs/claims.md), so every run starts from a supervised model whose validation accuracy leaves room
for RL. The result is an ordinary HF folder (config.json, model.safetensors, char tokenizer)
cached under ``$TIMLAB_CACHE`` (default ``~/.cache/timlab``) by the hash of the model and task
settings, so later commands reuse it. ``pretrain(cfg, out_dir)`` fills that cache too and copies
the cached model to ``out_dir``, so ``timlab pretrain --out DIR`` and a later ``timlab train`` of
the same settings share one SFT. With ``model.pretrain_init`` the SFT continues from another model
folder's weights instead of a random init (``timlab.trainer.pretrain_init``: a curriculum).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from timlab.config import Config, check_warm_start, short_hash
from timlab.errors import UsageError
from timlab.files import foreign_entries, release_lock, remove_owned, take_lock
from timlab.model.forward import teacher_forced_batch, token_logprobs
from timlab.model.hf_io import TOKENIZER_FILES, save_model
from timlab.model.llama import CausalLM
from timlab.tasks import Example, build_task, make_splits
from timlab.tokenizer import Tokenizer, load_tokenizer, save_char_tokenizer
from timlab.trainer.architecture import MOE_KEYS, model_config_for
from timlab.trainer.pretrain_init import init_digest, init_record, load_init
from timlab.trainer.scoring import greedy_accuracy


def cache_root() -> Path:
    return Path(os.environ.get("TIMLAB_CACHE", Path.home() / ".cache" / "timlab"))


def warm_start_key(cfg: Config) -> str:
    """Hash of everything that determines the warm-start model. With ``model.pretrain_init`` it
    holds the SHA-256 of the init's weight files instead of its path; without one, the key is what it
    was before that field existed."""
    m = dataclasses.asdict(cfg.model)
    for k in ("path", "dtype", "lm_head_fp32", "pretrain_init", *(MOE_KEYS if not cfg.model.num_experts else ())):
        m.pop(k)
    t = {k: v for k, v in dataclasses.asdict(cfg.task).items() if k in ("name", "kwargs", "n_train", "n_val", "split_seed")}
    init = {"init": init_digest(cfg.model.pretrain_init)} if cfg.model.pretrain_init else {}
    return short_hash({"model": m, "task": t, "version": 1, **init}, 12)


def warm_start_dir(cfg: Config) -> Path:
    return cache_root() / "pretrained" / f"{cfg.task.name}-{warm_start_key(cfg)}"


def sft_batch(tok: Tokenizer, examples: list[Example], targets: list[str] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, key_valid, loss_mask), each (B, S): left-padded prompt, target + EOS, right pad.
    ``targets`` are the completions to learn (default: each example's answer)."""
    targets = [e.answer for e in examples] if targets is None else targets
    return teacher_forced_batch([tok.encode(e.prompt) for e in examples],
                                [tok.encode(t) + [tok.eos_token_id] for t in targets], tok.pad_token_id)


def sft_update(model: CausalLM, opt: torch.optim.Optimizer, tokens: torch.Tensor, key_valid: torch.Tensor,
               loss_mask: torch.Tensor) -> torch.Tensor:
    """One SFT step on an ``sft_batch``: the mean negative log-prob of the masked tokens (fast
    mode), gradients clipped to norm 1, one optimizer step. Returns the loss (detached graph)."""
    logp, _ = token_logprobs(model, tokens, key_valid, mode="fast")
    loss = -(logp * loss_mask).sum() / loss_mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


@dataclass
class PretrainResult:
    path: Path
    val_accuracy: float
    steps: int
    seconds: float
    num_params: int
    cached: bool


MODEL_FILES = ("pretrain.json", "config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES)
"""Every file pretraining writes in a model folder: the only ones it ever replaces."""
PARTIAL_MARKER = ".timlab-partial"
"""Written first into ``OUT.partial/``: only a folder holding it is timlab's to delete."""


def check_out_dir(out: Path) -> None:
    """``out`` must be new, empty, or a timlab model folder holding only timlab's files: a folder
    with anything else in it is refused (one line), never emptied."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"--out {out} is a file; choose a folder")
    foreign = foreign_entries(out, MODEL_FILES)
    if not foreign and any(out.iterdir()) and not (out / "pretrain.json").is_file():
        foreign = sorted(p.name for p in out.iterdir())  # timlab's names, but no pretrain.json: not ours
    if foreign:
        kind = "a timlab model folder with other files in it" if (out / "pretrain.json").exists() else \
            "not empty and not a timlab model folder"
        raise UsageError(f"--out {out} is {kind} ({foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); "
                         "timlab never deletes files it did not write: choose a new or empty folder")


def pretrain(cfg: Config, out_dir: str | Path | None = None, *, force: bool = False,
             progress: Callable[[int, int, dict], None] | None = None) -> PretrainResult:
    """Train (or reuse) the SFT warm start for cfg.task with the cfg.model architecture, in the
    cache (``warm_start_dir``). With ``out_dir`` the cached model is then copied there (the cache
    is filled first, so a later run of the same settings reuses it). An ``out_dir`` that holds
    anything but timlab's model files is refused, never overwritten."""
    cache = warm_start_dir(cfg)
    out = Path(out_dir) if out_dir else cache
    check_out_dir(out)
    if cfg.model.pretrain_init and out.exists() and out.resolve() == Path(cfg.model.pretrain_init).resolve():
        raise UsageError(f"--out {out} is model.pretrain_init: the SFT would replace the model it starts from; "
                         "choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    # One writer at a time: data-parallel ranks and sweep workers wait here, then reuse the result.
    lock = take_lock(out.with_name(out.name + ".lock"))  # never truncates a file that is not a timlab lock
    try:
        if not force and (done := _reuse(cfg, out)) is not None:
            return done
        if out.resolve() == cache.resolve():
            return _pretrain_locked(cfg, out, progress)
        _check_partial(out)  # before the cache is trained: a folder in the way is reported at once
        res = pretrain(cfg, force=force, progress=progress)
        check_out_dir(out)  # again, under the lock
        tmp = _start_partial(out)
        for name in MODEL_FILES:
            if (res.path / name).is_file():
                shutil.copyfile(res.path / name, tmp / name)
        _finish_partial(tmp, out)
        return dataclasses.replace(res, path=out)
    finally:
        release_lock(lock)


def _reuse(cfg: Config, out: Path) -> PretrainResult | None:
    """The model in ``out`` when it is complete and was built from these settings, else None. One
    built on a machine that computes other bits (the ``machine.fingerprint()`` it records, where it
    records one) is another model than this machine would build: it is still reused (the cache is
    shared by concurrent runs and never replaced under them), with a warning that says so and how to
    rebuild it (``--force``), so a start re-created from registered commands cannot differ unawares."""
    from timlab.machine import fingerprint

    done_file = out / "pretrain.json"
    if not all((out / f).exists() for f in ("pretrain.json", "model.safetensors", "tokenizer.json")):
        return None
    try:
        info = json.loads(done_file.read_text(encoding="utf-8"))
        if info.get("key") == warm_start_key(cfg):
            made = info.get("fingerprint")
            if made is not None and made != (here := fingerprint()):
                warnings.warn(f"{out} was pretrained on a machine that computes other bits (fingerprint {made}, here "
                              f"{here}): reused as it is; `timlab pretrain --force` builds it with this machine's bits",
                              stacklevel=2)
            return PretrainResult(out, float(info["val_accuracy"]), int(info["steps"]), float(info["seconds"]),
                                  int(info["num_params"]), True)
    except (ValueError, KeyError, TypeError, AttributeError):  # a damaged pretrain.json: build it again
        warnings.warn(f"{done_file} is damaged; pretraining the model again", stacklevel=2)
    return None


def _check_partial(out: Path) -> Path:
    """``OUT.partial``, refused (one line) when something there is not timlab's partial folder."""
    tmp = out.with_name(out.name + ".partial")
    if tmp.is_symlink() or (tmp.exists() and not (tmp / PARTIAL_MARKER).is_file()):
        raise UsageError(f"{tmp} exists and is not a partial model folder timlab wrote (no {PARTIAL_MARKER}); "
                         "timlab never deletes files it did not write: move it or choose another --out")
    return tmp


def _start_partial(out: Path) -> Path:
    """A fresh, marked ``OUT.partial`` folder to build the model in (a killed build's is removed)."""
    tmp = _check_partial(out)
    remove_owned(tmp, (*MODEL_FILES, PARTIAL_MARKER), what="a partial timlab model folder")  # a kill interrupted it
    tmp.mkdir(parents=True)
    (tmp / PARTIAL_MARKER).write_text("a timlab pretraining in progress; deleted when it is done\n")
    return tmp


def _finish_partial(tmp: Path, out: Path) -> None:
    """Put the finished ``tmp`` in place of ``out`` (whose timlab files it replaces)."""
    (tmp / PARTIAL_MARKER).unlink()
    remove_owned(out, MODEL_FILES, what="a timlab model folder")
    os.replace(tmp, out)


def _pretrain_locked(cfg: Config, out: Path, progress) -> PretrainResult:
    task = build_task(cfg)
    check_warm_start(cfg, task)
    train, val = make_splits(task, seed=cfg.task.split_seed, n_train=cfg.task.n_train, n_val=cfg.task.n_val)
    check_out_dir(out)  # again, under the lock
    tmp = _start_partial(out)
    save_char_tokenizer(task.alphabet, tmp)
    tok = load_tokenizer(tmp)
    max_new = task.max_answer_chars + 8  # greedy validation budget: the answer, EOS and some slack
    max_len = task.max_prompt_chars + max_new + 64
    mcfg = model_config_for(cfg, tok.vocab_size, tok, max_len)

    from timlab.machine import fingerprint

    key = warm_start_key(cfg)
    torch.manual_seed(cfg.model.pretrain_seed)
    model = CausalLM(mcfg)
    if cfg.model.pretrain_init:
        init = init_record(cfg.model.pretrain_init)
        load_init(model, cfg.model.pretrain_init)
        if init_digest(cfg.model.pretrain_init) != init["sha256"]:  # the weights read are the ones the key names
            raise UsageError(f"model.pretrain_init {cfg.model.pretrain_init}: its weight files changed while they "
                             "were read; pretrain again once nothing writes there")
    else:
        _init_weights(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.model.pretrain_lr, weight_decay=0.01, betas=(0.9, 0.98))
    steps = cfg.model.pretrain_steps
    warmup = max(1, steps // 20)
    def lr_factor(s: int) -> float:  # linear warmup, cosine decay to 5%
        return min(1.0, (s + 1) / warmup) * max(0.05, 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    rng = random.Random(cfg.model.pretrain_seed)
    start = time.time()
    loss_val = float("nan")
    for step in range(1, steps + 1):
        batch = rng.sample(train, min(cfg.model.pretrain_batch, len(train)))
        loss = sft_update(model, opt, *sft_batch(tok, batch, [task.demonstration(e, rng) for e in batch]))
        sched.step()
        loss_val = loss.item()
        if progress is not None:
            progress(step, steps, {"loss": loss_val})
    model.eval()
    acc, mean_len = greedy_accuracy(model, tok, task, val, max_new_tokens=max_new)
    seconds = time.time() - start
    save_model(model, tmp, tokenizer_dir=tmp)
    n_params = sum(p.numel() for p in model.parameters())
    info = {"key": key, "task": cfg.task.name, "val_accuracy": acc, "val_response_length": mean_len,
            "final_loss": loss_val, "steps": steps, "seconds": seconds, "num_params": n_params,
            "model": dataclasses.asdict(cfg.model), "task_kwargs": cfg.task.kwargs, "fingerprint": fingerprint(),
            **({"init": init} if cfg.model.pretrain_init else {})}
    (tmp / "pretrain.json").write_text(json.dumps(info, indent=2))
    _finish_partial(tmp, out)
    return PretrainResult(out, acc, steps, seconds, n_params, False)


def _init_weights(model: CausalLM, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, 0.02) for matrices, output projections scaled by depth."""
    n_layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if p.dim() == 2:
            s = std / (2 * n_layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            torch.nn.init.normal_(p, std=s)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)


def ensure_warm_start(cfg: Config, progress=None) -> PretrainResult:
    """The model RL starts from: cfg.model.path if set, else the cached SFT warm start."""
    if cfg.model.path:
        p = Path(cfg.model.path)
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path {p}: not a model folder (no config.json)")
        return PretrainResult(p, float("nan"), 0, 0.0, 0, True)
    return pretrain(cfg, progress=progress)


__all__ = ["pretrain", "ensure_warm_start", "warm_start_dir", "sft_batch", "sft_update"]
