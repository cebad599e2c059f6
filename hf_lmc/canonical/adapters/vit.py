"""ViT (``ViTForImageClassification``): LayerNorm, patch projection + CLS + position table.

The classifier reads the CLS token after the final LayerNorm and has a bias, so the final
LayerNorm exports with unit gain and zero shift (no ``u`` trick needed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import FiniteFloat
from torch import Tensor
from transformers import ViTConfig, ViTForImageClassification

from hf_lmc.canonical.adapters.base import (
    Adapter,
    ConfigSchema,
    Count,
    UnsupportedModelError,
    centre,
    fold_norm,
    identity_norm,
)
from hf_lmc.canonical.spec import ArchSpec, Group

_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


class ViTConfigSchema(ConfigSchema):
    """The ViT ``config.json`` keys the adapter and ``ViTForImageClassification`` read."""

    hidden_size: Count = None
    num_attention_heads: Count = None
    num_hidden_layers: Count = None
    intermediate_size: Count = None
    image_size: Count = None
    patch_size: Count = None
    num_channels: Count = None
    encoder_stride: Count = None
    num_labels: int = None  # 0 (no classifier) is refused by validate_config, saying so
    id2label: dict[str, str] | None = None
    layer_norm_eps: FiniteFloat = None
    hidden_act: str = None
    qkv_bias: bool = None


class ViTAdapter(Adapter):
    model_types = ("vit",)
    model_class = ViTForImageClassification
    tiny_config: ClassVar[dict] = {
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 12,
        "image_size": 8,
        "patch_size": 4,
        "num_labels": 3,
    }
    config_schema = ViTConfigSchema
    input_name = "pixel_values"
    auto_class = "AutoModelForImageClassification"
    heads_input = "vit.layers.{i}.attention.o_proj"
    mlp_input = "vit.layers.{i}.mlp.fc2"
    width_keys: ClassVar[dict[str, str]] = {
        "hidden_size": "hidden_size",
        "intermediate_size": "intermediate_size",
        "num_heads": "num_attention_heads",
    }
    function_keys = frozenset({"hidden_act", "layer_norm_eps"})
    shape_keys = frozenset({"num_hidden_layers", "image_size", "patch_size", "num_channels", "qkv_bias"})
    # transformers 4.x names (``encoder.layer.N.attention.attention.query`` ...). Order matters:
    # ``attention.output.dense`` must be renamed before the MLP's ``output.dense``.
    legacy_renames = (
        (r"\.encoder\.layer\.(\d+)\.", r".layers.\1."),
        (r"\.attention\.attention\.query\.", ".attention.q_proj."),
        (r"\.attention\.attention\.key\.", ".attention.k_proj."),
        (r"\.attention\.attention\.value\.", ".attention.v_proj."),
        (r"\.attention\.output\.dense\.", ".attention.o_proj."),
        (r"\.intermediate\.dense\.", ".mlp.fc1."),
        (r"\.output\.dense\.", ".mlp.fc2."),
    )
    ignored_keys = (r"^vit\.pooler\.",)
    bias_flags_for_folded_norms = ("qkv_bias",)

    def validate_config(self, config: ViTConfig) -> None:
        if not config.num_labels:
            raise UnsupportedModelError(
                "ViTForImageClassification without a classifier (num_labels=0) is not supported"
            )

    def spec(self, config: ViTConfig) -> ArchSpec:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return ArchSpec(
            model_type="vit",
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            output_size=config.num_labels,
            norm="layernorm",
            gated_mlp=False,
            rotary_dim=0,
            norm_eps=config.layer_norm_eps,
            embedding_names=("embed.patch.weight", "embed.patch.bias", "embed.cls", "embed.positions"),
        )

    def canonical_group(
        self, src: Mapping[str, Tensor], config: ViTConfig, spec: ArchSpec, group: Group
    ) -> dict[str, Tensor]:
        e = "vit.embeddings."
        if group == "embed":
            return {
                "embed.patch.weight": centre(src[e + "patch_embeddings.projection.weight"], 0),
                "embed.patch.bias": centre(src[e + "patch_embeddings.projection.bias"], 0),
                "embed.cls": centre(src[e + "cls_token"].reshape(-1), 0),
                "embed.positions": centre(src[e + "position_embeddings"][0], 1),
            }
        if group == "head":
            w, b = fold_norm(
                src["classifier.weight"], src["classifier.bias"], src["vit.layernorm.weight"], src["vit.layernorm.bias"]
            )
            return {"head.weight": w, "head.bias": b}
        p, out = f"vit.layers.{group}.", f"layers.{group}."
        ln_attn = src[p + "layernorm_before.weight"], src[p + "layernorm_before.bias"]
        ln_mlp = src[p + "layernorm_after.weight"], src[p + "layernorm_after.bias"]
        tensors: dict[str, Tensor] = {}
        for name in "qkv":
            key = f"{p}attention.{_ATTN[name]}."
            w, b = fold_norm(src[key + "weight"], src.get(key + "bias"), *ln_attn)
            tensors[f"{out}attn.{name}.weight"], tensors[f"{out}attn.{name}.bias"] = w, b
        tensors[out + "attn.o.weight"] = centre(src[p + "attention.o_proj.weight"], 0)
        tensors[out + "attn.o.bias"] = centre(src[p + "attention.o_proj.bias"], 0)
        tensors[out + "mlp.up.weight"], tensors[out + "mlp.up.bias"] = fold_norm(
            src[p + "mlp.fc1.weight"], src[p + "mlp.fc1.bias"], *ln_mlp
        )
        tensors[out + "mlp.down.weight"] = centre(src[p + "mlp.fc2.weight"], 0)
        tensors[out + "mlp.down.bias"] = centre(src[p + "mlp.fc2.bias"], 0)
        return tensors

    def hf_group(self, t: Mapping[str, Tensor], config: ViTConfig, spec: ArchSpec, group: Group) -> dict[str, Tensor]:
        e = "vit.embeddings."
        if group == "embed":
            return {
                e + "patch_embeddings.projection.weight": t["embed.patch.weight"],
                e + "patch_embeddings.projection.bias": t["embed.patch.bias"],
                e + "cls_token": t["embed.cls"].reshape(1, 1, -1),
                e + "position_embeddings": t["embed.positions"][None],
            }
        if group == "head":
            like = t["head.weight"]
            out = {f"vit.layernorm.{k}": v for k, v in identity_norm(spec.hidden_size, like).items()}
            return out | {"classifier.weight": t["head.weight"], "classifier.bias": t["head.bias"]}
        p, c = f"vit.layers.{group}.", f"layers.{group}."
        like, d = t[c + "attn.q.weight"], spec.hidden_size
        out = {f"{p}layernorm_before.{k}": v for k, v in identity_norm(d, like).items()}
        out |= {f"{p}layernorm_after.{k}": v for k, v in identity_norm(d, like).items()}
        for name, hf in _ATTN.items():
            out[f"{p}attention.{hf}.weight"] = t[f"{c}attn.{name}.weight"]
            out[f"{p}attention.{hf}.bias"] = t[f"{c}attn.{name}.bias"]
        out[p + "mlp.fc1.weight"], out[p + "mlp.fc1.bias"] = t[c + "mlp.up.weight"], t[c + "mlp.up.bias"]
        out[p + "mlp.fc2.weight"], out[p + "mlp.fc2.bias"] = t[c + "mlp.down.weight"], t[c + "mlp.down.bias"]
        return out
