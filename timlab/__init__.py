"""timlab: a lab for training-inference mismatch (TIM) in RL of language models."""

from timlab.machine import prepare_exact_cpu as _prepare_exact_cpu

__version__ = "0.1.0"

_prepare_exact_cpu()  # MKL and oneDNN settings the exact CPU path needs on this CPU (timlab.machine)
