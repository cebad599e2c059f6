"""One adapter per Hugging Face model family, looked up by ``config.model_type``."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from .base import Adapter, UnsupportedModelError
from .gpt2 import GPT2Adapter
from .gpt_neox import GPTNeoXAdapter
from .llama import LlamaAdapter
from .vit import ViTAdapter

ADAPTERS: dict[str, Adapter] = {
    model_type: adapter
    for adapter in (GPT2Adapter(), GPTNeoXAdapter(), LlamaAdapter(), ViTAdapter())
    for model_type in adapter.model_types
}


def supported_classes() -> str:
    return ", ".join(sorted({a.model_class.__name__ for a in ADAPTERS.values()}))


def adapter_for(config: PretrainedConfig) -> Adapter:
    """The adapter for ``config``; a clear error naming the supported models otherwise."""
    model_type = getattr(config, "model_type", None)
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; hf_lmc supports {supported_classes()} "
            f"(model types: {', '.join(sorted(ADAPTERS))})"
        )
    adapter.validate_config(config)
    return adapter


def read_config(folder: str | Path) -> PretrainedConfig:
    """The config of a model folder, read without running any code the folder ships: a config
    that needs its own code (``auto_map``) is refused in one line, and transformers never asks
    on stdin whether to run it."""
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except ValueError as err:
        if "trust_remote_code" not in str(err) and "auto_map" not in str(err):
            raise
        raise UnsupportedModelError(
            f"{folder} needs custom code (its config names an auto_map), which hf_lmc never runs; "
            f"hf_lmc supports {supported_classes()}"
        ) from None


__all__ = ["ADAPTERS", "Adapter", "UnsupportedModelError", "adapter_for", "read_config", "supported_classes"]
