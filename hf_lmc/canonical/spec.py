"""Architecture-neutral description of a canonical model, and its tensor names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Group = str | int  # "embed", "head", or a layer index


@dataclass(frozen=True)
class ArchSpec:
    """Shapes and structure of a model in canonical form (docs/design.md §2).

    ``norm="layernorm"`` means the residual stream is centred (lives in ``1-perp``), so every
    residual map must fix ``u = 1/sqrt(d)``; ``rotary_dim`` is the number of leading head
    dimensions that RoPE rotates (0 for absolute positions), paired HF-style as
    ``(i, i + rotary_dim/2)``.
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    output_size: int  # vocabulary size or number of labels
    norm: Literal["layernorm", "rmsnorm"]
    gated_mlp: bool
    rotary_dim: int
    norm_eps: float
    embedding_names: tuple[str, ...]

    @property
    def centred(self) -> bool:
        return self.norm == "layernorm"

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_names(self, i: int) -> list[str]:
        mlp = ("up", "gate", "down") if self.gated_mlp else ("up", "down")
        parts = [f"attn.{p}" for p in "qkvo"] + [f"mlp.{p}" for p in mlp]
        return [f"layers.{i}.{p}.{kind}" for p in parts for kind in ("weight", "bias")]

    def names(self) -> list[str]:
        """Every canonical tensor name, in export order."""
        out = list(self.embedding_names)
        for i in range(self.num_layers):
            out += self.layer_names(i)
        return out + ["head.weight", "head.bias"]

    def groups(self) -> list[Group]:
        return ["embed", *range(self.num_layers), "head"]

    def token_row_names(self) -> frozenset[str]:
        """Canonical tensors with one row per vocabulary token (none for a classifier)."""
        return (
            frozenset({"embed.tokens", "head.weight", "head.bias"})
            if "embed.tokens" in self.embedding_names
            else frozenset()
        )

    def row_blocks(self, group: Group, rows: int) -> list[slice] | None:
        """``group``'s token rows in blocks of ``rows``, or None where it has no token rows."""
        if group not in ("embed", "head") or not self.token_row_names():
            return None
        return [slice(start, min(start + rows, self.output_size)) for start in range(0, self.output_size, rows)]


def spec_differences(a: ArchSpec, b: ArchSpec) -> list[str]:
    """``"field a vs b"`` for every field where two specs differ (for error messages)."""
    return [f"{k} {getattr(a, k)} vs {getattr(b, k)}" for k in a.__dataclass_fields__ if getattr(a, k) != getattr(b, k)]


_LAYER = re.compile(r"^layers\.(\d+)\.")


def group_of(name: str) -> Group:
    """Which materialisation unit a canonical tensor belongs to."""
    m = _LAYER.match(name)
    if m:
        return int(m.group(1))
    return "head" if name.startswith("head.") else "embed"


def local_name(name: str) -> str:
    """``layers.3.attn.q.weight`` -> ``attn.q.weight``; globals unchanged."""
    return _LAYER.sub("", name)
