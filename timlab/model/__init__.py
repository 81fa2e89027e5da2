"""The model: a Llama-family decoder (Llama, Qwen2, Qwen3, Qwen3-MoE) in plain PyTorch, HF folder I/O, the
batch-invariant ops of the exact path, and teacher-forced scoring. Knows nothing about RL."""

from timlab.model.hf_io import ModelLoadError, load_model, save_model
from timlab.model.llama import ARCHITECTURES, CausalLM, ModelConfig

__all__ = ["ARCHITECTURES", "CausalLM", "ModelConfig", "ModelLoadError", "load_model", "save_model"]
