"""The mismatch probe: roll out with one engine, score the same tokens with another numeric path.

``run_probe`` loads an HF-format model folder (weights + tokenizer), samples responses with a
rollout engine (``exact``, ``fast``, ``hf``), recomputes the log-prob of every sampled token
with a score path and reports r = log pi (score) - log mu (rollout) over response tokens:

- ``trainer``: ``token_logprobs(mode="exact")`` with autograd enabled, i.e. the real training
  forward (the pi of the RL loss). ``--rollout exact --score trainer`` is the zero-mismatch
  setting and must report max |r| = 0 in every dtype.
- ``exact`` / ``fast``: the teacher-forced forward on that engine's numeric path, no autograd.
- ``hf``: a ``transformers`` forward on the same grid (attention_mask from key_valid,
  position_ids from ``positions_from_valid``).

With ``attribute=True`` the probe also locates where the two paths part: it records the
activation at every op boundary (``CausalLM.hooks``) while replaying the rollout engine's own
KV-cached prefill/decode calls teacher-forced on the sampled tokens, and while running the score
path's forward, then compares them op by op at the columns that predict response tokens.
The replay re-runs the rollout engine's exact call sequence (same batch, same steps), so its
log-probs must equal the rollout's; ``replay_bitwise_equal`` reports that check.

On a mixture-of-experts model (Qwen3-MoE) the probe always records both paths that way (rollout
engines ``exact``/``fast``, any score path but ``hf``) and reports the routing mismatch: how
often the top-k expert set of a position differs between them, per sparse layer, and mean |r|
split by whether the position producing the token flipped (``routing_mismatch``).

``run_calibration`` (``timlab probe --injector``) rolls out the way the RL loop does, with a
configured injector at several magnitudes, and reports the realized k3 per token and in total per
sequence (T * k3), and the magnitude that reaches a target total: how arms that confine the
mismatch to different tokens (``mismatch.entropy_*``, ``position_*``) are matched on T * k3.

Not from a paper: a diagnostic in the spirit of VeXact's bitwise check (docs/exactness.md).
Metric definitions are those of ``timlab.metrics`` (docs/metrics.md).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from timlab.engines import ENGINES, Engine, Rollout, SamplingParams, build_engine
from timlab.engines.device_loop import DeviceLoop, use_loop
from timlab.errors import UsageError
from timlab.files import atomic_write_text, read_text
from timlab.metrics import (
                            mismatch_by_position,
                            mismatch_by_prob_bucket,
                            mismatch_metrics,
                            offpolicy_metrics,
                            routing_metrics,
                            )
from timlab.model.forward import full_step, token_logprobs
from timlab.model.hf_io import load_model
from timlab.model.llama import ROUTER_OP, CausalLM

SCORERS = ("trainer", "exact", "fast", "hf")
"""Score paths: the trainer's forward, or the teacher-forced forward of an engine's numeric path."""

HOOKED_ENGINES = ("exact", "fast")
"""Engines that run timlab's own model code, whose op boundaries the attribution can observe."""

POSITION_BUCKETS = 8

TASK_PROMPTS = 16
"""Prompts drawn from a task when the caller does not say how many."""


# ------------------------------------------------------------------------------ input checks
def _check_names(rollout: str, score: str, attribute: bool) -> None:
    if rollout == "trainer":
        raise UsageError(
            f"'trainer' is not a rollout engine (it only scores); valid rollout engines: {', '.join(ENGINES.names())}"
        )
    if rollout not in ENGINES:
        ENGINES.get(rollout)  # raises: unknown engine, lists the valid names
    if score not in SCORERS:
        raise UsageError(f"unknown score path {score!r}; valid choices: {', '.join(SCORERS)}")
    if attribute:
        for role, name in (("rollout", rollout), ("score", score)):
            if name == "hf":
                raise UsageError(
                    f"attribution needs op hooks, which only timlab's model code has; {role} 'hf' runs "
                    f"transformers' own model (use {' or '.join(HOOKED_ENGINES)}, or 'trainer' to score)"
                )


def _read_prompts(prompts_file: str | Path) -> list[str]:
    """One prompt per line; blank lines are skipped (spaces are kept: they are characters)."""
    path = Path(prompts_file)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    # split at \n only: str.splitlines also splits at \x0b, \x0c, \x1c-\x1e, \x85, \u2028, \u2029 (characters of a prompt)
    lines = [line.rstrip("\r") for line in read_text(path, what="prompts file").split("\n")]
    prompts = [line for line in lines if line.strip("\r\n")]
    if not prompts:
        raise UsageError(f"prompts file {str(path)!r} is empty (expected one prompt per line)")
    return prompts


def _task_prompts(task: str, num_prompts: int, seed: int) -> list[str]:
    from timlab.tasks import get_task

    return [ex.prompt for ex in get_task(task).sample(random.Random(seed), num_prompts)]


def _check_vocab(tokenizer, model: CausalLM) -> None:
    n_tok, n_model = tokenizer.vocab_size, model.config.vocab_size
    if n_tok > n_model:
        raise UsageError(
            f"tokenizer has {n_tok} tokens but the model's vocab_size is {n_model}: "
            "token ids would fall outside the embedding; use the tokenizer the model was trained with"
        )


def _encode(tokenizer, texts: list[str], model: CausalLM, max_new_tokens: int, source: str) -> list[list[int]]:
    context = model.config.max_position_embeddings
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        if not ids:
            raise UsageError(f"prompt {i + 1} of {source} encodes to no tokens")
        if len(ids) + max_new_tokens > context:
            raise UsageError(
                f"prompt {i + 1} of {source} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it "
                f"needs {len(ids) + max_new_tokens} positions, more than the model's context "
                f"(max_position_embeddings={context})"
            )
        out.append(ids)
    return out


# ------------------------------------------------------------------------------ scoring
def score_logprobs(score: str, model: CausalLM, tokens: torch.Tensor, key_valid: torch.Tensor,
                   *, hf_engine: Engine | None = None) -> torch.Tensor:
    """log-prob (B, S) of every token of the grid under a score path (column 0 = 0), detached."""
    if score == "trainer":
        with torch.enable_grad():  # the real training forward: autograd on, as in the RL step
            logp, _ = token_logprobs(model, tokens, key_valid, mode="exact")
        return logp.detach()
    if score in ("exact", "fast"):
        with torch.no_grad():
            logp, _ = token_logprobs(model, tokens, key_valid, mode=score)
        return logp
    if score == "hf":
        return hf_engine.score(tokens, key_valid)
    raise UsageError(f"unknown score path {score!r}; valid choices: {', '.join(SCORERS)}")


ENTROPY_EDGES = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 1e9)
"""Token-entropy buckets (nats) for |r| by entropy: near-deterministic tokens to flat ones."""


def mismatch_by_entropy(score_logp: torch.Tensor, rollout: Rollout, entropy: torch.Tensor,
                        edges: tuple[float, ...] = ENTROPY_EDGES) -> dict:
    """Mean |r| and token count per bucket of the model's next-token entropy at that token.

    entropy: (B, S), the entropy of the distribution that produced column t (nats).
    Returns ``{"edges", "mean_abs_diff", "counts"}`` like the other breakdowns.
    """
    mask = rollout.response_mask
    r = (score_logp.double() - rollout.logprobs.double()).abs()[mask]  # (N,)
    e = torch.as_tensor(edges, dtype=torch.float64)
    idx = (torch.bucketize(entropy.double()[mask], e, right=True) - 1).clamp(0, len(edges) - 2)  # (N,)
    n = len(edges) - 1
    counts = torch.bincount(idx, minlength=n)[:n]
    sums = torch.zeros(n, dtype=torch.float64).index_add(0, idx, r)
    means = sums / counts.clamp(min=1)
    return {"edges": list(edges), "mean_abs_diff": [float(x) for x in means], "counts": [int(c) for c in counts]}


def _mismatch(score_logp: torch.Tensor, rollout: Rollout, max_new_tokens: int) -> dict:
    mask = rollout.response_mask
    mm = mismatch_metrics(score_logp, rollout.logprobs, mask)
    off = offpolicy_metrics(score_logp, rollout.logprobs, mask)
    P = rollout.prompt_width
    cols = slice(P, P + max_new_tokens)  # response columns only, so position buckets span responses
    resp = (score_logp[:, cols], rollout.logprobs[:, cols], mask[:, cols])
    return {
        "num_tokens": int(mm["num_tokens"]),
        "max_abs_diff": mm["max_abs_diff"],
        "mean_abs_diff": mm["abs_diff_mean"],
        "frac_bitwise_equal": mm["frac_bitwise_equal"],
        "k3_kl": off["k3_kl"],
        "kl": off["kl"],
        "log_ppl_abs_diff": off["log_ppl_abs_diff"],
        "log_ppl_abs_diff_sum": mm["log_ppl_abs_diff_sum"],
        "probs_diff_mean": mm["probs_diff_mean"],
        "frac_tokens_different": mm["frac_tokens_different"],
        "abs_diff_by_position": mismatch_by_position(*resp, num_buckets=min(POSITION_BUCKETS, max_new_tokens)),
        "abs_diff_by_prob": mismatch_by_prob_bucket(*resp),
    }


# ------------------------------------------------------------------------------ attribution
class _Recorder:
    """A ``model.hooks`` entry that writes each op's output into a (B, S, X) grid per op name.

    Before each model call, ``window(start, num)`` says which grid columns the call computes.
    A 3-D tensor (B, M, X) fills columns start..start+M-1; a 2-D tensor (B, V) is the engine's
    next-token logits of the call's last column.
    """

    def __init__(self, B: int, S: int):
        self.B, self.S = B, S
        self.acts: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.start, self.num = 0, S

    def window(self, start: int, num: int) -> None:
        self.start, self.num = start, num

    def __call__(self, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if name not in self.acts:
            self.acts[name] = torch.zeros(self.B, self.S, t.shape[-1], dtype=t.dtype, device=t.device)
            self.order.append(name)
        if t.dim() == 2:
            self.acts[name][:, self.start + self.num - 1] = t
        else:
            self.acts[name][:, self.start : self.start + t.shape[1]] = t


def _record(model: CausalLM, recorder: _Recorder, fn) -> None:
    model.hooks.append(recorder)
    try:
        fn()
    finally:
        model.hooks.remove(recorder)


def _replay_engine(engine: Engine, rollout: Rollout, recorder: _Recorder) -> None:
    """Re-run the engine's prefill and decode calls, feeding the sampled tokens (teacher-forced)."""
    tokens, key_valid, P = rollout.tokens, rollout.key_valid, rollout.prompt_width
    last = int(rollout.response_mask.nonzero()[:, 1].max())  # last response column
    with torch.no_grad():
        recorder.window(0, P)
        _, state = engine._prefill(tokens.clone(), key_valid, P)
        for col in range(P, last):  # logits at col predict token col + 1
            recorder.window(col, 1)
            engine._decode(state, tokens, key_valid, col)


def _score_forward(score: str, model: CausalLM, rollout: Rollout) -> None:
    step = full_step(rollout.key_valid)
    mode = "exact" if score == "trainer" else score
    with torch.set_grad_enabled(score == "trainer"):
        model(rollout.tokens, step, mode=mode)


def _op_stats(name: str, a: torch.Tensor, b: torch.Tensor) -> dict:
    """a: rollout path, b: score path, both (N, X) at the compared positions."""
    diff = (a.float() - b.float()).abs()
    norm_b = float(b.float().norm())
    return {
        "name": name,
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "mean_abs_diff": float(diff.mean()) if diff.numel() else 0.0,
        "rel_diff": float(diff.norm()) / norm_b if norm_b > 0 else float(diff.norm()),
        "bitwise_equal": bool(torch.equal(a, b)),
    }


def _predicting(rollout: Rollout) -> torch.Tensor:
    """(B, S) bool: column c predicts a response token (token c + 1 is one)."""
    pred = torch.zeros_like(rollout.response_mask)
    pred[:, :-1] = rollout.response_mask[:, 1:]
    return pred


def record_paths(engine: Engine, score: str, model: CausalLM, rollout: Rollout) -> tuple[_Recorder, _Recorder]:
    """Every op's activations on the rollout engine's replayed path and on the score path."""
    if engine.name not in HOOKED_ENGINES:
        raise UsageError(
            f"attribution needs op hooks; engine {engine.name!r} has none (use {', '.join(HOOKED_ENGINES)})"
        )
    B, S = rollout.tokens.shape
    rec_roll, rec_score = _Recorder(B, S), _Recorder(B, S)
    _record(model, rec_roll, lambda: _replay_engine(engine, rollout, rec_roll))
    _record(model, rec_score, lambda: _score_forward(score, model, rollout))
    return rec_roll, rec_score


def attribute_ops(engine: Engine, score: str, model: CausalLM, rollout: Rollout,
                  recorded: tuple[_Recorder, _Recorder] | None = None) -> dict:
    """Op-by-op comparison of the rollout engine's replayed path and the score path.

    Compared positions: (b, c) such that token c + 1 is a response token, i.e. the activations
    that produce every response log-prob. Returns ``ops`` (forward order; an MoE layer's expert
    choices are compared by ``routing_mismatch`` instead), ``first_divergent_op`` (None when all
    equal) and ``replay_bitwise_equal``. ``recorded``: ``record_paths``' result, when already made.
    """
    rec_roll, rec_score = recorded or record_paths(engine, score, model, rollout)
    pred = _predicting(rollout)

    # the replay must reproduce the rollout's own log-probs, or the comparison means nothing
    logits = rec_roll.acts["logits"][:, :-1].float()  # (B, S-1, V)
    logp = torch.log_softmax(logits, -1).gather(-1, rollout.tokens[:, 1:, None]).squeeze(-1)  # (B, S-1)
    replay_equal = bool(torch.equal(logp[pred[:, :-1]], rollout.logprobs[:, 1:][pred[:, :-1]]))

    ops = [_op_stats(n, rec_roll.acts[n][pred], rec_score.acts[n][pred]) for n in rec_score.order
           if not n.endswith(ROUTER_OP)]
    first = next((op["name"] for op in ops if not op["bitwise_equal"]), None)
    return {"ops": ops, "first_divergent_op": first, "replay_bitwise_equal": replay_equal}


def routing_mismatch(rollout: Rollout, score_logp: torch.Tensor, recorded: tuple[_Recorder, _Recorder]) -> dict:
    """Router flips between the two recorded paths (``timlab.metrics.routing_metrics``) at the
    positions that produce response tokens, |r| split by whether the position flipped."""
    rec_roll, rec_score = recorded
    names = [n for n in rec_score.order if n.endswith(ROUTER_OP)]  # "layers.{i}.router_experts"
    pred = _predicting(rollout)
    r = (score_logp.double() - rollout.logprobs.double()).abs()
    abs_diff = torch.zeros_like(r)
    abs_diff[:, :-1] = r[:, 1:]  # the |r| of the token each position predicts
    out = routing_metrics(torch.stack([rec_roll.acts[n] for n in names]), torch.stack([rec_score.acts[n] for n in names]),
                          pred, abs_diff, layers=[int(n.split(".")[1]) for n in names])
    return {k.removeprefix("mismatch/"): v for k, v in out.items()}


# ------------------------------------------------------------------------------ the probe
def load_probe_model(model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu") -> tuple[CausalLM, Any]:
    """The model and tokenizer of an HF-format folder, checked to fit each other."""
    from timlab.tokenizer import load_tokenizer

    model = load_model(model_dir, dtype=dtype, device=device)
    tokenizer = load_tokenizer(model_dir)
    _check_vocab(tokenizer, model)
    return model, tokenizer


@dataclass
class ProbeOutput:
    """One rollout and its rescoring: what ``probe_prompts`` returns."""

    rollout: Rollout
    score_logp: torch.Tensor
    """(B, S) log-probs of the grid's tokens under the score path (column 0 = 0), detached."""
    engine: Engine
    summary: dict
    """mean_response_length, frac_finished, rollout_seconds, tokens_per_s."""


def probe_prompts(model: CausalLM, tokenizer, prompts: list[list[int]], *, rollout: str, score: str,
                  sampling: SamplingParams, max_new_tokens: int, seed: int, loop: DeviceLoop | None = None) -> ProbeOutput:
    """Roll out token-id prompts (one sequence each, one batch) with engine ``rollout`` and rescore
    the sampled tokens with score path ``score``; the generator is seeded with ``seed``. ``loop``:
    the engine's decode loop (``timlab.engines.device_loop``; None: the host loop)."""
    _check_names(rollout, score, attribute=False)
    engine = build_engine(rollout, model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    use_loop(loop, engine)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    t0 = time.perf_counter()
    r = engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, generator=generator)
    elapsed = time.perf_counter() - t0
    hf_engine = None
    if score == "hf":
        hf_engine = engine if rollout == "hf" else build_engine(
            "hf", model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    score_logp = score_logprobs(score, model, r.tokens, r.key_valid, hf_engine=hf_engine)
    summary = {
        "mean_response_length": float(r.lengths.float().mean()),
        "frac_finished": float(r.finished.float().mean()),
        "rollout_seconds": elapsed,
        "tokens_per_s": r.num_tokens / elapsed if elapsed > 0 else float("inf"),
    }
    return ProbeOutput(r, score_logp, engine, summary)


def run_probe(
    *,
    model_dir: str | Path,
    prompts_file: str | Path | None = None,
    task: str | None = None,
    num_prompts: int | None = None,
    samples_per_prompt: int = 1,
    rollout: str = "exact",
    score: str = "trainer",
    dtype: str = "float32",
    max_new_tokens: int = 32,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    attribute: bool = False,
    device: str = "cpu",
    show: int = 0,
) -> dict:
    """Roll out, rescore, return the mismatch as a JSON-ready dict.

    Prompts come from ``prompts_file`` (its first ``num_prompts`` non-blank lines, all of them by
    default) or from ``task`` (``num_prompts`` drawn with ``random.Random(seed)``,
    ``TASK_PROMPTS`` by default); each is sampled ``samples_per_prompt`` times. ``show``: also
    return the first that many sequences as text (``replies``: prompt, reply, its length, whether
    it ended with EOS, and its largest |r|).
    """
    _check_names(rollout, score, attribute)
    if (prompts_file is None) == (task is None):
        raise UsageError("probe needs exactly one of prompts_file or task")
    for name, value in (("num_prompts", num_prompts), ("samples_per_prompt", samples_per_prompt),
                        ("max_new_tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if isinstance(show, bool) or not isinstance(show, int) or show < 0:
        raise UsageError(f"show must be an integer >= 0, got {show!r}")
    from timlab.config import SEED_RANGE

    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise UsageError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {str(seed)[:40]}")
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)

    model, tokenizer = load_probe_model(model_dir, dtype=dtype, device=device)
    if prompts_file is not None:
        texts, source = _read_prompts(prompts_file), f"prompts file {str(prompts_file)!r}"
        if num_prompts is not None:
            if num_prompts > len(texts):
                raise UsageError(f"num_prompts={num_prompts} but {source} has {len(texts)} prompts")
            texts = texts[:num_prompts]
    else:
        texts, source = _task_prompts(task, num_prompts or TASK_PROMPTS, seed), f"task {task!r}"
    prompt_ids = _encode(tokenizer, texts, model, max_new_tokens, source)
    prompts = [p for p in prompt_ids for _ in range(samples_per_prompt)]
    out = probe_prompts(model, tokenizer, prompts, rollout=rollout, score=score, sampling=sampling,
                        max_new_tokens=max_new_tokens, seed=seed)
    r, score_logp, engine = out.rollout, out.score_logp, out.engine

    result = {
        "rollout": rollout,
        "score": score,
        "dtype": dtype,
        "seed": seed,
        "model_dir": str(model_dir),
        "num_prompts": len(prompt_ids),
        "samples_per_prompt": samples_per_prompt,
        "num_sequences": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
    }
    result.update(out.summary)
    result.update(_mismatch(score_logp, r, max_new_tokens))
    if show:
        result["replies"] = _replies(tokenizer, [texts[i // samples_per_prompt] for i in range(len(prompts))],
                                     r, score_logp, show)
    with torch.no_grad():  # the model's own next-token entropy at each sampled token
        _, entropy = token_logprobs(model, r.tokens, r.key_valid, mode="exact", with_entropy=True)
    result["abs_diff_by_entropy"] = mismatch_by_entropy(score_logp, r, entropy)
    routed = model.config.is_moe and rollout in HOOKED_ENGINES and score != "hf"
    recorded = record_paths(engine, score, model, r) if attribute or routed else None
    if attribute:
        result.update(attribute_ops(engine, score, model, r, recorded))
    if routed:
        result.update(routing_mismatch(r, score_logp, recorded))
    return result


# ------------------------------------------------------------------------------ text report
def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _buckets(b: dict, label) -> str:
    cells = [f"{label(lo, hi)}: {_fmt(m)} (n={n})"
             for lo, hi, m, n in zip(b["edges"], b["edges"][1:], b["mean_abs_diff"], b["counts"]) if n]
    return ", ".join(cells) or "(no tokens)"


def _replies(tokenizer, texts: list[str], r: Rollout, score_logp: torch.Tensor, n: int) -> list[dict]:
    """The first ``n`` sequences as text: prompt, reply (special tokens left out), response
    tokens, whether it ended with EOS, and the largest |log pi - log mu| over its tokens."""
    diff = (score_logp - r.logprobs).abs().masked_fill(~r.response_mask, 0.0)  # (B, S)
    return [{"prompt": texts[i], "reply": tokenizer.decode(ids), "tokens": len(ids), "finished": bool(r.finished[i]),
             "max_abs_diff": float(diff[i].max()) if ids else 0.0}
            for i, ids in enumerate(r.responses()[:n])]


def format_probe(result: dict) -> str:
    """A short human-readable report of ``run_probe``'s result."""
    lines = [
        f"probe: rollout={result['rollout']} score={result['score']} dtype={result['dtype']} seed={result['seed']}",
        f"  {result['num_sequences']} sequences, {result['num_tokens']} response tokens, "
        f"mean length {result['mean_response_length']:.1f}, rollout {result['tokens_per_s']:.0f} tok/s",
        f"  max |r| {_fmt(result['max_abs_diff'])}  mean |r| {_fmt(result['mean_abs_diff'])}  "
        f"bitwise equal {100 * result['frac_bitwise_equal']:.2f}%  k3 {_fmt(result['k3_kl'])}",
        "  mean |r| by response position: " + _buckets(result["abs_diff_by_position"], lambda lo, hi: f"[{lo},{hi})"),
        "  mean |r| by score prob: " + _buckets(result["abs_diff_by_prob"], lambda lo, hi: f"[{lo:g},{hi:g}]"),
    ]
    if "router_flip_frac" in result:
        by_layer = ", ".join(f"{i}: {_fmt(f)}" for i, f in result["router_flip_frac_by_layer"].items())
        lines.append(f"  router flips (top-k set differs): {_fmt(result['router_flip_frac'])} of (position, layer) "
                     f"pairs, {_fmt(result['router_flip_frac_any_layer'])} of positions; by layer {by_layer}")
        lines.append(f"  mean |r| where a router flipped: {_fmt(result['abs_diff_mean_router_flipped'])} "
                     f"(n={result['router_flipped_tokens']}), elsewhere "
                     f"{_fmt(result['abs_diff_mean_router_unflipped'])} (n={result['router_unflipped_tokens']})")
    if "ops" in result:
        lines.append(f"  attribution (rollout path vs score path; replay reproduces rollout: "
                     f"{result['replay_bitwise_equal']}):")
        lines.append(f"    {'op':<24} {'equal':>5} {'max|d|':>10} {'mean|d|':>10} {'rel':>10}")
        for op in result["ops"]:
            lines.append(f"    {op['name']:<24} {'yes' if op['bitwise_equal'] else 'no':>5} "
                         f"{op['max_abs_diff']:>10.3g} {op['mean_abs_diff']:>10.3g} {op['rel_diff']:>10.3g}")
        lines.append(f"  first divergent op: {result['first_divergent_op'] or 'none (bitwise equal throughout)'}")
    if result.get("replies"):
        lines.append(f"  replies (the first {len(result['replies'])} of {result['num_sequences']}):")
        for x in result["replies"]:
            end = "EOS" if x["finished"] else "no EOS"
            lines.append(f"    {x['prompt']!r} -> {x['reply']!r}  ({x['tokens']} tokens, {end}, max |r| "
                         f"{_fmt(x['max_abs_diff'])})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ HTML report
def write_probe_html(result: dict, path: str | Path) -> Path:
    """One self-contained HTML page: summary, divergence through the layers, |r| breakdowns."""
    import html

    from timlab.experiments.reports.page import new_figure, png_uri

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    title = f"timlab probe: rollout {result['rollout']} vs score {result['score']} ({result['dtype']})"
    keys = ["num_tokens", "max_abs_diff", "mean_abs_diff", "frac_bitwise_equal", "k3_kl", "log_ppl_abs_diff",
            "probs_diff_mean", "mean_response_length", "tokens_per_s"]
    rows = "".join(f"<tr><td>{k}</td><td>{_fmt(result[k]) if isinstance(result[k], float) else result[k]}</td></tr>"
                   for k in keys if k in result)
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p>Model <code>{html.escape(str(result['model_dir']))}</code>, {result['num_sequences']} sequences, "
             f"seed {result['seed']}. r = log-prob under the score path minus the rollout's, on the same tokens.</p>",
             f"<h2>Summary</h2><table>{rows}</table>"]
    ops = result.get("ops")
    if ops:
        fig = new_figure(10, 3.8)
        ax = fig.add_subplot(1, 1, 1)
        x = list(range(len(ops)))
        floor = 1e-12  # bitwise-equal ops are drawn at the floor of the log axis
        ax.semilogy(x, [max(o["max_abs_diff"], floor) for o in ops], "o-", label="max |diff|")
        ax.semilogy(x, [max(o["mean_abs_diff"], floor) for o in ops], "s-", label="mean |diff|")
        first = result.get("first_divergent_op")
        if first is not None:
            ax.axvline([o["name"] for o in ops].index(first), color="red", ls="--", label=f"first divergent: {first}")
        ax.set_xticks(x)
        ax.set_xticklabels([o["name"] for o in ops], rotation=70, fontsize=7)
        ax.set_ylabel("activation difference")
        ax.set_title("Divergence through the network (bitwise-equal ops sit at 1e-12)")
        ax.legend(fontsize=8)
        parts.append("<h2>Where the two paths diverge</h2>"
                     f"<p>First op that is not bitwise equal: <b>{html.escape(str(first))}</b>.</p>"
                     f"<img alt='divergence by op' src='{png_uri(fig)}'>")
        op_rows = "".join(
            f"<tr><td>{html.escape(o['name'])}</td><td>{_fmt(o['max_abs_diff'])}</td><td>{_fmt(o['mean_abs_diff'])}</td>"
            f"<td>{_fmt(o.get('rel_diff', float('nan')))}</td><td>{'yes' if o['bitwise_equal'] else 'no'}</td></tr>"
            for o in ops)
        parts.append("<table><tr><th>op</th><th>max |diff|</th><th>mean |diff|</th><th>relative</th>"
                     f"<th>bitwise equal</th></tr>{op_rows}</table>")
    for key, label in (("abs_diff_by_position", "response position"), ("abs_diff_by_prob", "trainer probability"),
                       ("abs_diff_by_entropy", "next-token entropy (nats)")):
        b = result.get(key)
        if not b:
            continue
        fig = new_figure(7, 3.0)
        ax = fig.add_subplot(1, 1, 1)
        labels = [f"[{b['edges'][i]:g}, {b['edges'][i + 1]:g})" for i in range(len(b["counts"]))]
        ax.bar(range(len(labels)), b["mean_abs_diff"])
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, fontsize=7)
        ax.set_ylabel("mean |r|")
        ax.set_title(f"|r| by {label} (token counts: {', '.join(map(str, b['counts']))})", fontsize=9)
        parts.append(f"<h2>|r| by {html.escape(label)}</h2><img alt='|r| by {html.escape(label)}' src='{png_uri(fig)}'>")
    style = "body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}"
    atomic_write_text(path, f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    return path


# ------------------------------------------------------------------------------ injector calibration
def interpolate_magnitude(magnitudes: list[float], totals: list[float], target: float) -> float | None:
    """The magnitude whose total reaches ``target``: log-log linear between the two consecutive
    (magnitude ascending) points that bracket it; None when no pair does (or a total is 0 there).
    E.g. magnitudes [1, 2], totals [0.1, 0.4], target 0.2 -> 2 ** 0.5 (total ~ magnitude^2)."""
    pts = sorted(zip(magnitudes, totals))
    for (m1, t1), (m2, t2) in zip(pts, pts[1:]):
        if min(t1, t2) <= target <= max(t1, t2) and t1 > 0 and t2 > 0 and m1 > 0 and t1 != t2:
            frac = (math.log(target) - math.log(t1)) / (math.log(t2) - math.log(t1))
            return math.exp(math.log(m1) + frac * (math.log(m2) - math.log(m1)))
        if t1 == t2 == target:
            return m1
    return None


def run_calibration(
    *,
    model_dir: str | Path,
    injector: str,
    magnitudes: list[float],
    mismatch: dict | None = None,
    target_total_k3: float = 0.0,
    prompts_file: str | Path | None = None,
    task: str | None = None,
    task_kwargs: dict | None = None,
    num_prompts: int | None = None,
    samples_per_prompt: int = 1,
    max_new_tokens: int = 32,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    device: str = "cpu",
) -> dict:
    """What a configured injector realizes, per token and per sequence, at each magnitude.

    The rollout is the RL loop's: the exact engine with ``injector`` (a ``mismatch.injector`` spec)
    at each of ``magnitudes``, the other ``mismatch.*`` settings from ``mismatch`` (e.g.
    ``{"entropy_min": 0.5}`` for an arm confined to the decision tokens), scored by the trainer's
    forward. The same prompts and the same seed at every magnitude. Per magnitude: ``k3`` (mean
    over response tokens, as ``rollout_corr/k3_kl``), ``mean_length`` T, ``total_k3`` = T * k3 (the
    sequence-level sum, the statistic E3b found the cost to follow), and the share of tokens the
    mismatch reached (r != 0). With ``target_total_k3`` > 0: ``calibrated_magnitude``, the
    magnitude that reaches it (``interpolate_magnitude``), so that arms with different scopes can
    be matched on T * k3. Prompts as in ``run_probe`` (``task_kwargs``: the task's options).
    """
    from timlab.config import resolve
    from timlab.injectors import build_injector
    from timlab.tasks import get_task

    if (prompts_file is None) == (task is None):
        raise UsageError("calibration needs exactly one of prompts_file or task")
    if not magnitudes or any(not (math.isfinite(m) and m > 0) for m in magnitudes):
        raise UsageError(f"magnitudes must be one or more finite numbers > 0, got {magnitudes}")
    if not (math.isfinite(target_total_k3) and target_total_k3 >= 0):
        raise UsageError(f"target_total_k3 must be a finite number >= 0 (0 = no target), got {target_total_k3}")
    for name, value in (("num_prompts", num_prompts), ("samples_per_prompt", samples_per_prompt),
                        ("max_new_tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    section = resolve(overrides={"mismatch": {**(mismatch or {}), "injector": injector}}).mismatch
    if section.injector == "none":
        raise UsageError("calibration needs an injector (mismatch.injector), not 'none'")
    model, tokenizer = load_probe_model(model_dir, device=device)
    if prompts_file is not None:
        texts, source = _read_prompts(prompts_file), f"prompts file {str(prompts_file)!r}"
        texts = texts[:num_prompts] if num_prompts else texts
    else:
        try:
            maker = get_task(task, **(task_kwargs or {}))
        except TypeError as e:
            raise UsageError(f"task_kwargs: {e}") from None
        texts = [ex.prompt for ex in maker.sample(random.Random(seed), num_prompts or TASK_PROMPTS)]
        source = f"task {task!r}"
    prompt_ids = _encode(tokenizer, texts, model, max_new_tokens, source)
    prompts = [p for p in prompt_ids for _ in range(samples_per_prompt)]
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    rows = []
    for m in magnitudes:
        inj = build_injector(dataclasses.replace(section, magnitude=float(m)), model, default_engine="exact",
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             tokenizer=tokenizer)
        inj.begin_step(1)
        r = inj.rollout(prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                        generator=torch.Generator(device=model.device).manual_seed(seed))
        score_logp = score_logprobs("trainer", model, r.tokens, r.key_valid)
        mask = r.response_mask
        k3 = offpolicy_metrics(score_logp, r.logprobs, mask.float())["k3_kl"]
        n_tokens = int(mask.sum())
        mean_length = n_tokens / len(prompts)
        reached = int(((score_logp != r.logprobs) & mask).sum())
        rows.append({"magnitude": float(m), "k3": k3, "mean_length": mean_length, "total_k3": k3 * mean_length,
                     "frac_tokens_reached": reached / max(n_tokens, 1), "num_tokens": n_tokens})
    out = {"model_dir": str(model_dir), "injector": section.injector, "seed": seed, "num_sequences": len(prompts),
           "max_new_tokens": max_new_tokens, "temperature": temperature,
           "mismatch": {k: v for k, v in dataclasses.asdict(section).items()
                        if k not in ("injector", "magnitude") and v != getattr(type(section)(), k)},
           "rows": rows, "target_total_k3": target_total_k3}
    if target_total_k3 > 0:
        out["calibrated_magnitude"] = interpolate_magnitude([x["magnitude"] for x in rows],
                                                            [x["total_k3"] for x in rows], target_total_k3)
    return out


def format_calibration(result: dict) -> str:
    """A short report of ``run_calibration``'s result: one line per magnitude, then the calibrated one."""
    scope = ", ".join(f"{k}={v}" for k, v in result["mismatch"].items()) or "none"
    lines = [f"calibration: injector={result['injector']} (other mismatch settings: {scope}), "
             f"{result['num_sequences']} sequences, seed {result['seed']}",
             f"  {'magnitude':>10} {'k3 per token':>13} {'mean T':>8} {'T * k3':>10} {'tokens reached':>15}"]
    for x in result["rows"]:
        lines.append(f"  {x['magnitude']:>10.4g} {x['k3']:>13.3e} {x['mean_length']:>8.1f} {x['total_k3']:>10.3e} "
                     f"{100 * x['frac_tokens_reached']:>14.1f}%")
    if result["target_total_k3"] > 0:
        m = result["calibrated_magnitude"]
        lines.append(f"  target T * k3 {result['target_total_k3']:.3g}: magnitude "
                     + (f"{m:.4g} (log-log interpolation)" if m is not None else
                        "not bracketed by these magnitudes; add smaller or larger ones"))
    return "\n".join(lines)
