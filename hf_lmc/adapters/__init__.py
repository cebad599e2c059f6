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


#: Config keys that do not change what a model computes at inference: names and versions, token
#: ids and label names, dropout (training only), caching and output switches, heads other classes
#: use (GPT-2's sequence summary, ViT's pooler and masked-image stride), and numerics-only switches.
NOT_FUNCTIONAL = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "model_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "id2label", "label2id",
    "problem_type", "tokenizer_class", "task_specific_params", "finetuning_task", "initializer_range",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "is_decoder", "is_encoder_decoder", "add_cross_attention", "tie_word_embeddings",
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "attention_dropout", "hidden_dropout", "classifier_dropout",
    "attention_probs_dropout_prob", "hidden_dropout_prob", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj", "pooler_act", "pooler_output_size", "encoder_stride",
    "pretraining_tp", "reorder_and_upcast_attn",
})


def setting_differences(config_a: PretrainedConfig, config_b: PretrainedConfig) -> list[str]:
    """The config keys on which two models of one family differ in what they compute without
    differing in tensor shapes: an activation, attention scaling, residual layout, rope or norm
    setting. A merge written under A's config would compute something else for B's part, so such
    pairs are refused. Keys whose B value changes A's shapes are widths (:mod:`hf_lmc.widths`
    embeds them or refuses them); keys in :data:`NOT_FUNCTIONAL` are left out;
    ``tie_word_embeddings`` is decided by the export."""
    a, b = config_a.to_dict(), config_b.to_dict()
    adapter = adapter_for(config_a)
    shapes = adapter.spec(config_a)
    differ = []
    for key in sorted(set(a) | set(b)):
        if key in NOT_FUNCTIONAL or key.startswith("_") or a.get(key) == b.get(key):
            continue
        try:
            changes_shapes = adapter.spec(type(config_a).from_dict({**a, key: b.get(key)})) != shapes
        except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError):
            changes_shapes = True  # no valid config of A's shapes takes B's value: a width
        if not changes_shapes:
            differ.append(key)
    return differ


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


__all__ = ["ADAPTERS", "NOT_FUNCTIONAL", "Adapter", "UnsupportedModelError", "adapter_for", "read_config", "setting_differences", "supported_classes"]
