"""Scoring the policy on its task, for the trainer, the warm start and gradcheck.

``rollout_rewards`` (task rewards of a rollout's responses), ``greedy_accuracy`` (exact-match
accuracy of greedy decoding, the validation metric), ``greedy_replies`` (those replies as text,
for ``run.log_samples``) and ``gold_logprob`` (the teacher-forced log-prob of the gold
completion, its continuous companion). The configured task itself is
``timlab.tasks.build_task``; loading the policy is ``timlab.trainer.precision.load_policy``.
"""

from __future__ import annotations

import torch

from timlab.engines import Engine, Rollout, SamplingParams, build_engine
from timlab.model.forward import teacher_forced_batch, token_logprobs
from timlab.model.llama import CausalLM
from timlab.tasks import Example, Task
from timlab.tokenizer import Tokenizer


def rollout_rewards(task: Task, tok: Tokenizer, examples: list[Example], rollout: Rollout, *,
                    dense: bool = False) -> torch.Tensor:
    """(B,) float32: each response's task reward against its example (one example per row); a
    response that ran out of tokens before EOS gets 0."""
    texts = [tok.decode(ids) for ids in rollout.responses()]
    done = rollout.finished.tolist()
    return torch.tensor([task.reward(e, t, dense=dense) if f else 0.0 for e, t, f in zip(examples, texts, done)],
                        dtype=torch.float32)


@torch.no_grad()
def greedy_accuracy(model: CausalLM, tok: Tokenizer, task: Task, examples: list[Example], *,
                    max_new_tokens: int, batch_size: int = 128, engine: Engine | None = None) -> tuple[float, float]:
    """Accuracy (the fraction of responses with reward 1, so a task's format reward does not count)
    and mean response length of greedy decoding with the exact engine ``engine`` on ``model`` (a
    run passes its own; default: a new one)."""
    if engine is None:
        engine = build_engine("exact", model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    correct, lengths = 0.0, 0.0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        r = engine.generate([task.encode_prompt(tok, e) for e in chunk], max_new_tokens=max_new_tokens,
                            sampling=SamplingParams(temperature=0.0))
        correct += float((rollout_rewards(task, tok, chunk, r) == 1.0).sum())
        lengths += float(r.lengths.sum())
    return correct / len(examples), lengths / len(examples)


@torch.no_grad()
def greedy_replies(model: CausalLM, tok: Tokenizer, task: Task, examples: list[Example], *, max_new_tokens: int,
                   engine: Engine | None = None) -> list[dict]:
    """Greedy decoding of ``examples`` as text, one dict each: ``prompt``, ``reply`` (special
    tokens such as EOS left out), ``reference`` (the task's gold completion), ``reward`` (the task's,
    as ``greedy_accuracy`` counts it) and ``finished`` (it ended with EOS)."""
    if not examples:
        return []
    if engine is None:
        engine = build_engine("exact", model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    r = engine.generate([task.encode_prompt(tok, e) for e in examples], max_new_tokens=max_new_tokens,
                        sampling=SamplingParams(temperature=0.0))
    rewards = rollout_rewards(task, tok, examples, r).tolist()
    return [{"prompt": e.prompt, "reply": tok.decode(ids), "reference": task.gold_completion(e), "reward": w,
             "finished": bool(f)} for e, ids, w, f in zip(examples, r.responses(), rewards, r.finished.tolist())]


@torch.no_grad()
def gold_logprob(model: CausalLM, tok: Tokenizer, task: Task, examples: list[Example], *, batch_size: int = 128) -> float:
    """Mean over ``examples`` of the sum of the model's log-probs (exact mode, teacher-forced) of
    each example's gold completion (``task.gold_completion``) plus EOS, in nats."""
    total = 0.0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        tokens, key_valid, mask = teacher_forced_batch(
            [task.encode_prompt(tok, e) for e in chunk],
            [tok.encode(task.gold_completion(e)) + [tok.eos_token_id] for e in chunk], tok.pad_token_id)
        dev = model.device
        mask = mask.to(dev)
        logp, _ = token_logprobs(model, tokens.to(dev), key_valid.to(dev), mode="exact", score_mask=mask)
        total += float(torch.where(mask, logp, 0.0).double().sum())
    return total / len(examples)


__all__ = ["rollout_rewards", "greedy_accuracy", "gold_logprob"]
