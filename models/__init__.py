"""GPT model definitions (installed as megatron_sp.models)."""
from .config import PRESETS, GPTConfig, preset
from .gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel", "PRESETS", "preset"]
