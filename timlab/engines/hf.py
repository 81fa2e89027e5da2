"""``hf``: Hugging Face ``transformers`` ``generate`` as a third-party rollout engine.

The engine keeps its own HF copy of the timlab model (``AutoModelForCausalLM.from_config`` on
``config_to_hf``, timlab's state dict loaded, SDPA attention by default) and samples with
``generate`` (left padding, KV cache, ``do_sample``). It is what a user of an off-the-shelf
inference stack gets: the same weights, different kernels, so a small real TIM that is never
bitwise zero. The result is returned in timlab's layout (``timlab.model.forward``).

Where it departs from calling ``generate`` directly:
- ``top_k=0`` is always passed (HF would default to 50) and every other sampling knob comes from
  a fresh ``GenerationConfig``, so the model folder's generation_config.json cannot change what
  is sampled.
- Randomness comes from the caller's ``torch.Generator``: one seed is drawn from it and
  ``generate`` runs under ``torch.random.fork_rng`` seeded with it, so the global RNG is untouched
  and the same generator state gives the same tokens.
- ``logprobs`` (log mu) are ``log_softmax`` of the raw logits (``output_logits``), after the
  caller's ``logits_processor`` when one is given (applied through an HF ``LogitsProcessor``
  that runs before temperature/top-k/top-p, as in the native engines); ``sampling_logprobs``
  come from the processed scores HF actually sampled from (``output_scores``).
- Weights are a copy. ``sync_weights()`` re-copies them; ``generate`` also re-syncs by itself
  when a timlab parameter changed since the last copy (tensor version counters, which optimizer
  steps and ``load_state_dict`` bump; writes through ``param.data`` do not), so a forgotten sync
  cannot turn TIM into silent off-policy drift.
"""

from __future__ import annotations

import torch

from timlab.engines.base import ENGINES, Engine, LogitsProcessor, SamplingParams, call_processor, import_backend
from timlab.errors import TimlabError, UsageError
from timlab.model.forward import gather_logprobs, positions_from_valid
from timlab.model.hf_io import config_to_hf, fuse_experts
from timlab.model.llama import CausalLM

MISSING_TRANSFORMERS = "the hf engine needs transformers: pip install timlab[hf]"


class MissingTransformersError(TimlabError, ImportError, ValueError):
    """transformers is not installed (a TimlabError: the CLI reports it as one line)."""


def _import_transformers():
    return import_backend("transformers", MissingTransformersError, MISSING_TRANSFORMERS)


def build_hf_model(model: CausalLM, *, attn_implementation: str = "sdpa"):
    """An HF ``*ForCausalLM`` with the same architecture, dtype, device and weights as ``model``."""
    transformers = _import_transformers()
    d = config_to_hf(model.config, model.dtype)
    d.pop("torch_dtype", None)
    d.pop("dtype", None)
    hf_config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation)
    hf = hf.to(device=model.device, dtype=model.dtype).eval()  # (``dtype=`` above needs transformers >= 4.56)
    hf.requires_grad_(False)
    copy_weights(model, hf)
    return hf


def copy_weights(model: CausalLM, hf) -> None:
    """Copy timlab's parameters into the HF model in place (names are the same; an MoE model's
    experts are fused into transformers' in-memory layout)."""
    src = model.state_dict()
    dst = hf.state_dict()
    if any(k.endswith("experts.gate_up_proj") for k in dst):
        src = fuse_experts(src)
    missing = [k for k in dst if k not in src and "rotary_emb" not in k]
    if missing:
        raise UsageError(f"HF model has weight {missing[0]!r} that the timlab model lacks")
    with torch.no_grad():
        for k, t in src.items():
            if k in dst:
                dst[k].copy_(t)


class _TimlabProcessor:
    """Adapts a timlab ``LogitsProcessor`` to HF's ``(input_ids, scores) -> scores`` interface.

    The column of the token being sampled is ``input_ids.shape[1]`` (HF's input_ids hold the
    P-wide left-padded prompt plus the tokens generated so far, exactly timlab's grid, so they are
    the tokens a ``reads_tokens`` processor is given). The processed logits are recorded: they
    define log mu.
    """

    def __init__(self, fn: LogitsProcessor):
        self.fn = fn
        self.outputs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = call_processor(self.fn, scores, input_ids.shape[1], lambda: input_ids)  # input_ids: (B, col)
        self.outputs.append(out.detach().float().clone())
        return out


@ENGINES.register("hf")
class HFEngine(Engine):
    """Rollouts from ``transformers`` ``generate`` (KV cache, SDPA) on a copy of the model."""

    name = "hf"

    def __init__(
        self,
        model: CausalLM,
        *,
        eos_token_id: int,
        pad_token_id: int | None = None,
        attn_implementation: str = "sdpa",
    ):
        super().__init__(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        self.transformers = _import_transformers()
        self.attn_implementation = attn_implementation
        self.hf_model = None
        self.sync_weights()

    # -- weights --------------------------------------------------------------------------
    copies_weights = True

    def sync_weights(self) -> None:
        """Re-copy the timlab weights (rebuild the HF model if dtype or device changed)."""
        hf = self.hf_model
        if hf is None or hf.dtype != self.model.dtype or hf.device != self.model.device:
            self.hf_model = build_hf_model(self.model, attn_implementation=self.attn_implementation)
        else:
            copy_weights(self.model, hf)
        self._synced = self._fingerprint()

    # -- teacher-forced scoring -----------------------------------------------------------
    @torch.no_grad()
    def score(self, tokens: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """HF forward over a (B, S) grid: log-prob (B, S) of each token given its prefix, column 0 = 0.

        attention_mask comes from key_valid and position_ids from ``positions_from_valid``, so
        the HF model sees exactly the trainer's inputs.
        """
        self._sync_if_stale()
        out = self.hf_model(
            input_ids=tokens,
            attention_mask=key_valid.long(),
            position_ids=positions_from_valid(key_valid),
            use_cache=False,
        )
        return gather_logprobs(out.logits.float(), tokens)[0]  # (B, S)

    # -- generation -----------------------------------------------------------------------
    def _generation_config(self, sampling: SamplingParams, max_new_tokens: int):
        greedy = sampling.temperature == 0
        knobs = {} if greedy else {  # greedy: leave them unset (HF warns about ignored flags)
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,  # 0 when off, never HF's default of 50
            "top_p": sampling.top_p,
        }
        return self.transformers.GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=not greedy,
            **knobs,
            num_beams=1,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            bos_token_id=None,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=True,
        )

    def _generate(self, prompts, tokens, key_valid, P, *, max_new_tokens, sampling, generator, logits_processor):
        B, S = tokens.shape
        dev = tokens.device
        processors = self.transformers.LogitsProcessorList()
        recorder = None
        if logits_processor is not None:
            recorder = _TimlabProcessor(logits_processor)
            processors.append(recorder)

        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        fork_devices = [dev] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=fork_devices):
            torch.manual_seed(seed)
            out = self.hf_model.generate(
                input_ids=tokens[:, :P],
                attention_mask=key_valid[:, :P].long(),
                generation_config=self._generation_config(sampling, max_new_tokens),
                logits_processor=processors,
            )
        gen = out.sequences[:, P:]  # (B, n) with n <= max_new_tokens
        n = gen.shape[1]
        model_logits = recorder.outputs[:n] if recorder is not None else out.logits  # n x (B, V)
        logp_model = torch.stack([torch.log_softmax(x.float(), -1) for x in model_logits], 1)  # (B, n, V)
        lp = logp_model.gather(-1, gen[..., None]).squeeze(-1)  # (B, n)
        if sampling.temperature == 0:
            lps = torch.zeros_like(lp)
        else:
            logp_sample = torch.stack([torch.log_softmax(x.float(), -1) for x in out.scores], 1)  # (B, n, V)
            lps = logp_sample.gather(-1, gen[..., None]).squeeze(-1)  # (B, n)

        is_eos = gen == self.eos_token_id  # (B, n)
        before_eos = (is_eos.long().cumsum(-1) - is_eos.long()) == 0  # up to and including the first EOS
        resp = torch.zeros(B, S, dtype=torch.bool, device=dev)
        resp[:, P : P + n] = before_eos
        tokens[:, P : P + n] = torch.where(before_eos, gen, torch.full_like(gen, self.pad_token_id))
        logp = torch.zeros(B, S, dtype=torch.float32, device=dev)
        logp_s = torch.zeros(B, S, dtype=torch.float32, device=dev)
        logp[:, P : P + n] = torch.where(before_eos, lp, 0.0)
        logp_s[:, P : P + n] = torch.where(before_eos, lps, 0.0)
        return self._rollout(tokens, key_valid, P, response_mask=resp, logprobs=logp, sampling_logprobs=logp_s,
                             finished=is_eos.any(-1))
