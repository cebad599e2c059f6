"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, learned positions, Conv1D layout, fused [Q|K|V]."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import FiniteFloat
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel

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


class GPT2ConfigSchema(ConfigSchema):
    """The GPT-2 ``config.json`` keys the adapter and ``GPT2LMHeadModel`` read."""

    n_embd: Count = None
    n_head: Count = None
    n_layer: Count = None
    n_inner: Count | None = None
    n_positions: Count = None
    vocab_size: Count = None
    layer_norm_epsilon: FiniteFloat = None
    activation_function: str = None
    scale_attn_weights: bool = None
    scale_attn_by_inverse_layer_idx: bool = None
    reorder_and_upcast_attn: bool = None
    add_cross_attention: bool = None


class GPT2Adapter(Adapter):
    model_types = ("gpt2",)
    model_class = GPT2LMHeadModel
    tiny_config: ClassVar[dict] = {
        "n_embd": 8,
        "n_head": 2,
        "n_layer": 2,
        "vocab_size": 17,
        "n_positions": 16,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    config_schema = GPT2ConfigSchema
    heads_input = "transformer.h.{i}.attn.c_proj"
    mlp_input = "transformer.h.{i}.mlp.c_proj"
    heads_by_width = True  # once share_heads has hooked the fused projection
    width_keys: ClassVar[dict[str, str]] = {
        "hidden_size": "n_embd",
        "intermediate_size": "n_inner",
        "num_heads": "n_head",
    }
    function_keys = frozenset(
        {
            "activation_function",
            "layer_norm_epsilon",
            "scale_attn_weights",
            "scale_attn_by_inverse_layer_idx",
            "add_cross_attention",
        }
    )
    shape_keys = frozenset({"vocab_size", "n_layer", "n_positions"})
    # Hub checkpoints saved from ``GPT2Model`` (e.g. ``gpt2`` itself) carry no ``transformer.`` prefix.
    legacy_renames = ((r"^(?!transformer\.|lm_head\.)", "transformer."),)
    vocab_keys = ("transformer.wte.weight", "lm_head.weight")
    # Causal-mask buffers that transformers 4.x wrote into some checkpoints.
    ignored_keys = (r"\.attn\.(masked_)?bias$",)

    def share_heads(self, layer: torch.nn.Module) -> None:
        """GPT-2's attention splits its fused query-key-value output by ``split_size``, the full
        width: a hook on the projection sets it to a third of the output it returns (after the
        projection's other hooks), which is the full width unless the layer runs on a share of
        its heads."""
        attention = layer.attn
        if attention.is_cross_attention:
            return

        def follow(module, args, output):
            attention.split_size = output.shape[-1] // 3

        attention.c_attn.register_forward_hook(follow)

    def validate_config(self, config: GPT2Config) -> None:
        if getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError("GPT-2 with cross-attention (add_cross_attention=True) is not supported")

    def spec(self, config: GPT2Config) -> ArchSpec:
        d = config.n_embd
        return ArchSpec(
            model_type="gpt2",
            num_layers=config.n_layer,
            hidden_size=d,
            num_heads=config.n_head,
            num_kv_heads=config.n_head,
            head_dim=d // config.n_head,
            intermediate_size=config.n_inner or 4 * d,
            output_size=config.vocab_size,
            norm="layernorm",
            gated_mlp=False,
            rotary_dim=0,
            norm_eps=config.layer_norm_epsilon,
            embedding_names=("embed.tokens", "embed.positions"),
        )

    def canonical_group(
        self, src: Mapping[str, Tensor], config: GPT2Config, spec: ArchSpec, group: Group
    ) -> dict[str, Tensor]:
        if group == "embed":
            return {
                "embed.tokens": centre(src["transformer.wte.weight"], 1),
                "embed.positions": centre(src["transformer.wpe.weight"], 1),
            }
        if group == "head":
            weight = src["lm_head.weight"] if "lm_head.weight" in src else src["transformer.wte.weight"]
            w, b = fold_norm(weight, None, src["transformer.ln_f.weight"], src["transformer.ln_f.bias"])
            return {"head.weight": w, "head.bias": b}
        p, out = f"transformer.h.{group}.", f"layers.{group}."
        ln1 = src[p + "ln_1.weight"], src[p + "ln_1.bias"]
        ln2 = src[p + "ln_2.weight"], src[p + "ln_2.bias"]
        # Conv1D stores (in, out): canonical weights are (out, in).
        qkv_w, qkv_b = src[p + "attn.c_attn.weight"].T, src[p + "attn.c_attn.bias"]
        d = spec.hidden_size
        tensors: dict[str, Tensor] = {}
        for j, name in enumerate("qkv"):
            w, b = fold_norm(qkv_w[j * d : (j + 1) * d], qkv_b[j * d : (j + 1) * d], *ln1)
            tensors[f"{out}attn.{name}.weight"], tensors[f"{out}attn.{name}.bias"] = w, b
        tensors[out + "attn.o.weight"] = centre(src[p + "attn.c_proj.weight"].T, 0)
        tensors[out + "attn.o.bias"] = centre(src[p + "attn.c_proj.bias"], 0)
        tensors[out + "mlp.up.weight"], tensors[out + "mlp.up.bias"] = fold_norm(
            src[p + "mlp.c_fc.weight"].T, src[p + "mlp.c_fc.bias"], *ln2
        )
        tensors[out + "mlp.down.weight"] = centre(src[p + "mlp.c_proj.weight"].T, 0)
        tensors[out + "mlp.down.bias"] = centre(src[p + "mlp.c_proj.bias"], 0)
        return tensors

    def hf_group(self, t: Mapping[str, Tensor], config: GPT2Config, spec: ArchSpec, group: Group) -> dict[str, Tensor]:
        if group == "embed":
            return {"transformer.wte.weight": t["embed.tokens"], "transformer.wpe.weight": t["embed.positions"]}
        if group == "head":
            gain, shift, head = layernorm_head_export(t["head.weight"], t["head.bias"])
            return {"transformer.ln_f.weight": gain, "transformer.ln_f.bias": shift, "lm_head.weight": head}
        p, c = f"transformer.h.{group}.", f"layers.{group}."
        like, d = t[c + "attn.q.weight"], spec.hidden_size
        out = {f"{p}ln_1.{k}": v for k, v in identity_norm(d, like).items()}
        out |= {f"{p}ln_2.{k}": v for k, v in identity_norm(d, like).items()}
        out[p + "attn.c_attn.weight"] = torch.cat([t[f"{c}attn.{n}.weight"] for n in "qkv"]).T
        out[p + "attn.c_attn.bias"] = torch.cat([t[f"{c}attn.{n}.bias"] for n in "qkv"])
        out[p + "attn.c_proj.weight"] = t[c + "attn.o.weight"].T
        out[p + "attn.c_proj.bias"] = t[c + "attn.o.bias"]
        out[p + "mlp.c_fc.weight"] = t[c + "mlp.up.weight"].T
        out[p + "mlp.c_fc.bias"] = t[c + "mlp.up.bias"]
        out[p + "mlp.c_proj.weight"] = t[c + "mlp.down.weight"].T
        out[p + "mlp.c_proj.bias"] = t[c + "mlp.down.bias"]
        return out
