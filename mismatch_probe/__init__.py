"""mismatch-probe: measure the training-inference mismatch of LLM checkpoints."""

__version__ = "0.1.0"
