"""LLaMA (``LlamaForCausalLM``): RMSNorm, full RoPE, GQA, SwiGLU, optional biases and tying.

RMSNorm has no shift and needs no centring: gains fold into readers and residual rotations
are free on all of R^d.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import FiniteFloat
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from hf_lmc.canonical.adapters.base import Adapter, ConfigSchema, Count, UnsupportedModelError, fold_norm, require_zero
from hf_lmc.canonical.spec import ArchSpec, Group

_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_MLP = {"up": "up_proj", "gate": "gate_proj", "down": "down_proj"}


class LlamaConfigSchema(ConfigSchema):
    """The LLaMA ``config.json`` keys the adapter and ``LlamaForCausalLM`` read."""

    hidden_size: Count = None
    num_attention_heads: Count = None
    num_key_value_heads: Count | None = None
    head_dim: Count | None = None
    num_hidden_layers: Count = None
    intermediate_size: Count = None
    max_position_embeddings: Count = None
    vocab_size: Count = None
    rms_norm_eps: FiniteFloat = None
    rope_theta: FiniteFloat = None
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None
    hidden_act: str = None
    attention_bias: bool = None
    mlp_bias: bool = None
    pretraining_tp: Count | None = None


class LlamaAdapter(Adapter):
    model_types = ("llama",)
    model_class = LlamaForCausalLM
    tiny_config: ClassVar[dict] = {
        "hidden_size": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 12,
        "vocab_size": 17,
    }
    config_schema = LlamaConfigSchema
    heads_input = "model.layers.{i}.self_attn.o_proj"
    heads_by_width = True
    mlp_input = "model.layers.{i}.mlp.down_proj"
    width_keys: ClassVar[dict[str, str]] = {
        "hidden_size": "hidden_size",
        "intermediate_size": "intermediate_size",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "head_dim": "head_dim",  # explicit: hidden_size / heads may change it
    }
    function_keys = frozenset(
        {
            "hidden_act",
            "rms_norm_eps",
            "max_position_embeddings",
            "rope_parameters",
            "rope_scaling",
            "rope_theta",
            "partial_rotary_factor",
        }
    )
    shape_keys = frozenset({"vocab_size", "num_hidden_layers", "attention_bias", "mlp_bias"})
    ignored_keys = (r"\.rotary_emb\.inv_freq$",)
    vocab_keys = ("model.embed_tokens.weight", "lm_head.weight")

    def validate_config(self, config: LlamaConfig) -> None:
        if config.hidden_act != "silu":
            raise UnsupportedModelError(f"LLaMA with hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            raise UnsupportedModelError("LLaMA with pretraining_tp > 1 is not supported")

    def spec(self, config: LlamaConfig) -> ArchSpec:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return ArchSpec(
            model_type="llama",
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            output_size=config.vocab_size,
            norm="rmsnorm",
            gated_mlp=True,
            rotary_dim=head_dim,
            norm_eps=config.rms_norm_eps,
            embedding_names=("embed.tokens",),
        )

    def canonical_group(
        self, src: Mapping[str, Tensor], config: LlamaConfig, spec: ArchSpec, group: Group
    ) -> dict[str, Tensor]:
        if group == "embed":
            return {"embed.tokens": src["model.embed_tokens.weight"]}
        if group == "head":
            weight = src["lm_head.weight"] if "lm_head.weight" in src else src["model.embed_tokens.weight"]
            w, b = fold_norm(weight, None, src["model.norm.weight"], None)
            return {"head.weight": w, "head.bias": b}
        p, out = f"model.layers.{group}.", f"layers.{group}."
        gains = {"attn": src[p + "input_layernorm.weight"], "mlp": src[p + "post_attention_layernorm.weight"]}
        tensors: dict[str, Tensor] = {}
        for block, names in (("attn", _ATTN), ("mlp", _MLP)):
            module = "self_attn" if block == "attn" else "mlp"
            for name, hf in names.items():
                w, b = src[f"{p}{module}.{hf}.weight"], src.get(f"{p}{module}.{hf}.bias")
                if name in ("o", "down"):  # writers: no norm in front of them
                    b = w.new_zeros(w.shape[0]) if b is None else b
                else:
                    w, b = fold_norm(w, b, gains[block], None)
                tensors[f"{out}{block}.{name}.weight"], tensors[f"{out}{block}.{name}.bias"] = w, b
        return tensors

    def head_stays_tied(self, embed: Mapping[str, Tensor], head: Mapping[str, Tensor]) -> bool:
        # Residual maps act on embeddings and head alike, so a unit final gain keeps them equal.
        return torch.equal(embed["embed.tokens"], head["head.weight"])

    def hf_group(self, t: Mapping[str, Tensor], config: LlamaConfig, spec: ArchSpec, group: Group) -> dict[str, Tensor]:
        if group == "embed":
            return {"model.embed_tokens.weight": t["embed.tokens"]}
        if group == "head":
            require_zero(t["head.bias"], "LM-head bias (LLaMA)")
            weight = t["head.weight"]
            return {"model.norm.weight": torch.ones_like(weight[0]), "lm_head.weight": weight}
        p, c = f"model.layers.{group}.", f"layers.{group}."
        like = t[c + "attn.q.weight"]
        out = {
            p + "input_layernorm.weight": torch.ones(spec.hidden_size, dtype=like.dtype, device=like.device),
            p + "post_attention_layernorm.weight": torch.ones(spec.hidden_size, dtype=like.dtype, device=like.device),
        }
        for block, names, flag in (("attn", _ATTN, config.attention_bias), ("mlp", _MLP, config.mlp_bias)):
            module = "self_attn" if block == "attn" else "mlp"
            for name, hf in names.items():
                out[f"{p}{module}.{hf}.weight"] = t[f"{c}{block}.{name}.weight"]
                bias = t[f"{c}{block}.{name}.bias"]
                if flag:
                    out[f"{p}{module}.{hf}.bias"] = bias
                else:
                    require_zero(
                        bias,
                        f"{block}.{name} bias (config has {'attention_bias' if block == 'attn' else 'mlp_bias'}=False)",
                    )
        return out
