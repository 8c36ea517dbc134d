"""Single-device models and their Hugging Face import/export."""

from .config import ModelConfig
from .kv_cache import KVCache
from .presets import PRESETS, apply_preset
from .transformer import Transformer, build_model, count_params, initial_value

__all__ = [
    "PRESETS",
    "ModelConfig",
    "apply_preset",
    "KVCache",
    "Transformer",
    "build_model",
    "count_params",
    "initial_value",
    "load_hf",
    "save_hf",
]


def load_hf(path, dtype=None, device="cpu"):
    """Reads a Hugging Face Llama or GPT-2 directory into a :class:`Transformer` (see ``hf.py``)."""
    from .hf import load_hf as _load

    return _load(path, dtype=dtype, device=device)


def save_hf(model, path, dtype=None):
    """Writes ``model`` as a Hugging Face directory that ``transformers`` loads (see ``hf.py``)."""
    from .hf import save_hf as _save

    return _save(model, path, dtype=dtype)
