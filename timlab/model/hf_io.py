"""Read and write ordinary Hugging Face model folders (config.json + safetensors + tokenizer).

A folder written by ``transformers`` for LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or
Qwen3MoeForCausalLM loads here, and a folder written here loads in ``transformers``. transformers itself is not
needed: the config is read as JSON and the weights with safetensors. Sharded checkpoints
(``model.safetensors.index.json``) are read; ``pytorch_model.bin`` is read with
``weights_only=True`` as a fallback. Qwen3-MoE experts are read per expert
(``mlp.experts.3.gate_proj.weight``, what transformers writes and the Hub holds) or fused
(``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I), transformers
>= 5's in-memory layout), and written per expert.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from timlab.errors import TimlabError, UsageError
from timlab.kernels import check_device
from timlab.model.llama import ARCHITECTURES, CausalLM, ModelConfig

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(TimlabError, ValueError):
    """A model folder that cannot be loaded; the message names the file, key or field."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}; valid choices: {', '.join(DTYPES)}") from None


def config_from_hf(d: dict) -> ModelConfig:
    """Map an HF config.json dict onto ModelConfig, refusing what the model does not implement."""
    mtype = d.get("model_type")
    if not isinstance(mtype, str) or mtype not in ARCHITECTURES:
        archs = d.get("architectures")
        raise ModelLoadError(
            f"unsupported architecture model_type={mtype!r} (architectures={archs}); "
            f"valid choices: {', '.join(ARCHITECTURES)}"
        )
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported hidden_act={act!r}; valid choices: silu")
    if d.get("use_sliding_window"):
        raise ModelLoadError("unsupported use_sliding_window=true; only full attention is implemented")
    theta, rope_scaling = _rope_from_hf(d)
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    heads = _int(d, "num_attention_heads", None, 1, 1 << 10)
    vocab = _int(d, "vocab_size", None, 1, 1 << 22)
    token = lambda key, value: None if value is None else _int({key: value}, key, None, 0, vocab - 1)  # noqa: E731
    return ModelConfig(
        model_type=mtype,
        vocab_size=vocab,
        hidden_size=_int(d, "hidden_size", None, 1, 1 << 16),
        intermediate_size=_int(d, "intermediate_size", None, 1, 1 << 20),
        num_hidden_layers=_int(d, "num_hidden_layers", None, 1, 1 << 10),
        num_attention_heads=heads,
        num_key_value_heads=_int(d, "num_key_value_heads", heads, 1, heads) if d.get("num_key_value_heads") else heads,
        head_dim=_int(d, "head_dim", None, 1, 1 << 12) if d.get("head_dim") is not None else None,
        rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
        rope_theta=_float({"rope_theta": theta}, "rope_theta", None),
        rope_scaling=rope_scaling,
        max_position_embeddings=_int(d, "max_position_embeddings", 2048, 1, 1 << 24),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
        attention_bias=_bool(d, "attention_bias", False),
        mlp_bias=_bool(d, "mlp_bias", False),
        bos_token_id=token("bos_token_id", d.get("bos_token_id")),
        eos_token_id=token("eos_token_id", eos),
        pad_token_id=token("pad_token_id", d.get("pad_token_id")),
        **_moe_from_hf(d),
    )


def _field(d: dict, key: str, default):
    if key not in d or d[key] is None:
        if default is None:
            raise ModelLoadError(f"config.json is missing the field {key!r}")
        return default
    return d[key]


def _int(d: dict, key: str, default: int | None, lo: int, hi: int) -> int:
    """config.json's integer ``key`` in [lo, hi] (sizes far beyond any real model are refused:
    a million layers would hang the load, not fail it)."""
    v = _field(d, key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        shown = v if isinstance(v, (int, float)) and abs(v) < 1e30 else type(v).__name__
        raise ModelLoadError(f"config.json: {key} must be an integer in [{lo}, {hi}], got {shown!r}")
    return v


def _float(d: dict, key: str, default: float | None) -> float:
    v = _field(d, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ModelLoadError(f"config.json: {key} must be a finite number > 0, got {v!r}")
    return float(v)


def _bool(d: dict, key: str, default: bool) -> bool:
    v = _field(d, key, default)
    if not isinstance(v, bool):  # "false" is a string, and bool("false") is True
        raise ModelLoadError(f"config.json: {key} must be true or false, got {v!r}")
    return v


MAX_EXPERTS = 1 << 12
"""Most experts per MoE layer a config.json may declare (real models: 8-512)."""


def _moe_from_hf(d: dict) -> dict:
    """ModelConfig's MoE fields from a qwen3_moe config.json (HF's defaults where absent); {} otherwise.
    Each is type- and range-checked like the dense fields: a string, a float such as 4.9, null or a
    billion experts is a one-line error, never coerced."""
    if d.get("model_type") != "qwen3_moe":
        return {}
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "norm_topk_prob", "decoder_sparse_step"):
        if key in d and d[key] is None:  # an explicit null is not "use the default"
            raise ModelLoadError(f"config.json: {key} is null; give a value or leave the field out")
    experts_key = "num_experts" if "num_experts" in d or "num_local_experts" not in d else "num_local_experts"
    experts = _int(d, experts_key, 128, 1, MAX_EXPERTS)
    layers = _int(d, "num_hidden_layers", None, 1, 1 << 10)
    only = d.get("mlp_only_layers")
    if only is None:
        only = []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                             for i in only):
        raise ModelLoadError(f"config.json: mlp_only_layers must be a list of layer indices in [0, {layers - 1}], "
                             f"got {only!r}"[:200])
    return {
        "num_experts": experts,
        "num_experts_per_tok": _int(d, "num_experts_per_tok", 8, 1, experts),
        "moe_intermediate_size": _int(d, "moe_intermediate_size", 768, 1, 1 << 20),
        "norm_topk_prob": _bool(d, "norm_topk_prob", False),
        "decoder_sparse_step": _int(d, "decoder_sparse_step", 1, 1, 1 << 10),
        "mlp_only_layers": tuple(only),
    }


ROPE_KEYS = {  # the keys each RoPE type reads (besides rope_type and rope_theta), required first
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("original_max_position_embeddings",),
             ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


def _rope_from_hf(d: dict) -> tuple[float, dict | None]:
    """rope_theta and ModelConfig.rope_scaling from a config.json, read as transformers reads it:
    ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` (older), ``type`` as an old
    spelling of ``rope_type``, and ``original_max_position_embeddings`` for llama3 and yarn from
    the top level or else ``max_position_embeddings``."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"config.json: rope_parameters must be an object, got {type(rope).__name__}")
    rope = dict(rope)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    if rope_type not in ROPE_KEYS:
        raise ModelLoadError(f"unsupported rope_type={rope_type!r}; valid choices: {', '.join(ROPE_KEYS)}")
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("unsupported partial_rotary_factor != 1; RoPE rotates the whole head here")
    if rope_type in ("llama3", "yarn"):
        top = d.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = top or rope.get("original_max_position_embeddings") or d.get(
            "max_position_embeddings", 2048)
    required, optional = ROPE_KEYS[rope_type]
    missing = [k for k in required if rope.get(k) is None]
    if missing:
        raise ModelLoadError(f"rope_type={rope_type!r} needs {missing[0]!r} in rope_parameters")
    used = {k: v for k, v in rope.items() if k in required + optional}  # transformers ignores the rest too
    for k, v in used.items():
        if k == "truncate" and isinstance(v, bool):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ModelLoadError(f"config.json: rope_parameters.{k} must be a finite number > 0, got {v!r}")
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **used}


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """An HF config.json dict that transformers reads back as the same architecture."""
    d = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.dim_per_head,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)  # what transformers < 5 reads
    if cfg.model_type == "qwen3_moe":
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                 decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))
    if cfg.model_type == "llama":
        d["mlp_bias"] = cfg.mlp_bias
    else:
        d["use_sliding_window"] = False
    return d


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    """One safetensors file; a truncated or damaged one is a one-line error naming it."""
    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises SafetensorError, OSError or RuntimeError for a bad file
        raise ModelLoadError(f"{file}: unreadable safetensors file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _shard_file(folder: Path, index: Path, name) -> Path:
    """The shard ``name`` of a safetensors index in ``folder``: a plain file name (no folder, no
    ``..``, not absolute), naming a regular file (not a FIFO, which would block the read forever,
    nor a device such as /dev/zero, which would be hashed forever); else a one-line error. A shard
    that is a symlink to a regular file is followed, as the Hugging Face cache's snapshots are."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ModelLoadError(f"{index}: shard {name!r} is not a plain file name in {folder} (an index names "
                             "shards beside it, e.g. model-00001-of-00002.safetensors)")
    file = folder / name
    if not file.exists():
        raise ModelLoadError(f"{index}: shard {name!r} is missing")
    if not file.is_file():
        raise ModelLoadError(f"{file}: not a regular file")
    return file


def weight_files(path: str | Path) -> list[Path]:
    """The files that hold a model folder's weights, in the order they are read: ``model.safetensors``;
    else ``model.safetensors.index.json`` and its shards (sorted; each a plain name of a regular file
    in the folder, ``_shard_file``); else ``pytorch_model.bin``. A folder with none of them, or with
    one that is not a regular file, is a one-line error naming it."""
    path = Path(path)
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    for f in (single, index, path / "pytorch_model.bin"):
        if f.exists() and not f.is_file():  # a FIFO would block the read forever
            raise ModelLoadError(f"{f}: not a regular file")
    if single.exists():
        return [single]
    if index.exists():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({type(e).__name__})") from None
        return [index, *(_shard_file(path, index, shard) for shard in sorted(shards, key=str))]
    if (path / "pytorch_model.bin").exists():
        return [path / "pytorch_model.bin"]
    raise ModelLoadError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = weight_files(path)
    if files[0].name == "pytorch_model.bin":
        try:
            return torch.load(files[0], map_location="cpu", weights_only=True)
        except Exception as e:  # pickle, zip and torch errors of a damaged file
            raise ModelLoadError(f"{files[0]}: unreadable ({type(e).__name__})") from None
    out: dict[str, torch.Tensor] = {}
    for file in files[1:] if files[0].name.endswith(".index.json") else files:
        out.update(_load_file(file))
    return out


def _split_fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors (``...mlp.experts.gate_up_proj`` (E, 2I, H), ``...mlp.experts.down_proj``
    (E, H, I)) -> per-expert ``...mlp.experts.{e}.{gate,up,down}_proj.weight``, gate rows first (HF's
    ``chunk(2)``); other weights as they are."""
    out = {}
    for key, t in weights.items():
        prefix, _, name = key.rpartition(".")
        if prefix.endswith("mlp.experts") and name in ("gate_up_proj", "down_proj") and t.dim() == 3:
            for e in range(t.shape[0]):
                if name == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        else:
            out[key] = t
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights -> transformers >= 5's in-memory layout (``...mlp.experts.gate_up_proj``
    (E, 2I, H) with gate rows first, ``...mlp.experts.down_proj`` (E, H, I)); the inverse of
    ``_split_fused_experts``. Other weights as they are."""
    out, groups = {}, {}
    for key, t in state.items():
        parts = key.split(".")
        if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-1] == "weight":
            groups.setdefault(".".join(parts[:-3]), {})[(int(parts[-3]), parts[-2])] = t
        else:
            out[key] = t
    for prefix, w in groups.items():
        n = 1 + max(e for e, _ in w)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([w[e, "gate_proj"], w[e, "up_proj"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([w[e, "down_proj"] for e in range(n)])
    return out


def load_model(path: str | Path, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu") -> CausalLM:
    """Load an HF-format folder into a timlab CausalLM (eval mode, requested dtype/device)."""
    check_device(device)
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a model folder (no config.json file)")
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON, not UTF-8, a 5000-digit number, nesting
        raise ModelLoadError(f"{path / 'config.json'}: invalid JSON ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{path / 'config.json'}: expected a JSON object, got a {type(hf).__name__}")
    cfg = config_from_hf(hf)
    with torch.device("meta"):
        model = CausalLM(cfg)
    weights = _split_fused_experts(_read_weights(path))
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in weights]
    if missing:
        raise ModelLoadError(f"{path}: missing weight {missing[0]!r} ({len(missing)} missing in all)")
    for k, t in expected.items():
        if tuple(weights[k].shape) != tuple(t.shape):
            raise ModelLoadError(
                f"{path}: weight {k!r} has shape {tuple(weights[k].shape)}, expected {tuple(t.shape)}"
            )
    unexpected = sorted(k for k in weights if k not in expected and "rotary_emb" not in k)
    if unexpected:
        raise ModelLoadError(f"{path}: unexpected weight {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    model = model.to_empty(device=device)
    model.load_state_dict(weights, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.refresh_rope()
    return model.to(dtype=parse_dtype(dtype)).eval()


def save_model(model: CausalLM, path: str | Path, *, tokenizer_dir: str | Path | None = None) -> Path:
    """Write config.json, generation_config.json, model.safetensors (+ tokenizer files)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, model.dtype), indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists() and src.resolve() != (path / name).resolve():
                shutil.copy(src, path / name)
    return path
