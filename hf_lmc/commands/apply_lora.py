"""PEFT LoRA adapters carried across a saved transform (``hf-lmc apply TRANSFORMS ADAPTER``).

Every map of a transform acts linearly on each weight's output and input sides, and the
canonical rewrite folds norm gains and shifts into the weights that read them linearly too, so a
LoRA target's update ``s·B·A`` moves to ``s·(L B)(A R)``: a product of the same rank, and a norm
shift folded into the reader becomes a bias of ``lora_B`` (peft's ``lora_bias``). Rather than
derive ``L`` and ``R`` per family, the move runs through the functions that move the model
itself (the adapter's ``canonical_group``, the transform, ``hf_group``), layer by layer: the
moved weights of the adapted model minus those of the moved base are the moved updates, which are
factored back to rank ``r`` (a truncated SVD, exact where the rank is kept). A target whose update
needs a higher rank, or an update that lands in a tensor the adapter does not carry, is refused by
name. Tensors the adapter saves whole (``modules_to_save``, embedding layers) are moved as weights.

The adapted model is held in memory in float64 (peft builds it), one copy beside the base
model's layers read from disk.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelCardData
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from hf_lmc.canonical.form import CanonicalModel, canonicalize, export_config
from hf_lmc.config.options import escape_controls
from hf_lmc.io.hub import names_local_path, shown_reference
from hf_lmc.io.outputs import discard, move_into_place, staging_folder
from hf_lmc.symmetry.engine import Transform

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
#: Inits that change the base model's weights when the adapter is built (peft converts them to a
#: plain LoRA only when asked at save time); such an adapter only fits its own modified base.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
#: Relative size below which a difference of moved weights is rounding (float64 algebra).
_TOLERANCE = 1e-8


class AdapterError(ValueError):
    """An adapter that cannot be carried across a transform (its kind, options or a target)."""


def is_lora_adapter(reference: str | Path) -> bool:
    """Whether ``reference`` is a local PEFT adapter folder: an ``adapter_config.json`` and no
    model weights (a ``config.json`` beside it, as some trainers save, does not make it a model).
    A folder holding both an adapter and a model's weights is refused as ambiguous."""
    path = Path(reference)
    if not (path.is_dir() and (path / ADAPTER_CONFIG).is_file()):
        return False
    weights = [name for name in MODEL_WEIGHT_FILES if (path / name).is_file()]
    if weights:
        raise AdapterError(
            f"{escape_controls(path, 120)} holds both a PEFT adapter ({ADAPTER_CONFIG}) and a model's weights "
            f"({weights[0]}); move one of them to a folder of its own"
        )
    return True


#: The files that hold a model's weights where transformers looks for them.
MODEL_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def read_adapter_config(folder: Path) -> dict:
    """The adapter's config as JSON, refused in one line where it is no plain LoRA this move keeps
    exact: another peft method, DoRA, an init that changes the base, or options that change which
    weights exist (layer replication, LoRA on bare parameters, trainable token rows)."""
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: not JSON ({err})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise AdapterError(f"{folder}: a {kind or 'non-peft'} adapter; only LoRA adapters can be carried across")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise AdapterError(
            f"{folder}: a LoRA initialised with {init!r} changes its base model's weights; save it converted to a plain "
            "LoRA first (peft's path_initial_model_for_weight_conversion)"
        )
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(
            f"{folder}: bias={escape_controls(bias, 40)!r} trains the base model's own biases, which a moved adapter "
            "cannot carry as LoRA factors; only bias='none' can be carried across"
        )
    for option, what in (
        ("use_dora", "DoRA's magnitude vectors are not linear in the weights"),
        ("layer_replication", "replicated layers"),
        ("target_parameters", "LoRA on bare parameters"),
        ("trainable_token_indices", "trainable token rows"),
        ("alora_invocation_tokens", "activated LoRA"),
    ):
        if config.get(option):
            raise AdapterError(f"{folder}: {option} ({what}) cannot be carried across; only plain LoRA can")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS} (adapters saved as pickles are not read)")
    return config


def write_moved_adapter(
    folder: Path,
    transforms: Path,
    member: int,
    output: str | Path,
    *,
    base_folder: Path,
    trained_on: str,
    recorded_base: str,
    transforms_reference: str,
    member_label: str,
    overwrite: bool = False,
    moved_by: dict | None = None,
) -> Path:
    """Write the LoRA adapter at ``folder``, trained on the model in ``base_folder`` (named
    ``trained_on`` in its card), moved by the transform of model ``member`` saved at
    ``transforms``, to ``output``: a PEFT adapter folder whose config records ``recorded_base``
    as its base model, and whose marker records ``moved_by``. A base model of another spec than
    the transforms', or an adapter tensor no module of the base model takes, is refused in one
    line. The caller has checked ``output`` (:func:`hf_lmc.io.outputs.check_output_folder`)."""
    from peft import PeftModel  # peft loads torch-heavy tuners: only when an adapter is moved

    output = Path(output)
    config = read_adapter_config(folder)
    canonical = canonicalize(base_folder, dtype=torch.float64)
    transform = Transform.load(transforms, canonical.spec, model=member).to(torch.float64)
    with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as opened:
        saved = {key: opened.get_tensor(key) for key in opened.keys()}  # noqa: SIM118 - safe_open has no __iter__
    if not saved:
        raise AdapterError(f"{folder / ADAPTER_WEIGHTS}: holds no tensors")
    model = canonical.adapter.model_class.from_pretrained(base_folder, dtype=torch.float64)
    adapted = PeftModel.from_pretrained(model, str(folder), is_trainable=False).eval()
    _check_keys(adapted, saved, folder / ADAPTER_WEIGHTS)
    tensors, biases = _moved_tensors(adapted, saved, canonical, transform, bool(config.get("lora_bias")))
    config |= {"base_model_name_or_path": recorded_base, "revision": None}
    if biases:
        config["lora_bias"] = True
        if not isinstance(config.get("init_lora_weights"), bool):  # peft takes lora_bias with a boolean init only
            config["init_lora_weights"] = True  # (a loaded adapter's init is not used)
    card = _adapter_card(recorded_base, trained_on, shown_reference(transforms_reference), member_label, biases)
    logger.info(
        "writing the moved adapter to %s (its base: %s)",
        escape_controls(output, 120),
        escape_controls(recorded_base, 120),
    )
    staging = staging_folder(output)
    try:
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        card.save(staging / "README.md")
        move_into_place(staging, output, kind="adapter", overwrite=overwrite, moved_by=moved_by)
    except BaseException:
        discard(staging)
        raise
    return output


def _check_keys(adapted, saved: Mapping[str, Tensor], file: Path) -> None:
    """Refuse an adapter file with a tensor that the adapted model does not hold (a target the
    base model lacks, or a stray key): peft loads past it, and the move would leave it behind."""
    held = {_hf_key(name) for name in adapted.state_dict()} | set(adapted.state_dict())
    held |= {name.replace(".default.", ".").replace(".default", "") for name in adapted.state_dict()}
    stray = [key for key in saved if key not in held and _hf_key(key) not in held]
    if stray:
        raise AdapterError(
            f"{file}: tensor {escape_controls(stray[0], 120)!r} belongs to no module of the base model"
            + (f" ({len(stray) - 1} more like it)" if len(stray) > 1 else "")
            + "; was the adapter trained on another model?"
        )


def _moved_tensors(
    adapted, saved: Mapping[str, Tensor], canonical: CanonicalModel, transform: Transform, had_biases: bool
) -> tuple[dict[str, Tensor], bool]:
    """The moved adapter's tensors, under the adapter file's names (``saved``), in its dtypes, and
    whether they carry ``lora_B`` biases. ``adapted`` is the peft model over the base model that
    ``canonical`` reads; ``had_biases`` whether the adapter already had them."""
    layers = {name.removeprefix(_PREFIX): m for name, m in adapted.named_modules() if hasattr(m, "get_delta_weight")}
    effective = _effective_weights(adapted.get_base_model())
    updated = dict(effective)
    for name, layer in layers.items():
        updated[f"{name}.weight"] = effective[f"{name}.weight"] + layer.get_delta_weight("default").to(torch.float64)
        bias = getattr(layer.lora_B["default"], "bias", None) if hasattr(layer, "lora_B") and layer.lora_B else None
        if bias is not None:
            if f"{name}.bias" not in effective:
                raise AdapterError(f"{name}: its lora_B bias adds to a bias the base layer does not have")
            updated[f"{name}.bias"] = effective[f"{name}.bias"] + layer.scaling["default"] * bias.detach().double()
    whole = {_hf_key(key): key for key in saved if ".lora_" not in key}
    moved = transform.apply(canonical)
    exported = export_config(moved, dtype=torch.float64)
    written: dict[str, Tensor] = {}
    for group, base, effective_group, updated_group in _three_ways(moved, effective, updated, transform, exported):
        for key, value in updated_group.items():
            update = value - effective_group[key]
            scale = max(float(base[key].abs().max()) if base[key].numel() else 0.0, float(value.abs().max()), 1.0)
            module, _, part = key.rpartition(".")
            if key in whole:
                written[whole[key]] = effective_group[key]
            elif not _small(effective_group[key] - base[key], scale):
                shown = ", ".join(sorted({k.rpartition(".")[0] for k in whole})[:3])
                raise AdapterError(
                    f"what the adapter saves whole ({shown}) changes {key}, which the adapter does not carry: it "
                    "cannot be carried across"
                )
            if module in layers and part == "weight":
                written |= _factored(module, layers[module], update, saved, scale)
            elif module in layers and part == "bias":
                if not _small(update, scale):
                    written[f"{_PREFIX}{module}.lora_B.bias"] = update / layers[module].scaling["default"]
            elif not _small(update, scale):
                raise AdapterError(
                    f"the update of the adapter's targets moves into {key}, which a LoRA adapter does not carry "
                    f"(group {group}); merge the adapter into its model and apply the transforms to that instead"
                )
    needing = sorted(
        key.removeprefix(_PREFIX).removesuffix(".lora_B.bias") for key in written if key.endswith(".lora_B.bias")
    )
    embeddings = [name for name, layer in layers.items() if isinstance(layer.get_base_layer(), nn.Embedding)]
    if needing and embeddings:
        raise AdapterError(
            f"{', '.join(needing[:3])}: the moved update needs a lora_B bias (a norm shift folded into the layer), and peft "
            f"refuses lora_bias in an adapter that also targets the embedding {embeddings[0]}; move two adapters, one "
            "without the embeddings"
        )
    biases = bool(needing) or had_biases
    for name, layer in layers.items() if biases else ():  # peft gives every target a bias: zeros where none is needed
        written.setdefault(f"{_PREFIX}{name}.lora_B.bias", torch.zeros(layer.out_features, dtype=torch.float64))
    missing = [key for key in saved if key not in written]
    if missing:
        raise AdapterError(f"{missing[0]}: the adapter file's tensor belongs to no target the move carries")
    dtype = next(iter(saved.values())).dtype
    return {key: t.to(saved[key].dtype if key in saved else dtype).contiguous() for key, t in written.items()}, biases


def _hf_key(adapter_key: str) -> str:
    """The model's tensor that an adapter file's whole tensor replaces (``...wte.base_layer.weight``
    -> ``...wte.weight``; a ``modules_to_save`` copy is saved under the module's own name)."""
    return adapter_key.removeprefix(_PREFIX).replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def _effective_weights(model: nn.Module) -> dict[str, Tensor]:
    """The weights the adapted model computes with, under the base model's own tensor names:
    LoRA layers' base weights (which may be the adapter's saved copies) and the trained copies of
    ``modules_to_save``, without the LoRA factors (their updates are added separately)."""
    weights = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name or ".original_module." in name:
            continue
        weights[_hf_key(name)] = tensor.detach().to(torch.float64)
    return weights


def _three_ways(
    moved_base: CanonicalModel, effective: Mapping, updated: Mapping, transform: Transform, exported
) -> Iterator[tuple[object, dict, dict, dict]]:
    """Per group, the moved HF tensors of the base model, of the adapted model's base weights and
    of the adapted model with its updates: the same functions as the model's own move."""
    adapter, spec, config = moved_base.adapter, moved_base.spec, moved_base.config

    def moved(source: Mapping, group) -> dict[str, Tensor]:
        tensors = adapter.canonical_group(source, config, spec, group)
        return adapter.hf_group(
            {name: transform.apply_tensor(name, t) for name, t in tensors.items()}, exported, spec, group
        )

    with torch.no_grad():
        for group in spec.groups():
            base = adapter.hf_group(moved_base.group(group), exported, spec, group)
            yield group, base, moved(effective, group), moved(updated, group)


def _small(difference: Tensor, scale: float) -> bool:
    return difference.numel() == 0 or float(difference.abs().max()) <= _TOLERANCE * scale


def _factored(module: str, layer, update: Tensor, saved: Mapping[str, Tensor], scale: float) -> dict[str, Tensor]:
    """The LoRA factors of ``module`` whose scaled product is ``update`` (the moved weight's change,
    in the base layer's own layout), at the adapter's rank: its truncated SVD, split evenly."""
    base = layer.get_base_layer()
    rank, scaling = layer.r["default"], layer.scaling["default"]
    if isinstance(base, nn.Embedding):  # (vocab, d) = s (B A)^T, A: (r, vocab), B: (d, r)
        matrix, names = update.T, ("lora_embedding_A", "lora_embedding_B")
    elif isinstance(base, Conv1D):  # stored (in, out): peft's fan_in_fan_out
        matrix, names = update.T, ("lora_A.weight", "lora_B.weight")
    elif isinstance(base, nn.Linear):
        matrix, names = update, ("lora_A.weight", "lora_B.weight")
    elif isinstance(base, nn.Conv2d):  # (out, in, kh, kw): A is the convolution, B a 1x1 one
        matrix, names = update.reshape(update.shape[0], -1), ("lora_A.weight", "lora_B.weight")
    else:
        raise AdapterError(f"{module}: a LoRA on a {type(base).__name__} cannot be carried across")
    u, s, vh = torch.linalg.svd(matrix / scaling, full_matrices=False)
    root = s[:rank].sqrt()
    up, down = u[:, :rank] * root, root[:, None] * vh[:rank]
    if up.shape[1] < rank:  # a rank above the layer's smaller side: the factors' spare rank is zeros
        up = torch.cat([up, up.new_zeros(up.shape[0], rank - up.shape[1])], dim=1)
        down = torch.cat([down, down.new_zeros(rank - down.shape[0], down.shape[1])], dim=0)
    if not _small(matrix - scaling * (up @ down), scale):
        raise AdapterError(
            f"{module}: its moved update needs a rank above the adapter's {rank}; it cannot be carried at that rank"
        )
    keys = [f"{_PREFIX}{module}.{name}" for name in names]
    for key in keys:
        if key not in saved:
            raise AdapterError(f"{module}: the adapter file has no {key}")
    a_shape, b_shape = saved[keys[0]].shape, saved[keys[1]].shape
    return {keys[0]: down.reshape(a_shape), keys[1]: up.reshape(b_shape)}


def _adapter_card(recorded_base: str, trained_on: str, transforms: str, member: str, biases: bool) -> ModelCard:
    """A short peft-style card: what the adapter is, what it was moved from and by what."""
    hub_base = None if names_local_path(recorded_base) else recorded_base
    data = ModelCardData(base_model=hub_base, library_name="peft", tags=["lora", "hf-lmc", "linear-mode-connectivity"])
    lines = [
        f"# LoRA adapter of `{trained_on}`, moved by `{transforms}`",
        "",
        (
            f"This adapter was trained on `{trained_on}` (model `{member}` of the merge `{transforms}`). `hf-lmc "
            f"apply` carried it across the function-preserving transform that merge saved: on `{trained_on}` moved by "
            f"that transform it computes exactly what the original adapter computes on `{trained_on}`, and it applies "
            f"to the merge `{recorded_base}`, which lives in the same coordinates."
        ),
        "",
        "Each target keeps its rank; the moved factors are the truncated SVD of the moved update"
        + (
            ", and the norm shifts folded into the readers are carried as `lora_B` biases (`lora_bias`)."
            if biases
            else "."
        ),
        "",
        "```python",
        "from peft import PeftModel",
        "",
        f'model = PeftModel.from_pretrained(base_model, "path/to/this-adapter")  # base_model: {recorded_base}',
        "```",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
