"""What an architecture adapter is, and the exact algebra every adapter shares.

An adapter maps one Hugging Face model family to and from the canonical form (docs/design.md §2):
which HF tensor (or slice of a fused tensor) is which canonical tensor, and the few lines that
are truly family-specific (fused QKV layouts, Conv1D transposition, legacy key names). All
conversions are pure torch functions of tensors, so learned matching can differentiate through
the same code that export runs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Annotated, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel

from hf_lmc.canonical.spec import ArchSpec, Group

#: A layer, head or width count, a vocabulary or an image size: an integer of at least 1.
Count = Annotated[int, Field(ge=1)]


class ConfigSchema(BaseModel):
    """The types of the ``config.json`` keys an adapter reads, checked before transformers builds
    the config (which takes ``"n_layer": "12"`` as it is, to fail deep inside a merge). Strict:
    ``"12"`` is not an integer and ``1`` is not ``true``; keys left out take transformers'
    defaults; other keys are allowed unchecked."""

    model_config = ConfigDict(strict=True, extra="allow")

    model_type: str
    tie_word_embeddings: bool = None


class ConfigError(ValueError):
    """A model folder's ``config.json`` is missing, not JSON, or holds a key of the wrong type."""


class Adapter:
    """Base class: subclasses fill in the class attributes and the four conversion methods."""

    def tiny(self) -> PretrainedConfig:
        """:attr:`tiny_config` as the family's config class."""
        return self.model_class.config_class(**self.tiny_config)

    #: ``config.model_type`` values this adapter handles.
    model_types: tuple[str, ...] = ()
    #: The keyword the model's forward takes its input by: token ids, or images.
    input_name: str = "input_ids"
    #: The ``transformers`` auto class the model card tells users to load the merge with.
    auto_class: str = "AutoModelForCausalLM"
    #: The stock transformers class that canonical models export to.
    model_class: type[PreTrainedModel]
    #: ``(pattern, replacement)`` regexes turning legacy checkpoint keys into current ones.
    legacy_renames: tuple[tuple[str, str], ...] = ()
    #: Regexes of checkpoint keys that hold no parameters (old causal-mask buffers, ...).
    ignored_keys: tuple[str, ...] = ()
    #: Config flags that export must switch on because folded LayerNorm biases need them.
    bias_flags_for_folded_norms: tuple[str, ...] = ()
    #: Modules whose *input* activation matching records (``{i}`` = layer index): the attention
    #: output projection (its input is every head's value mix, head by head) ...
    heads_input: str = ""
    #: ... and the MLP down projection (its input is the MLP units).
    mlp_input: str = ""
    #: Whether a layer's attention can read its number of heads off the projections it is given
    #: (natively, or once :meth:`share_heads` has hooked it), so that a tensor-parallel layer
    #: runs on each process's share of them (:mod:`hf_lmc.learned.tensor_parallel`).
    heads_by_width: bool = False
    #: Checkpoint keys with one row per vocabulary token (embedding, LM head): the only large
    #: tensors of the embed / head groups, whose algebra is row by row, so export can stream
    #: them in blocks of rows.
    vocab_keys: tuple[str, ...] = ()
    #: ``ArchSpec`` width field -> the config key that sets it (models of two widths are merged
    #: at a common shape, :mod:`hf_lmc.canonical.widths`); widths the config derives need no entry.
    width_keys: ClassVar[dict[str, str]] = {}
    #: The smallest config of the family the exactness suite and ``hf-lmc check`` build a model
    #: from, with every feature the adapter handles switched on (GQA, partial rotary, biases):
    #: a new family is tested by registering its adapter, with no list elsewhere to extend.
    tiny_config: ClassVar[dict] = {}
    #: Config keys that change what the model computes without setting a shape: activation,
    #: norm eps, attention scaling, rope, residual layout (read by ``spec``, the conversions or
    #: the stock class's forward). Two models must agree on them (``setting_differences``).
    function_keys: frozenset[str] = frozenset()
    #: Config keys that set tensor shapes or which tensors exist, besides ``width_keys``' (which
    #: may differ): vocabulary, layers, position table, optional biases. They must agree.
    shape_keys: frozenset[str] = frozenset({"vocab_size"})
    #: The ``config.json`` keys this adapter (its ``spec`` and conversions) reads, typed.
    config_schema: ClassVar[type[ConfigSchema]] = ConfigSchema

    def share_heads(self, layer: torch.nn.Module) -> None:
        """Prepare the stock layer module ``layer`` to run on the share of its heads that its
        projections' weights hold (where :attr:`heads_by_width`): called once, after every other
        hook on its modules. Nothing to do where the attention reads its heads off its
        projections' outputs, as GPT-NeoX's and LLaMA's do."""

    @property
    def takes_images(self) -> bool:
        """Whether the model reads pixels (evaluation data, sample inputs, input noise) or tokens."""
        return self.input_name == "pixel_values"

    def spec(self, config: PretrainedConfig) -> ArchSpec:
        raise NotImplementedError

    def canonical_group(
        self, src: Mapping[str, Tensor], config: PretrainedConfig, spec: ArchSpec, group: Group
    ) -> dict[str, Tensor]:
        """Canonical tensors of one group, read from ``src`` (HF keys, transformers 5 names)."""
        raise NotImplementedError

    def hf_group(
        self, tensors: Mapping[str, Tensor], config: PretrainedConfig, spec: ArchSpec, group: Group
    ) -> dict[str, Tensor]:
        """HF state-dict entries of one group, from its canonical tensors (``config`` = export config)."""
        raise NotImplementedError

    def validate_config(self, config: PretrainedConfig) -> None:
        """Raise ``UnsupportedModelError`` for config options the canonical form cannot express."""

    def head_stays_tied(self, embed: Mapping[str, Tensor], head: Mapping[str, Tensor]) -> bool:
        """Whether an exported head can still share the token embedding's storage."""
        return False

    def export_config(
        self, config: PretrainedConfig, embed: Mapping[str, Tensor], head: Mapping[str, Tensor]
    ) -> PretrainedConfig:
        """The stock config that reproduces the canonical function (ties and bias flags)."""
        config = copy.deepcopy(config)
        for flag in self.bias_flags_for_folded_norms:
            setattr(config, flag, True)
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = self.head_stays_tied(embed, head)
        return config


class UnsupportedModelError(ValueError):
    """The model's architecture or options are not supported."""


# ---------------------------------------------------------------------------------------------
# Shared exact algebra
# ---------------------------------------------------------------------------------------------


def centre(t: Tensor, axis: int) -> Tensor:
    """Project ``t`` onto ``1-perp`` along ``axis`` (``C = I - 11^T/d`` on a writer's output)."""
    return t - t.mean(dim=axis, keepdim=True)


def fold_norm(weight: Tensor, bias: Tensor | None, gain: Tensor, shift: Tensor | None) -> tuple[Tensor, Tensor]:
    """Fold a norm's ``gain``/``shift`` into the linear map ``weight (out, d)`` that reads it.

    ``W (g * n + s) + b = (W diag(g)) n + (b + W s)``. A missing bias becomes zeros.
    """
    folded_bias = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device) if bias is None else bias
    if shift is not None:
        folded_bias = folded_bias + weight @ shift
    return weight * gain, folded_bias


def unit_vector(d: int, like: Tensor) -> Tensor:
    """``u = 1/sqrt(d)``: the one direction a centred stream never touches."""
    return torch.full((d,), 1.0 / math.sqrt(d), dtype=like.dtype, device=like.device)


def layernorm_head_export(weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Export an affine head ``W n + b`` through a bias-free linear head (docs/design.md §2).

    Returns the final LayerNorm's gain (ones), shift (``u``) and the head weight
    ``H = W (I - u u^T) + b u^T``, so that ``H (n + u) = W n + b`` for every ``n`` in ``1-perp``.
    """
    d = weight.shape[1]
    u = unit_vector(d, weight)
    head = torch.addr(weight, weight @ u, u, alpha=-1).addr_(bias, u)  # no V x d outer products materialised
    return torch.ones_like(u), u, head


def identity_norm(d: int, like: Tensor, with_bias: bool = True) -> dict[str, Tensor]:
    """An exported inner norm: gain 1 (and shift 0) so it computes the unit norm exactly."""
    out = {"weight": torch.ones(d, dtype=like.dtype, device=like.device)}
    if with_bias:
        out["bias"] = torch.zeros(d, dtype=like.dtype, device=like.device)
    return out


def require_zero(t: Tensor, what: str) -> None:
    """Export into a bias-free slot is exact only when the canonical bias is zero."""
    if torch.count_nonzero(t.detach()) != 0:
        raise ValueError(f"cannot export a non-zero {what}: the target architecture has no such bias")
