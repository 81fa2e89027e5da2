"""timlab: a lab for training-inference mismatch (TIM) in RL of language models."""

__version__ = "0.1.0"
