"""Whole models built from tecupy.nn: `GPT` (a small decoder-only language model)."""
from .gpt import GPT, GPTConfig  # noqa: F401
