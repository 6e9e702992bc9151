"""Torch models: the built-in transformer zoo (Megatron-style tensor parallel) and users' factory models."""
from harness.models.transformer import TORCH_DTYPES, build_layer

__all__ = ["TORCH_DTYPES", "build_layer"]
