"""Small reference models used by the demo, the examples, the tests and the benchmarks."""
from graphpar.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
