"""A Llama-family decoder (Llama, Qwen2, Qwen3, Qwen3-MoE) in plain PyTorch, readable in one sitting.

Parameter names follow Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...) so a
state dict moves between timlab and ``transformers`` without renaming. The model knows nothing
about RL. It has two numeric paths selected per call:

- ``exact``: batch-invariant ops (``timlab.model.ops``) over a fixed-length KV buffer. The
  trainer's teacher-forced forward and the exact engine's KV-cached decode both use it, so they
  produce bitwise-equal logits for the same token.
- ``fast``: the ordinary production path: stock ``F.linear`` on whatever rows there are and
  ``scaled_dot_product_attention`` over the keys written so far. Numerically close, not equal.

Departures from HF: RoPE cos/sin come from one table built at load time and indexed by
position (HF recomputes them per call; the values agree to ~1e-7). The RoPE types are HF's
default, linear, dynamic, yarn and llama3 (``ROPE_TYPES``). Dynamic NTK scaling changes every
frequency once a sequence passes ``max_position_embeddings``, differently for each length, which
no KV cache can reproduce, so timlab runs it only up to that length (where it is the default
RoPE, as in HF) and refuses longer sequences. Only SiLU activations and full attention are
supported; other configs are refused at load time. Qwen3-MoE's sparse MLP blocks live in
``timlab.model.moe``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from timlab.errors import UsageError
from timlab.model.attention_mask import additive_mask
from timlab.model.linear import MappedInputLinear, mode_linear  # noqa: F401 (MappedInputLinear: re-exported)
from timlab.model.moe import Routing, SparseMoeBlock, swiglu
from timlab.model.ops import fixed_length_attention, invariant_linear, triton_kernels

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""Supported ``model_type`` values and the HF class each one is saved as."""

MODES = ("exact", "fast")

ROUTER_OP = "router_experts"
"""Op-hook name suffix (``layers.{i}.router_experts``) of an MoE layer's chosen experts (B, M, k) long."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (the subset of HF's config that timlab uses)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    model_type: str = "llama"
    """One of ARCHITECTURES: llama, qwen2 (q/k/v bias), qwen3 (q/k RMSNorm), qwen3_moe (qwen3 with
    sparse mixture-of-experts MLPs, ``timlab.model.moe``)."""
    head_dim: int | None = None
    """Defaults to hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    """None for the default RoPE, else HF's ``rope_parameters`` less ``rope_theta``: ``rope_type``
    (one of ROPE_TYPES) and that type's keys, e.g. ``{"rope_type": "linear", "factor": 4.0}``."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Llama/Qwen3: bias on q, k, v and o. Qwen2 always has q/k/v bias and no o bias."""
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    num_experts: int = 0
    """qwen3_moe: experts per sparse MLP (0: every MLP dense)."""
    num_experts_per_tok: int = 0
    """qwen3_moe: experts each token is routed to (top k)."""
    moe_intermediate_size: int = 0
    """qwen3_moe: each expert's SwiGLU width (``intermediate_size`` is the dense MLPs')."""
    norm_topk_prob: bool = False
    """qwen3_moe: renormalize the top-k router probabilities to sum to 1 (HF's default: False)."""
    decoder_sparse_step: int = 1
    """qwen3_moe: layer i is sparse when (i + 1) % decoder_sparse_step == 0 (and not in mlp_only_layers)."""
    mlp_only_layers: tuple[int, ...] = ()
    """qwen3_moe: layers that keep a dense MLP."""

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise UsageError(
                f"unsupported architecture model_type={self.model_type!r}; "
                f"valid choices: {', '.join(ARCHITECTURES)}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UsageError(f"unsupported rope_type={rope_type!r}; valid choices: {', '.join(ROPE_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UsageError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.model_type != "qwen3_moe" and self.num_experts:
            raise UsageError(f"num_experts={self.num_experts} needs model_type='qwen3_moe', got {self.model_type!r}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise UsageError(f"num_experts_per_tok must be in 1..num_experts={self.num_experts}, "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise UsageError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
            if self.decoder_sparse_step < 1:
                raise UsageError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type != "qwen2" and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a mixture-of-experts MLP (HF's rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def is_moe(self) -> bool:
        return any(self.is_sparse(i) for i in range(self.num_hidden_layers))

    @property
    def layer_macs_per_token(self) -> int:
        """Multiply-adds of one position through all decoder layers' linears (no attention, no head)."""
        d, h, hk = self.dim_per_head, self.num_attention_heads, self.num_key_value_heads
        attn = self.hidden_size * d * (2 * h + 2 * hk)
        dense = 3 * self.hidden_size * self.intermediate_size
        sparse = self.hidden_size * (self.num_experts + 3 * self.num_experts_per_tok * self.moe_intermediate_size)
        return sum(attn + (sparse if self.is_sparse(i) else dense) for i in range(self.num_hidden_layers))


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalize in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = triton_kernels(x)  # CUDA: one fixed reduction per row (timlab.kernels)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# RoPE inverse frequencies, one function per HF rope_type, each written as transformers'
# modeling_rope_utils computes it (same operations in the same order, so the same fp32 values).
# Each returns (inv_freq (d/2,), attention_factor): the factor scales cos and sin (yarn only).
def _default_inv_freq(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    d = cfg.dim_per_head
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d)), 1.0


def _linear_inv_freq(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency divided by ``factor``."""
    inv_freq, _ = _default_inv_freq(cfg, device)
    return inv_freq / cfg.rope_scaling["factor"], 1.0


def _llama3_inv_freq(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth ramp between."""
    r = cfg.rope_scaling
    inv_freq, _ = _default_inv_freq(cfg, device)
    factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old_context_len = r["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_inv_freq(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones, ramp between, and
    scale cos/sin by the attention factor."""
    r = cfg.rope_scaling
    d, base = cfg.dim_per_head, cfg.rope_theta
    original = r["original_max_position_embeddings"]
    factor = r.get("factor") or cfg.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        m, m_all = r.get("mscale"), r.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(r.get("beta_fast") or 32), correction_dim(r.get("beta_slow") or 1)
    if r.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001  # as HF: no zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, d, 2, device=device, dtype=torch.float) / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where a frequency is kept (extrapolated), 0 where interpolated
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


ROPE_TYPES = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "dynamic": _default_inv_freq,  # up to max_position_embeddings, where it is the default (see above)
    "yarn": _yarn_inv_freq,
    "llama3": _llama3_inv_freq,
}
"""HF rope_type -> the function that computes its inverse frequencies."""


def rope_table(cfg: ModelConfig, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (length, head_dim), fp32, the config's RoPE type (values do not depend
    on length; a dynamic one is refused past max_position_embeddings)."""
    if cfg.rope_type == "dynamic" and length > cfg.max_position_embeddings:
        raise UsageError(  # engines refuse such lengths before (max_position_embeddings)
            f"dynamic RoPE scaling past max_position_embeddings={cfg.max_position_embeddings} (here {length} "
            "positions) changes every frequency with the sequence length, which a KV cache cannot reproduce"
        )
    inv_freq, attention_factor = ROPE_TYPES[cfg.rope_type](cfg, device)
    pos = torch.arange(length, dtype=torch.float, device=device)
    freqs = pos[:, None] * inv_freq[None, :]  # (P, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (P, d)
    if attention_factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, M, D); cos, sin: (B, 1, M, D) already gathered at the tokens' positions."""
    return x * cos + _rotate_half(x) * sin


@dataclass
class KVCache:
    """Per-layer key/value buffers of one fixed length S, shape (B, H_kv, S, D) each."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, length: int, dtype, device=None) -> "KVCache":
        shape = (batch, cfg.num_key_value_heads, length, cfg.dim_per_head)
        zeros = lambda: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        n = cfg.num_hidden_layers
        return cls([zeros() for _ in range(n)], [zeros() for _ in range(n)])

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def rows(self, idx: torch.Tensor) -> "KVCache":
        """The buffers of the sequences ``idx`` selects (a bool mask or indices, repeats allowed)."""
        return KVCache([k[idx] for k in self.keys], [v[idx] for v in self.values])


@dataclass
class Step:
    """What one forward call computes: which columns, where, and what each query may see.

    positions: (B, M) RoPE positions of the M input tokens.
    start: column of the first input token in the S-long buffer (tokens fill start..start+M-1).
    allowed: (B, 1, M, S) bool attention mask over the whole buffer (exact mode), or over the
      first start+M columns (fast mode).
    rows: optional (N,) long, ascending indices into the flattened (B*M) grid: compute only these
      positions (exact teacher-forced calls). Each linear runs on the N packed rows; attention
      runs on the (B, M) grid with zero queries, keys and values at the skipped positions. The
      caller skips only keys that no computed query may see, so computed positions get the same
      bits as without ``rows``; outputs at skipped positions are zeros.
    cos, sin: optional (B, 1, M, D) RoPE values at ``positions`` in the model's dtype, as
      ``CausalLM.rope_at`` gives them (a decode loop slices them from one table per rollout);
      computed from ``positions`` when None. Not used with ``rows``.
    """

    positions: torch.Tensor
    start: int
    allowed: torch.Tensor
    rows: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    routing: Routing | None = None
    """MoE models: records each sparse layer's experts (and forces them, for router replay)."""
    write_at: torch.Tensor | None = None
    """A one-token decode call with a KV cache: (1,) long, the buffer column its key and value go
    to, on the device (``start`` is then only the CPU attention's key count), and attention runs
    over the whole buffer in both modes. What a step captured as a CUDA graph needs: one recorded
    write serves every column (``timlab.engines.device_loop``)."""
    workspace: dict | None = None
    """Calls without autograd that follow one another (a decode loop's): buffers the exact
    attention reuses across calls (``ops.fixed_length_attention``); None allocates per call."""


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, hk = cfg.dim_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
        self.n_heads, self.n_kv, self.head_dim = h, hk, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hk * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hk * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d**-0.5
        self.kv_store: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Applied to keys and values as they are written into a KV cache (same shape and dtype
        out): a rollout injector's simulated low-precision cache (``timlab.injectors.kv_cache``)."""

    def forward(self, x, cos, sin, step: Step, cache_k, cache_v, mode: str) -> torch.Tensor:
        B, M, _ = x.shape
        q = mode_linear(mode, x, self.q_proj).view(B, M, self.n_heads, self.head_dim)
        k = mode_linear(mode, x, self.k_proj).view(B, M, self.n_kv, self.head_dim)
        v = mode_linear(mode, x, self.v_proj).view(B, M, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, M, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if step.rows is not None:  # packed (1, H, N, D) -> the (B, H, M, D) grid
            q, k, v = (_to_grid(t, step) for t in (q, k, v))
            B, M = q.shape[0], q.shape[2]

        if cache_k is None:  # teacher-forced: the inputs are the first M columns of the buffer
            keys, values = k, v
            width = step.allowed.shape[-1]
            if mode == "exact" and width > M:  # zero-pad to the decode buffer's length S
                keys = F.pad(k, (0, 0, 0, width - M))
                values = F.pad(v, (0, 0, 0, width - M))
        else:  # write this call's columns into the fixed buffer
            end = step.start + M
            if self.kv_store is not None:
                k, v = self.kv_store(k), self.kv_store(v)
            if step.write_at is not None:  # the column is a device tensor (M = 1)
                cache_k.index_copy_(2, step.write_at, k)
                cache_v.index_copy_(2, step.write_at, v)
                keys, values = cache_k, cache_v
            else:
                cache_k[:, :, step.start : end] = k
                cache_v[:, :, step.start : end] = v
                keys, values = (cache_k, cache_v) if mode == "exact" else (cache_k[:, :, :end], cache_v[:, :, :end])
        rep = self.n_heads // self.n_kv
        if mode == "exact":  # handles grouped-query attention itself, without copying the KV buffer
            out = fixed_length_attention(q, keys, values, step.allowed, self.scale, start=step.start,
                                         cache=step.extras,  # the layers share the block masks
                                         workspace=step.workspace)
        else:
            if rep > 1:  # grouped-query attention: (B, H_kv, S, D) -> (B, H, S, D)
                keys = keys.repeat_interleave(rep, dim=1)
                values = values.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=_sdpa_mask(step, q), scale=self.scale)
        out = out.transpose(1, 2).reshape(B, M, self.n_heads * self.head_dim)  # (B, M, H*D)
        if step.rows is not None:
            out = out.reshape(B * M, -1)[step.rows][None]  # (1, N, H*D)
        return mode_linear(mode, out, self.o_proj)


def _sdpa_mask(step: Step, q: torch.Tensor) -> torch.Tensor:
    """The fast mode's attention mask for ``scaled_dot_product_attention``. On the CPU, the additive
    (B, 1, M, W) mask SDPA itself makes of a bool one (0 where allowed, -inf elsewhere, q's dtype),
    built once per Step and shared by the layers (SDPA would rebuild it in every layer); elsewhere
    ``step.allowed`` as it is (CUDA backends convert a bool mask in their own ways)."""
    if not q.is_cpu or step.allowed.dtype != torch.bool:
        return step.allowed
    key = ("sdpa_mask", q.dtype)
    mask = step.extras.get(key)
    if mask is None:
        mask = additive_mask(step.allowed, q.dtype)
        step.extras[key] = mask
    return mask


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        return swiglu(mode, x, self.gate_proj, self.up_proj, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.sparse = cfg.is_sparse(index)
        if self.sparse:
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                      cfg.num_experts_per_tok, cfg.norm_topk_prob, index)
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def ffn(self, x: torch.Tensor, mode: str, routing: Routing | None = None) -> torch.Tensor:
        """The MLP: dense, or the MoE block (recording into / forced by ``routing``)."""
        return self.mlp(x, mode, routing) if self.sparse else self.mlp(x, mode)

    def forward(self, x, cos, sin, step, cache_k, cache_v, mode):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, step, cache_k, cache_v, mode)
        return x + self.ffn(self.post_attention_layernorm(x), mode, step.routing)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@torch.no_grad()
def random_init_(model: nn.Module, generator: torch.Generator, std: float = 0.3) -> nn.Module:
    """Seeded random weights, in place, for tests and sample data (timlab's model or a
    transformers one): each parameter in ``named_parameters`` order draws N(0, 1) noise from
    ``generator``; norm weights become 1 + 0.1 noise, every other tensor ``std`` x noise."""
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)
    return model


class CausalLM(nn.Module):
    """The decoder plus its LM head; ``state_dict()`` keys are HF's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        """fp32 RoPE tables per device; not buffers, so casting the model never rounds them."""
        self.lm_head_fp32 = False
        """Compute the LM head in fp32 whatever the body's dtype (a precision remedy)."""
        self.hooks: list = []
        """Callables ``hook(name, tensor)`` called at each op boundary (attribution probe); MoE
        layers also report their chosen experts (``ROUTER_OP``)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rope(self, device: torch.device, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables covering at least ``length`` positions (grown by doubling, cached)."""
        cached = self._rope.get(device)
        if cached is None or cached[0].shape[0] < length:
            n = min(max(256, 2 ** (length - 1).bit_length()), max(length, self.config.max_position_embeddings))
            self._rope[device] = rope_table(self.config, n, device)
        return self._rope[device]

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, M, D) in ``dtype`` at ``positions`` (B, M)."""
        cos_t, sin_t = self.rope(positions.device, int(positions.max()) + 1)
        return cos_t[positions].to(dtype).unsqueeze(1), sin_t[positions].to(dtype).unsqueeze(1)

    def refresh_rope(self) -> None:
        self._rope.clear()

    def _emit(self, name: str, t: torch.Tensor) -> None:
        for hook in self.hooks:
            hook(name, t)

    def hidden_states(
        self, input_ids: torch.Tensor, step: Step, cache: KVCache | None = None, mode: str = "exact"
    ) -> torch.Tensor:
        """Final-norm hidden states (B, M, hidden) for input_ids (B, M)."""
        return _unpack(self._hidden(input_ids, step, cache, mode), step)

    def _hidden(self, input_ids: torch.Tensor, step: Step, cache: KVCache | None, mode: str) -> torch.Tensor:
        """hidden_states, packed to (1, N, hidden) when ``step.rows`` is set."""
        if mode not in MODES:
            raise UsageError(f"unknown mode {mode!r}; valid choices: {', '.join(MODES)}")
        x = self.model.embed_tokens(input_ids)  # (B, M, hidden)
        positions = step.positions
        if step.rows is not None:
            x = x.reshape(-1, x.shape[-1])[step.rows][None]  # (1, N, hidden)
            positions = positions.reshape(-1)[step.rows][None]  # (1, N)
        self._emit("embed", x)
        if step.cos is not None and step.rows is None:
            cos, sin = step.cos, step.sin  # (B, 1, M, D)
        else:
            cos, sin = self.rope_at(positions, x.dtype)  # (B, 1, M, D)
        for i, layer in enumerate(self.model.layers):
            ck = cache.keys[i] if cache is not None else None
            cv = cache.values[i] if cache is not None else None
            if self.hooks:
                h = layer.input_layernorm(x)
                self._emit(f"layers.{i}.attn_norm", h)
                a = layer.self_attn(h, cos, sin, step, ck, cv, mode)
                self._emit(f"layers.{i}.attn_out", a)
                x = x + a
                h = layer.post_attention_layernorm(x)
                self._emit(f"layers.{i}.mlp_norm", h)
                routing = step.routing if step.routing is not None or not layer.sparse else Routing()
                m = layer.ffn(h, mode, routing)
                if layer.sparse:
                    self._emit(f"layers.{i}.{ROUTER_OP}", routing.chosen[i])  # (B, M, k) long
                self._emit(f"layers.{i}.mlp_out", m)
                x = x + m
                self._emit(f"layers.{i}.output", x)
            else:
                x = layer(x, cos, sin, step, ck, cv, mode)
        x = self.model.norm(x)
        self._emit("final_norm", x)
        return x

    def logits_from_hidden(self, h: torch.Tensor, mode: str = "exact") -> torch.Tensor:
        """LM head: (..., hidden) -> (..., V) fp32 logits."""
        w = self.lm_head.weight
        if self.lm_head_fp32:
            h, w = h.float(), w.float()
        if mode == "exact":
            logits = invariant_linear(h, w)
        else:
            logits = F.linear(h, w)
        logits = logits.float()
        self._emit("logits", logits)
        return logits

    def forward(
        self, input_ids: torch.Tensor, step: Step, cache: KVCache | None = None, mode: str = "exact"
    ) -> torch.Tensor:
        """Logits (B, M, V) in fp32 for input_ids (B, M) (zeros at positions ``step.rows`` skips)."""
        return _unpack(self.logits_from_hidden(self._hidden(input_ids, step, cache, mode), mode), step)


def _to_grid(t: torch.Tensor, step: Step) -> torch.Tensor:
    """Packed (1, H, N, D) -> (B, H, M, D) with zeros at the positions ``step.rows`` skips."""
    B, M = step.allowed.shape[0], step.allowed.shape[2]
    H, D = t.shape[1], t.shape[3]
    grid = t.new_zeros(B * M, H, D).index_copy(0, step.rows, t[0].transpose(0, 1))  # (B*M, H, D)
    return grid.view(B, M, H, D).transpose(1, 2)


def _unpack(t: torch.Tensor, step: Step) -> torch.Tensor:
    """Packed (1, N, X) -> (B, M, X) with zeros at the skipped positions; t itself without ``step.rows``."""
    if step.rows is None:
        return t
    B, M = step.allowed.shape[0], step.allowed.shape[2]
    return t.new_zeros(B * M, t.shape[-1]).index_copy(0, step.rows, t[0]).view(B, M, t.shape[-1])
