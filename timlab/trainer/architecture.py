"""The SFT warm start's architecture: the config's model section as a ``ModelConfig``.

One home for the mapping, used where the warm start is built (``timlab.trainer.pretrain``) and
where an init folder is checked against it (``timlab.trainer.pretrain_init``). It imports nothing of
the config (only its type), so ``config.validate`` can reach the init check without an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from timlab.model.llama import ModelConfig

if TYPE_CHECKING:
    from timlab.config import Config
    from timlab.tokenizer import Tokenizer

MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
"""The model section's mixture-of-experts fields: hashed only for an MoE warm start, so the dense
warm starts keep the keys (and cache folders) they had before these fields existed."""

CONFIG_KEYS = {"model_type": "model.model_type", "hidden_size": "model.hidden_size",
               "intermediate_size": "model.intermediate_size", "num_hidden_layers": "model.num_layers",
               "num_attention_heads": "model.num_heads", "num_key_value_heads": "model.num_kv_heads",
               **{k: f"model.{k}" for k in MOE_KEYS}}
"""The config key behind each ModelConfig field that ``model_config_for`` takes from the config."""


def model_config_for(cfg: Config, vocab_size: int, tok: Tokenizer | None, max_len: int) -> ModelConfig:
    """The warm start's architecture for a vocabulary of ``vocab_size`` and sequences up to
    ``max_len`` tokens; the special-token ids from ``tok`` (None without one)."""
    m = cfg.model
    return ModelConfig(
        model_type=m.model_type,
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=max(m.max_position_embeddings, max_len),
        tie_word_embeddings=False,
        bos_token_id=None if tok is None else tok.bos_token_id,
        eos_token_id=None if tok is None else tok.eos_token_id,
        pad_token_id=None if tok is None else tok.pad_token_id,
        **({"num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_intermediate_size, "norm_topk_prob": m.norm_topk_prob}
           if m.num_experts else {}),
    )


__all__ = ["MOE_KEYS", "CONFIG_KEYS", "model_config_for"]
