"""``hf-lmc apply``: a saved transform moves a model, or a LoRA adapter trained on it, exactly.

Stock HF logits before and after, in float64, on every family: a moved model computes what the
model computes (the model the transform was fitted on, and another checkpoint of its shape), and
``PeftModel(moved B, moved adapter)`` computes what ``PeftModel(B, adapter)`` computes, for random
LoRA targets (attention, MLP, embeddings, heads, the ViT's patch convolution and a classifier
saved whole). A model of another spec, or an adapter that cannot be carried, is refused in one line.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel, get_peft_model

import hf_lmc
from hf_lmc.canonical.adapters import adapter_for
from hf_lmc.canonical.exactness import float64_rmsnorm, relative_error, sample_inputs, tiny_configs
from hf_lmc.cli import main
from hf_lmc.io.fingerprint import fingerprint
from hf_lmc.symmetry import Transform, random_symmetry
from hf_lmc.symmetry.stored import save_transforms
from tests.models import CONFIGS, build_model, logits

TINY = tiny_configs()

#: LoRA targets per family (peft matches module names by their last part), and what a
#: classifier saves whole.
TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc", "wte", "wpe", "lm_head"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "embed_in", "lm_head"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"],
    "vit": ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "projection"],
}


@pytest.fixture(autouse=True)
def _exact_rmsnorm():
    """LLaMA's logits to float64 (its stock RMSNorm rounds to float32 whatever the dtype)."""
    with float64_rmsnorm():
        yield


#: Draws that must come out each way whatever the random ones do: every target but the
#: embeddings (norm shifts carried as lora_B biases), and the embeddings alone.
TARGET_DRAWS = {
    (arch, 0): [t for t in targets if t not in {"wte", "wpe", "embed_in", "embed_tokens"}]
    for arch, targets in TARGETS.items()
} | {("gpt2", 1): ["wte", "wpe", "lm_head"], ("gpt_neox", 1): ["embed_in"], ("llama", 1): ["embed_tokens", "q_proj"]}


def _saved_pair(tmp_path, arch: str, seed: int = 3):
    """A and B saved as float64 folders, and a merge's transforms file whose B transform is
    random, recording each model's content fingerprint as a merge does."""
    build_model(TINY[arch], seed=0).save_pretrained(tmp_path / "a")
    b = build_model(TINY[arch], seed=1)
    b.save_pretrained(tmp_path / "b")
    spec = hf_lmc.canonicalize(b).spec
    transform = random_symmetry(spec, seed=seed)
    path = tmp_path / "merge" / "transforms.safetensors"
    path.parent.mkdir()
    sources = [
        {"reference": name, "revision": None, "local": True, "fingerprint": fingerprint(tmp_path / name)}
        for name in ("a", "b")
    ]
    save_transforms(
        path, [Transform(), transform], spec, names=["a", "b"], sources=sources, fitted={"method": "weight"}
    )
    return b, path


def _stock(folder, arch: str):
    return adapter_for(TINY[arch]).model_class.from_pretrained(folder, dtype=torch.float64).eval()


@pytest.mark.parametrize("arch", sorted(TINY))
def test_a_moved_model_computes_what_the_model_computes(arch, tmp_path):
    b, path = _saved_pair(tmp_path, arch)
    assert main(["apply", str(path.parent), str(tmp_path / "b"), "-o", str(tmp_path / "moved"), "-q"]) == 0
    moved = _stock(tmp_path / "moved", arch)
    inputs = sample_inputs(TINY[arch], dtype=torch.float64)
    assert relative_error(logits(moved, inputs), logits(b, inputs)) < 1e-9
    name = next(n for n, p in b.named_parameters() if p.dim() == 2)
    assert not torch.allclose(moved.get_parameter(name), b.get_parameter(name))  # moved, not copied
    card = (tmp_path / "moved" / "README.md").read_text()
    assert "merge" in card and "hf-lmc" in card


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_another_checkpoint_of_the_shape_is_moved_exactly_too(arch, tmp_path):
    _, path = _saved_pair(tmp_path, arch)
    later = build_model(TINY[arch], seed=7)
    later.save_pretrained(tmp_path / "later")
    out = tmp_path / "later-moved"
    assert main(["apply", str(path), str(tmp_path / "later"), "--member", "B", "-o", str(out), "-q"]) == 0
    inputs = sample_inputs(TINY[arch], dtype=torch.float64)
    assert relative_error(logits(_stock(out, arch), inputs), logits(later, inputs)) < 1e-9


def test_which_model_is_named_by_letter_number_or_label_and_an_unknown_one_is_refused(tmp_path, capsys):
    _, path = _saved_pair(tmp_path, "llama")
    other = build_model(TINY["llama"], seed=2)
    other.save_pretrained(tmp_path / "c")
    for member in ("A", "1", "a"):  # model A's transform is the identity here: the copy computes C
        out = tmp_path / f"as-{member}"
        assert main(["apply", str(path), str(tmp_path / "c"), "--member", member, "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    assert main(["apply", str(path), str(tmp_path / "c"), "--member", "Z", "-o", str(tmp_path / "z"), "-q"]) == 2
    message = capsys.readouterr().err.strip()
    assert "--member" in message and "\n" not in message and not (tmp_path / "z").exists()


def test_a_model_of_another_spec_is_refused_in_one_line(tmp_path, capsys):
    _, path = _saved_pair(tmp_path, "gpt2")
    deeper = TINY["gpt2"].__class__.from_dict({**TINY["gpt2"].to_dict(), "n_layer": 3})
    build_model(deeper, seed=1).save_pretrained(tmp_path / "deeper")
    capsys.readouterr()
    assert main(["apply", str(path), str(tmp_path / "deeper"), "--member", "B", "-o", str(tmp_path / "x")]) == 1
    message = capsys.readouterr().err.strip()
    assert "num_layers" in message and "\n" not in message and not (tmp_path / "x").exists()


def _adapter(model, arch: str, seed: int, folder, targets=None):
    """A random LoRA on ``targets`` (default: a random set of ``arch``'s), with random factors,
    saved at ``folder``."""
    rng = random.Random(seed)
    targets = targets or rng.sample(TARGETS[arch], rng.randint(1, len(TARGETS[arch])))
    config = LoraConfig(
        r=rng.choice([1, 2, 3]),
        lora_alpha=rng.choice([1, 4, 8]),
        target_modules=targets,
        init_lora_weights=False,  # B random too: every update is non-zero
        modules_to_save=["classifier"] if arch == "vit" else None,
    )
    torch.manual_seed(seed)
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.3 * torch.randn_like(p))  # a classifier trained away from the base's
    adapted.save_pretrained(folder)
    return targets


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("arch", sorted(TINY))
def test_a_moved_lora_on_the_moved_model_computes_what_the_lora_computes_on_the_model(arch, seed, tmp_path, capsys):
    """Random targets; on LayerNorm families, a target reading a norm with a shift beside an
    embedding target needs what peft refuses (lora_bias on an embedding), and is refused so."""
    b, path = _saved_pair(tmp_path, arch, seed=seed + 10)
    targets = _adapter(build_model(TINY[arch], seed=1), arch, seed, tmp_path / "lora", TARGET_DRAWS.get((arch, seed)))
    merge = str(path.parent)
    assert main(["apply", merge, str(tmp_path / "b"), "-o", str(tmp_path / "moved"), "-q"]) == 0
    args = [
        "apply",
        merge,
        str(tmp_path / "lora"),
        "--base-model",
        str(tmp_path / "b"),
        "-o",
        str(tmp_path / "moved-lora"),
    ]
    code = main([*args, "-q"])
    if code == 1:  # peft takes no lora_bias beside an embedding target: refused by name, in one line
        message = capsys.readouterr().err.strip().splitlines()[-1]
        embeddings = {"wte", "wpe", "embed_in"}
        assert "lora_bias" in message and embeddings & set(targets) and any(t in message for t in embeddings)
        assert not (tmp_path / "moved-lora").exists()
        return
    assert code == 0, targets
    inputs = sample_inputs(TINY[arch], dtype=torch.float64)
    expected = logits(PeftModel.from_pretrained(b, tmp_path / "lora").eval(), inputs)
    got = logits(PeftModel.from_pretrained(_stock(tmp_path / "moved", arch), tmp_path / "moved-lora").eval(), inputs)
    assert relative_error(got, expected) < 1e-9, targets
    assert relative_error(logits(_stock(tmp_path / "moved", arch), inputs), expected) > 1e-6  # the adapter matters
    saved = json.loads((tmp_path / "moved-lora" / "adapter_config.json").read_text())
    assert (
        Path(saved["base_model_name_or_path"]).resolve() == path.parent.resolve()  # a base that resolves
        and saved["r"] == json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["r"]
    )


def test_an_adapter_that_cannot_be_carried_is_refused_in_one_line(tmp_path, capsys):
    _, path = _saved_pair(tmp_path, "llama")
    config = LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, init_lora_weights=False)
    get_peft_model(build_model(TINY["llama"], seed=1), config).save_pretrained(tmp_path / "dora")
    capsys.readouterr()
    out = tmp_path / "out"
    args = ["apply", str(path), str(tmp_path / "dora"), "--base-model", str(tmp_path / "b"), "-o", str(out)]
    assert main(args) == 1
    message = capsys.readouterr().err.strip()
    assert "use_dora" in message and "\n" not in message and not out.exists()


def test_the_transforms_of_a_merge_on_the_hub_are_downloaded_without_its_weights(tmp_path, monkeypatch):
    """At the network boundary only: a recording stand-in for ``snapshot_download``."""
    from hf_lmc.io import hub

    b, path = _saved_pair(tmp_path, "gpt2")
    asked = []

    def snapshot_download(repo_id, *, revision, allow_patterns, ignore_patterns):
        asked.append((repo_id, revision, sorted(allow_patterns)))
        return str(path.parent)

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    out = tmp_path / "moved"
    assert main(["apply", "user/merged", str(tmp_path / "b"), "-o", str(out), "-q"]) == 0
    assert asked == [("user/merged", None, ["transforms.json", "transforms.safetensors"])]
    inputs = sample_inputs(TINY["gpt2"], dtype=torch.float64)
    assert relative_error(logits(_stock(out, "gpt2"), inputs), logits(b, inputs)) < 1e-9


def test_a_saved_norm_whose_change_moves_into_another_layer_is_refused_by_name(tmp_path, capsys):
    """A norm saved whole (modules_to_save) folds into the head the adapter does not carry."""
    _, path = _saved_pair(tmp_path, "gpt2")
    config = LoraConfig(r=2, target_modules=["c_attn"], modules_to_save=["ln_f"], init_lora_weights=False)
    adapted = get_peft_model(build_model(TINY["gpt2"], seed=1), config)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "modules_to_save" in name:
                p.mul_(1.5)
    adapted.save_pretrained(tmp_path / "lora")
    capsys.readouterr()
    out = tmp_path / "out"
    args = ["apply", str(path), str(tmp_path / "lora"), "--base-model", str(tmp_path / "b"), "-o", str(out)]
    assert main(args) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "lm_head.weight" in message and "ln_f" in message and "\n" not in message and not out.exists()


def test_an_update_that_needs_a_higher_rank_is_refused_by_name():
    """The rank check itself (no symmetry of the four families raises a target's rank)."""
    from hf_lmc.commands.apply_lora import AdapterError, _factored

    layer = get_peft_model(torch.nn.Sequential(torch.nn.Linear(6, 5)), LoraConfig(r=2, target_modules=["0"]))
    module = layer.base_model.model[0]
    saved = {
        "base_model.model.0.lora_A.weight": torch.zeros(2, 6),
        "base_model.model.0.lora_B.weight": torch.zeros(5, 2),
    }
    low = torch.randn(5, 2, dtype=torch.float64) @ torch.randn(2, 6, dtype=torch.float64)
    factors = _factored("0", module, low, saved, scale=1.0)
    up, down = factors["base_model.model.0.lora_B.weight"], factors["base_model.model.0.lora_A.weight"]
    assert torch.allclose(module.scaling["default"] * up @ down, low)
    with pytest.raises(AdapterError, match="^0: .*rank"):
        _factored("0", module, torch.randn(5, 6, dtype=torch.float64), saved, scale=1.0)


def test_an_adapter_of_a_model_of_another_spec_is_refused_as_the_model_is(tmp_path, capsys):
    _, path = _saved_pair(tmp_path, "gpt2")
    deeper = TINY["gpt2"].__class__.from_dict({**TINY["gpt2"].to_dict(), "n_layer": 3})
    build_model(deeper, seed=1).save_pretrained(tmp_path / "deeper")
    _adapter(build_model(deeper, seed=1), "gpt2", 0, tmp_path / "lora", ["c_attn"])
    capsys.readouterr()
    out = tmp_path / "out"
    args = ["apply", str(path), str(tmp_path / "lora"), "--base-model", str(tmp_path / "deeper"), "--member", "B"]
    assert main([*args, "-o", str(out), "-q"]) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "num_layers" in message and not out.exists()


@pytest.mark.parametrize("arch", sorted(TINY))
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_over_random_configs_a_moved_model_and_its_moved_lora_compute_what_they_did(arch, data):
    """Randomised configs of each family (tests.models' strategies): the moved model, and a LoRA on
    every target but the embeddings carried with it, compute what the originals compute."""
    config = data.draw(CONFIGS[arch]())
    symmetry_seed = data.draw(st.integers(0, 2**16))
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        b = build_model(config, seed=1)
        b.save_pretrained(folder / "b")
        spec = hf_lmc.canonicalize(b).spec
        path = folder / "merge" / "transforms.safetensors"
        path.parent.mkdir()
        save_transforms(path, [Transform(), random_symmetry(spec, seed=symmetry_seed)], spec, names=["a", "b"])
        targets = [t for t in TARGETS[arch] if t not in {"wte", "wpe", "embed_in", "embed_tokens"}]
        _adapter(build_model(config, seed=1), arch, symmetry_seed, folder / "lora", targets)
        hf_lmc.apply_transforms(path, folder / "b", folder / "moved", member="B", progress=False)
        hf_lmc.apply_transforms(path, folder / "lora", folder / "moved-lora", member="B", base_model=folder / "b")
        inputs = sample_inputs(config, dtype=torch.float64)
        moved = adapter_for(config).model_class.from_pretrained(folder / "moved", dtype=torch.float64).eval()
        assert relative_error(logits(moved, inputs), logits(b, inputs)) < 1e-9
        expected = logits(PeftModel.from_pretrained(b, folder / "lora").eval(), inputs)
        got = logits(PeftModel.from_pretrained(moved, folder / "moved-lora").eval(), inputs)
        assert relative_error(got, expected) < 1e-9
