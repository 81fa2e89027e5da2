"""The model: a Llama-family decoder (Llama, Qwen2, Qwen3, Qwen3-MoE) in plain PyTorch, HF folder I/O, the
batch-invariant ops of the exact path, and teacher-forced scoring. Knows nothing about RL.

Importing it sets the MKL and oneDNN settings the exact path needs on this CPU (Intel, AMX:
``timlab.machine.exact_cpu_env``) unless they are set; the pure layers (metrics, remedies,
schedulers) and the TRL / verl plug-ins do not import it, so they leave a user's process as it is."""

from timlab.machine import prepare_exact_cpu

prepare_exact_cpu()  # before any of the exact path's matmuls: MKL and oneDNN read these at their first call

from timlab.model.hf_io import ModelLoadError, load_model, save_model
from timlab.model.llama import ARCHITECTURES, CausalLM, ModelConfig

__all__ = ["ARCHITECTURES", "CausalLM", "ModelConfig", "ModelLoadError", "load_model", "save_model"]
