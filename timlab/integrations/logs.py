"""Rows for ``timlab analyze`` from what TRL and verl hold in memory; needs neither library.

``from_trl_inputs`` takes the dict ``GRPOTrainer._generate_and_score_completions`` returns,
``from_verl_batch`` verl's batch after the actor's ``old_log_probs`` recomputation (a ``DataProto``
or a dict of tensors). Each returns one row per sequence in the schema of
``timlab.experiments.diagnostics.analyze`` (``SCHEMA``); ``analyze.write_rows`` writes them as Parquet or
JSONL. docs/analyze.md has the hooks that make each framework dump them.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from timlab.errors import UsageError


def _mapping(batch: Any) -> Mapping[str, Any]:
    """The tensor mapping of a verl DataProto (``.batch``) or TRL's inputs dict."""
    data = getattr(batch, "batch", batch)
    if not hasattr(data, "keys") or not hasattr(data, "__getitem__"):
        raise TypeError(f"expected a dict of tensors or an object with .batch, got {type(batch).__name__}")
    return data


def _get(data: Mapping, key: str):
    return data[key] if key in data.keys() else None


def _rows_from_tensors(*, trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                       tokens: torch.Tensor | None, prompt_ids: torch.Tensor | None, prompt_mask: torch.Tensor | None,
                       step: int | None, tokenizer, extra: dict[str, list]) -> list[dict]:
    """Rows from right-padded (B, T) response tensors: each row is cut after its last mask-1 token.

    A non-finite rollout log-prob (vLLM could not score the token; TRL stores NaN) turns its mask
    to 0 and is written as null. Prompt ids, when given, are left-padded (B, P) with ``prompt_mask``.
    """
    trainer = torch.as_tensor(trainer).detach().float().cpu()
    rollout = torch.as_tensor(rollout).detach().float().cpu()
    mask = torch.as_tensor(mask).detach().cpu() != 0
    if trainer.shape != rollout.shape or trainer.shape != mask.shape or trainer.dim() != 2:
        raise UsageError(f"shape mismatch: trainer {tuple(trainer.shape)}, rollout {tuple(rollout.shape)}, "
                         f"mask {tuple(mask.shape)} (all must be (B, T))")
    B, T = trainer.shape
    cols = torch.arange(T)
    rows = []
    for b in range(B):
        L = int(cols[mask[b]].max()) + 1 if mask[b].any() else 0
        m = mask[b, :L] & torch.isfinite(rollout[b, :L])
        roll = [float(x) if ok else None for x, ok in zip(rollout[b, :L].tolist(), torch.isfinite(rollout[b, :L]))]
        train = [float(x) if math.isfinite(x) else None for x in trainer[b, :L].tolist()]
        row: dict[str, Any] = {"id": f"{step}-{b}" if step is not None else str(b)}
        if step is not None:
            row["step"] = int(step)
        if tokens is not None:
            row["tokens"] = [int(t) for t in tokens[b, :L].tolist()]
        if tokenizer is not None:
            if prompt_ids is not None:
                p = prompt_ids[b] if prompt_mask is None else prompt_ids[b][torch.as_tensor(prompt_mask[b]) != 0]
                row["prompt"] = tokenizer.decode([int(t) for t in p.tolist()], skip_special_tokens=True)
            if tokens is not None:
                row["response"] = tokenizer.decode(row["tokens"], skip_special_tokens=True)
        row["trainer_logprobs"] = train
        row["rollout_logprobs"] = roll
        row["mask"] = [int(x) for x in m.tolist()]
        for k, v in extra.items():
            row[k] = v[b]
        rows.append(row)
    return rows


def from_verl_batch(batch: Any, *, step: int | None = None, tokenizer=None, trainer_key: str = "old_log_probs",
                    rollout_key: str = "rollout_log_probs") -> list[dict]:
    """Rows from verl's PPO batch (a ``DataProto``, anything with ``.batch``, or a dict of tensors).

    Reads ``old_log_probs`` (log pi: the actor's recomputed log-probs; in verl's rollout-correction
    ``bypass_mode`` verl sets them equal to the rollout's, so r = 0 by construction), ``rollout_log_probs``
    (log mu; ``actor_rollout_ref.rollout.calculate_log_probs=True``), ``response_mask`` (else
    ``attention_mask[:, -T:]``), ``responses`` (token ids), ``prompts`` + ``attention_mask``
    (prompt text, with a tokenizer), ``token_level_scores`` or ``rm_scores`` (reward = the sum over tokens) and
    ``advantages`` (after ``compute_advantage``; the ``advantage`` column is each row's mean over its
    response tokens), all (B, T) or (B, P). ``step`` defaults to ``meta_info["global_steps"]`` when the batch has it;
    ``non_tensor_batch["uid"]`` (the GRPO group) is kept as an extra ``uid`` column.
    """
    data = _mapping(batch)
    missing = [k for k in (trainer_key, rollout_key) if _get(data, k) is None]
    if missing:
        raise UsageError(
            f"verl batch has no {', '.join(missing)} (keys: {', '.join(sorted(data.keys()))}); "
            "rollout_log_probs need actor_rollout_ref.rollout.calculate_log_probs=True, old_log_probs exist "
            "after the actor's compute_log_prob")
    trainer, rollout = data[trainer_key], data[rollout_key]
    T = trainer.shape[1]
    mask = _get(data, "response_mask")
    if mask is None:
        am = _get(data, "attention_mask")
        mask = am[:, -T:] if am is not None else torch.ones_like(trainer)
    prompts, prompt_mask = _get(data, "prompts"), None
    am = _get(data, "attention_mask")
    if prompts is not None and am is not None:
        prompt_mask = am[:, : prompts.shape[1]]
    if step is None:
        step = (getattr(batch, "meta_info", None) or {}).get("global_steps")
    extra: dict[str, list] = {}
    scores = _get(data, "token_level_scores")
    scores = scores if scores is not None else _get(data, "rm_scores")  # verl's v1 trainer
    if scores is not None:
        extra["reward"] = [float(x) for x in torch.as_tensor(scores).float().sum(-1).tolist()]
    adv = _get(data, "advantages")  # (B, T) per token after compute_advantage: each row's mean over its mask
    if adv is not None:
        m = torch.as_tensor(mask).double()
        per_row = (torch.as_tensor(adv).double() * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
        extra["advantage"] = [float(x) for x in per_row.tolist()]
    uid = (getattr(batch, "non_tensor_batch", None) or {}).get("uid")
    if uid is not None:
        extra["uid"] = [str(u) for u in list(uid)]
    return _rows_from_tensors(trainer=trainer, rollout=rollout, mask=mask, tokens=_get(data, "responses"),
                              prompt_ids=prompts, prompt_mask=prompt_mask, step=step, tokenizer=tokenizer, extra=extra)


def from_trl_inputs(inputs: Mapping[str, Any], *, step: int | None = None, tokenizer=None,
                    trainer_logps: torch.Tensor | None = None, trainer_key: str = "old_per_token_logps",
                    rollout_key: str = "sampling_per_token_logps") -> list[dict]:
    """Rows from the dict TRL's ``GRPOTrainer._generate_and_score_completions`` returns (TRL 1.16).

    Reads ``sampling_per_token_logps`` (log mu: present with ``use_vllm=True`` or a ``rollout_func``
    returning logprobs; NaN where vLLM had none, which become mask 0), ``old_per_token_logps``
    (log pi: TRL computes it with ``vllm_importance_sampling_correction=True``, or when generation
    and optimization steps are misaligned; otherwise pass ``trainer_logps`` (B, T) from your own
    no-grad forward), ``completion_ids`` / ``completion_mask`` (times ``tool_mask`` when present),
    ``prompt_ids`` / ``prompt_mask`` (prompt text, with a tokenizer) and ``advantages`` (kept as an
    extra ``advantage`` column). Both log-prob tensors are under TRL's ``temperature``-scaled
    distribution (TRL divides the logits by it, and vLLM is run with processed logprobs).
    """
    data = _mapping(inputs)
    trainer = trainer_logps if trainer_logps is not None else _get(data, trainer_key)
    if trainer is None:
        raise UsageError(
            f"TRL inputs have no {trainer_key!r}: TRL computes it only with use_vllm=True and "
            "vllm_importance_sampling_correction=True (or misaligned generation/optimization steps); "
            "pass trainer_logps= from a no-grad forward of the policy")
    rollout = _get(data, rollout_key)
    if rollout is None:
        raise UsageError(
            f"TRL inputs have no {rollout_key!r}: TRL keeps the sampler's log-probs only with use_vllm=True "
            "or a rollout_func that returns 'logprobs' (its transformers generate path drops them)")
    mask = torch.as_tensor(_get(data, "completion_mask") if _get(data, "completion_mask") is not None
                           else torch.ones_like(torch.as_tensor(trainer)))
    tool_mask = _get(data, "tool_mask")
    if tool_mask is not None:
        mask = mask * torch.as_tensor(tool_mask)
    extra: dict[str, list] = {}
    adv = _get(data, "advantages")
    if adv is not None and torch.as_tensor(adv).dim() == 1:
        extra["advantage"] = [float(x) for x in torch.as_tensor(adv).float().tolist()]
    return _rows_from_tensors(trainer=trainer, rollout=rollout, mask=mask, tokens=_get(data, "completion_ids"),
                              prompt_ids=_get(data, "prompt_ids"), prompt_mask=_get(data, "prompt_mask"), step=step,
                              tokenizer=tokenizer, extra=extra)
