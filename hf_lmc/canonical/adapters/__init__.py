"""One adapter per Hugging Face model family, looked up by ``config.model_type``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import ValidationError
from transformers import AutoConfig, PretrainedConfig

from hf_lmc.canonical.adapters.base import Adapter, ConfigError, ConfigSchema, UnsupportedModelError
from hf_lmc.canonical.adapters.gpt2 import GPT2Adapter
from hf_lmc.canonical.adapters.gpt_neox import GPTNeoXAdapter
from hf_lmc.canonical.adapters.llama import LlamaAdapter
from hf_lmc.canonical.adapters.vit import ViTAdapter
from hf_lmc.config.options import clipped

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


#: Config keys every family shares that name what the merge inherits from A rather than how it
#: computes: token ids and label maps, checked with the tokenizer and processor files
#: (:func:`hf_lmc.io.inherit.check_inherited`), which may accept A's.
INHERITED_KEYS = frozenset(
    {"bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "id2label", "label2id"}
)
#: Keys that record who wrote a config, not what it says: never noted.
_BOOKKEEPING = frozenset({"transformers_version"})

ConfigKeyKind = Literal["function", "shape", "inherited", "informational"]


def config_key_kind(adapter: Adapter, key: str) -> ConfigKeyKind:
    """What a config key of ``adapter``'s family is, from the adapter's tables: ``function`` (it
    changes what the model computes: :attr:`Adapter.function_keys`), ``shape`` (it sets tensor
    shapes: :attr:`Adapter.shape_keys` and the width keys), ``inherited`` (:data:`INHERITED_KEYS`),
    else ``informational``: no adapter and no stock class reads it to compute (a free-text note,
    a legacy field, dropout, caching switches), and an unknown key is informational too."""
    if key in adapter.function_keys:
        return "function"
    if key in adapter.shape_keys or key in adapter.width_keys.values():
        return "shape"
    if key in INHERITED_KEYS:
        return "inherited"
    return "informational"


def setting_differences(config_a: PretrainedConfig, config_b: PretrainedConfig) -> list[str]:
    """The function and shape keys (:func:`config_key_kind`) on which two models of one family
    differ without the architecture spec showing it: an activation, attention scaling, residual
    layout, rope setting, a position table's length or a bias that one has and the other lacks.
    A merge written under A's config would compute something else for B's part, so such pairs are
    refused. A key whose B value changes A's spec is left to the spec comparison (widths are
    embedded, :mod:`hf_lmc.canonical.widths`; other spec fields refused there); a width key that changes
    nothing (``n_inner`` unset vs ``4 * n_embd``) is no difference; every other key is
    :func:`informational_differences` or inherited."""
    a, b = config_a.to_dict(), config_b.to_dict()
    adapter = adapter_for(config_a)
    shapes = adapter.spec(config_a)
    differ = []
    for key in sorted(set(a) | set(b)):
        kind = config_key_kind(adapter, key)
        if kind not in ("function", "shape") or a.get(key) == b.get(key):
            continue
        try:
            changes_spec = adapter.spec(type(config_a).from_dict({**a, key: b.get(key)})) != shapes
        except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError):
            changes_spec = True  # no valid config of A's spec takes B's value: the spec comparison says what differs
        if not changes_spec and key not in adapter.width_keys.values():
            differ.append(key)
    return differ


def informational_differences(config_a: PretrainedConfig, config_b: PretrainedConfig) -> list[str]:
    """The informational keys (:func:`config_key_kind`) whose values differ: the merge keeps A's
    and its card says so. Private (``_name_or_path``) and bookkeeping keys are left out."""
    a, b = config_a.to_dict(), config_b.to_dict()
    adapter = adapter_for(config_a)
    return [
        key
        for key in sorted(set(a) | set(b))
        if not key.startswith("_")
        and key not in _BOOKKEEPING
        and config_key_kind(adapter, key) == "informational"
        and a.get(key) != b.get(key)
    ]


def read_config(folder: str | Path) -> PretrainedConfig:
    """The config of a model folder, read without running any code the folder ships: a config
    that needs its own code (``auto_map``) is refused in one line, and transformers never asks
    on stdin whether to run it.

    ``config.json`` is first read as JSON and checked against the family's
    :attr:`~hf_lmc.canonical.adapters.base.Adapter.config_schema`, so a folder that is not a model, a file
    that is not JSON, or a key of the wrong type (``"n_layer": "12"``) is refused in one line
    naming the file and the key, before transformers builds a config from it.
    """
    check_config_file(Path(folder))
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except ValueError as err:
        if "trust_remote_code" not in str(err) and "auto_map" not in str(err):
            raise ConfigError(
                f"{Path(folder) / 'config.json'}: {_why_refused(err)}; fix the file or restore it from the model's source"
            ) from None
        raise UnsupportedModelError(
            f"{folder} needs custom code (its config names an auto_map), which hf_lmc never runs; "
            f"hf_lmc supports {supported_classes()}"
        ) from None
    except Exception as err:  # noqa: BLE001 (a config class's own checks raise what they like: AttributeError, the Hub's dataclass errors)
        raise ConfigError(
            f"{Path(folder) / 'config.json'}: {_why_refused(err)}; fix the file or restore it from the model's source"
        ) from None


def _why_refused(err: BaseException) -> str:
    """What transformers said when it refused to build a config, as one short clause: the first
    line of the error, or of its cause where it wraps one (the Hub's dataclass checks do)."""
    cause = err.__cause__ or err
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    text = lines[0] if lines else type(cause).__name__
    return f"transformers cannot build a config from it ({text if len(text) <= 160 else text[:157] + '...'})"


#: Files that say what a folder without ``config.json`` holds, if not a model.
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf")


def _not_a_model_folder(folder: Path) -> str:
    """Why ``folder``, which has no ``config.json``, cannot be merged, and what to pass instead."""
    if not folder.is_dir():
        return f"{folder} is not a folder; pass a model folder (config.json and weights) or a Hub id"
    if os.path.lexists(folder / "config.json"):  # a folder, a device, a FIFO or a dangling link of that name
        return f"{folder / 'config.json'} is not a regular file; put the model's config.json file there"
    if (folder / "adapter_config.json").is_file():
        return (
            f"{folder} is a PEFT adapter (adapter_config.json, no config.json), not a model: merge the base models and "
            "carry the adapter into the merge with hf-lmc apply MERGE ADAPTER, or merge its base with the adapter "
            "folded in (a recipe's adapter: key)"
        )
    weights = next((f.name for pattern in _WEIGHT_PATTERNS for f in sorted(folder.glob(pattern))), None)
    if weights is not None:
        return f"{folder} holds weights ({clipped(weights)}) but no config.json; put the config.json of the model they belong to beside them"
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return f"{folder} is empty; pass a model folder (config.json and weights) or a Hub id"
    shown = ", ".join(clipped(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{folder} has no config.json, so it is not a Hugging Face model folder (it holds {shown})"


#: What a pydantic error type means for a config key, as "must be ...".
_EXPECTED = {
    "int_type": "an integer",
    "greater_than_equal": "an integer >= 1",
    "float_type": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "bool_type": "true or false",
    "dict_type": "a JSON object",
}


def check_config_file(folder: Path) -> dict:
    """``folder/config.json`` read as a JSON object and checked against its family's schema (model
    families hf_lmc does not merge are checked for ``model_type`` alone); :class:`ConfigError`,
    one line naming the file and the key, otherwise."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(_not_a_model_folder(folder))
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        where = f" (line {err.lineno} column {err.colno})" if isinstance(err, json.JSONDecodeError) else ""
        raise ConfigError(f"{path} is not valid JSON{where}; restore it from the model's source") from None
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object of config keys, got a JSON {type(raw).__name__}")
    if "quantization_config" in raw:
        raise ConfigError(
            f"{path}: quantization_config: the model is quantised and hf_lmc merges float weights (F16, BF16, F32, F64); "
            "dequantise it first"
        )
    adapter = ADAPTERS.get(raw.get("model_type")) if isinstance(raw.get("model_type"), str) else None
    try:
        (adapter.config_schema if adapter else ConfigSchema).model_validate(raw)
    except ValidationError as err:
        error = err.errors()[0]
        key = ".".join(map(str, error["loc"]))
        if error["type"] == "missing":
            raise ConfigError(
                f"{path} has no {key} key; hf_lmc merges model types {', '.join(sorted(ADAPTERS))}"
            ) from None
        expected = _EXPECTED.get(error["type"], error["msg"].removeprefix("Input should be ").lower())
        raise ConfigError(f"{path}: {key} must be {expected}, got {clipped(error['input'])}") from None
    return raw


__all__ = [
    "ADAPTERS",
    "INHERITED_KEYS",
    "Adapter",
    "ConfigError",
    "UnsupportedModelError",
    "adapter_for",
    "check_config_file",
    "config_key_kind",
    "informational_differences",
    "read_config",
    "setting_differences",
    "supported_classes",
]
