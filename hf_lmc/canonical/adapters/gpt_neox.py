"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``): LayerNorm, partial rotary, per-head packed QKV.

Parallel or sequential residual makes no difference to the canonical form: each LayerNorm
folds into the block that reads it, and the stream is the sum of the centred writers either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import FiniteFloat
from torch import Tensor
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hf_lmc.canonical.adapters.base import (
    Adapter,
    ConfigSchema,
    Count,
    UnsupportedModelError,
    centre,
    fold_norm,
    identity_norm,
    layernorm_head_export,
)
from hf_lmc.canonical.spec import ArchSpec, Group


class GPTNeoXConfigSchema(ConfigSchema):
    """The GPT-NeoX ``config.json`` keys the adapter and ``GPTNeoXForCausalLM`` read."""

    hidden_size: Count = None
    num_attention_heads: Count = None
    num_hidden_layers: Count = None
    intermediate_size: Count = None
    max_position_embeddings: Count = None
    vocab_size: Count = None
    layer_norm_eps: FiniteFloat = None
    rotary_pct: FiniteFloat = None
    rotary_emb_base: FiniteFloat = None
    rope_parameters: dict | None = None
    hidden_act: str = None
    use_parallel_residual: bool = None
    attention_bias: bool = None


class GPTNeoXAdapter(Adapter):
    model_types = ("gpt_neox",)
    model_class = GPTNeoXForCausalLM
    tiny_config: ClassVar[dict] = {
        "hidden_size": 16,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 24,
        "vocab_size": 17,
        "rotary_pct": 0.25,
    }
    config_schema = GPTNeoXConfigSchema
    heads_input = "gpt_neox.layers.{i}.attention.dense"
    heads_by_width = True
    mlp_input = "gpt_neox.layers.{i}.mlp.dense_4h_to_h"
    width_keys: ClassVar[dict[str, str]] = {
        "hidden_size": "hidden_size",
        "intermediate_size": "intermediate_size",
        "num_heads": "num_attention_heads",
    }
    # Parallel and sequential residuals are one canonical form but two functions; max_position_embeddings
    # sets the scaled rope variants' frequencies; the rest are rope settings under their old names too.
    function_keys = frozenset(
        {
            "hidden_act",
            "layer_norm_eps",
            "use_parallel_residual",
            "max_position_embeddings",
            "rope_parameters",
            "rope_scaling",
            "rope_theta",
            "rotary_pct",
            "rotary_emb_base",
            "partial_rotary_factor",
        }
    )
    shape_keys = frozenset({"vocab_size", "num_hidden_layers", "attention_bias"})
    legacy_renames = ((r"^embed_out\.", "lm_head."),)
    vocab_keys = ("gpt_neox.embed_in.weight", "lm_head.weight")
    ignored_keys = (r"\.attention\.(masked_)?bias$", r"\.rotary_emb\.inv_freq$")
    # LayerNorm shifts fold into Q/K/V biases, which need attention_bias=True to exist.
    bias_flags_for_folded_norms = ("attention_bias",)

    def rotary_dim(self, config: GPTNeoXConfig) -> int:
        factor = (config.rope_parameters or {}).get("partial_rotary_factor", 1.0)
        return int(config.hidden_size // config.num_attention_heads * factor)

    def validate_config(self, config: GPTNeoXConfig) -> None:
        if self.rotary_dim(config) % 2:
            raise UnsupportedModelError("GPT-NeoX with an odd number of rotary dimensions is not supported")

    def spec(self, config: GPTNeoXConfig) -> ArchSpec:
        heads = config.num_attention_heads
        return ArchSpec(
            model_type="gpt_neox",
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            output_size=config.vocab_size,
            norm="layernorm",
            gated_mlp=False,
            rotary_dim=self.rotary_dim(config),
            norm_eps=config.layer_norm_eps,
            embedding_names=("embed.tokens",),
        )

    def canonical_group(
        self, src: Mapping[str, Tensor], config: GPTNeoXConfig, spec: ArchSpec, group: Group
    ) -> dict[str, Tensor]:
        if group == "embed":
            return {"embed.tokens": centre(src["gpt_neox.embed_in.weight"], 1)}
        if group == "head":
            weight = src["lm_head.weight"] if "lm_head.weight" in src else src["gpt_neox.embed_in.weight"]
            w, b = fold_norm(
                weight, None, src["gpt_neox.final_layer_norm.weight"], src["gpt_neox.final_layer_norm.bias"]
            )
            return {"head.weight": w, "head.bias": b}
        p, out = f"gpt_neox.layers.{group}.", f"layers.{group}."
        h, dh, d = spec.num_heads, spec.head_dim, spec.hidden_size
        ln_attn = src[p + "input_layernorm.weight"], src[p + "input_layernorm.bias"]
        ln_mlp = src[p + "post_attention_layernorm.weight"], src[p + "post_attention_layernorm.bias"]
        # query_key_value rows are laid out per head as [h, (q|k|v), d_h].
        qkv_w = src[p + "attention.query_key_value.weight"].reshape(h, 3, dh, d)
        bias_key = p + "attention.query_key_value.bias"
        qkv_b = src[bias_key].reshape(h, 3, dh) if bias_key in src else None
        tensors: dict[str, Tensor] = {}
        for j, name in enumerate("qkv"):
            b = None if qkv_b is None else qkv_b[:, j].reshape(h * dh)
            w, b = fold_norm(qkv_w[:, j].reshape(h * dh, d), b, *ln_attn)
            tensors[f"{out}attn.{name}.weight"], tensors[f"{out}attn.{name}.bias"] = w, b
        dense_w = src[p + "attention.dense.weight"]
        dense_b = src.get(p + "attention.dense.bias")
        tensors[out + "attn.o.weight"] = centre(dense_w, 0)
        tensors[out + "attn.o.bias"] = centre(dense_b, 0) if dense_b is not None else dense_w.new_zeros(d)
        tensors[out + "mlp.up.weight"], tensors[out + "mlp.up.bias"] = fold_norm(
            src[p + "mlp.dense_h_to_4h.weight"], src[p + "mlp.dense_h_to_4h.bias"], *ln_mlp
        )
        tensors[out + "mlp.down.weight"] = centre(src[p + "mlp.dense_4h_to_h.weight"], 0)
        tensors[out + "mlp.down.bias"] = centre(src[p + "mlp.dense_4h_to_h.bias"], 0)
        return tensors

    def hf_group(
        self, t: Mapping[str, Tensor], config: GPTNeoXConfig, spec: ArchSpec, group: Group
    ) -> dict[str, Tensor]:
        if group == "embed":
            return {"gpt_neox.embed_in.weight": t["embed.tokens"]}
        if group == "head":
            gain, shift, head = layernorm_head_export(t["head.weight"], t["head.bias"])
            return {
                "gpt_neox.final_layer_norm.weight": gain,
                "gpt_neox.final_layer_norm.bias": shift,
                "lm_head.weight": head,
            }
        p, c = f"gpt_neox.layers.{group}.", f"layers.{group}."
        h, dh, d = spec.num_heads, spec.head_dim, spec.hidden_size
        like = t[c + "attn.q.weight"]
        out = {f"{p}input_layernorm.{k}": v for k, v in identity_norm(d, like).items()}
        out |= {f"{p}post_attention_layernorm.{k}": v for k, v in identity_norm(d, like).items()}
        weights = [t[f"{c}attn.{n}.weight"].reshape(h, dh, d) for n in "qkv"]
        biases = [t[f"{c}attn.{n}.bias"].reshape(h, dh) for n in "qkv"]
        out[p + "attention.query_key_value.weight"] = torch.stack(weights, 1).reshape(3 * h * dh, d)
        out[p + "attention.query_key_value.bias"] = torch.stack(biases, 1).reshape(3 * h * dh)
        out[p + "attention.dense.weight"] = t[c + "attn.o.weight"]
        out[p + "attention.dense.bias"] = t[c + "attn.o.bias"]
        out[p + "mlp.dense_h_to_4h.weight"] = t[c + "mlp.up.weight"]
        out[p + "mlp.dense_h_to_4h.bias"] = t[c + "mlp.up.bias"]
        out[p + "mlp.dense_4h_to_h.weight"] = t[c + "mlp.down.weight"]
        out[p + "mlp.dense_4h_to_h.bias"] = t[c + "mlp.down.bias"]
        return out
