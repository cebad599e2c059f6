"""The dry run is the run without the work: every refusal a merge makes without computing the
merge, ``--dry-run`` makes too, in the same one line and exit code (weights that are not finite
or overflow the written dtype, a push that cannot be made, a tokenizer larger than the model's
vocabulary), and the merge makes the push and tokenizer refusals before any work."""

from __future__ import annotations

import copy
import re

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi

from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.merging import pipeline
from tests.models import build_model, char_tokenizer_folder


def _run(args: list[str], capsys) -> tuple[int, list[str]]:
    """``hf-lmc ARGS``: its exit code and its error lines (below any progress bars); never a traceback."""
    capsys.readouterr()  # what fixtures printed (transformers' save progress)
    code = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.replace("\r", "\n").splitlines() if "error:" in line]


def _dry_and_real(args: list[str], capsys) -> list[tuple[int, list[str]]]:
    """The dry run of ``args``, then the merge itself."""
    return [_run([*args, "--dry-run"], capsys), _run(args, capsys)]


def _pair(tmp_path, arch: str, change=None, *, only_b: bool = False, same: bool = False, config=None):
    """Two tiny ``arch`` models saved to ``tmp_path/a`` and ``tmp_path/b`` (one model twice with
    ``same``), ``change(model)`` applied under ``no_grad`` to each (to B alone with ``only_b``)."""
    config = config or tiny_configs()[arch]
    folders = []
    for name, seed in (("a", 1), ("b", 1 if same else 2)):
        model = build_model(config, seed=seed, dtype=torch.float32)
        if change is not None and (name == "b" or not only_b):
            with torch.no_grad():
                change(model)
        model.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    return folders


@pytest.mark.parametrize("method", ["average", "weight"])
def test_a_nan_weight_is_refused_by_the_dry_run_as_by_the_merge(method, tmp_path, capsys):
    a, b = _pair(
        tmp_path, "llama", lambda m: m.model.layers[1].mlp.up_proj.weight.__setitem__((3, 2), torch.nan), only_b=True
    )
    out = tmp_path / "out"
    runs = _dry_and_real(["merge", a, b, "-o", str(out), "--method", method, "--device", "cpu"], capsys)
    for code, errors in runs:
        assert code == 1 and len(errors) == 1 and "model.layers.1.mlp.up_proj.weight" in errors[0], (code, errors)
    assert not out.exists()


@pytest.mark.parametrize("method", ["average", "weight"])
def test_a_weight_beyond_float16_is_refused_by_the_dry_run_as_by_the_merge(method, tmp_path, capsys):
    """Finite inputs, but 1e6 is beyond float16: both name the tensor and the flag, exit 2."""
    a, b = _pair(tmp_path, "gpt2", lambda m: m.transformer.h[0].mlp.c_fc.weight.__setitem__((0, 0), 1e6))
    out = tmp_path / "out"
    args = ["merge", a, b, "-o", str(out), "--method", method, "--dtype", "float16", "--device", "cpu"]
    for code, errors in _dry_and_real(args, capsys):
        assert code == 2 and len(errors) == 1, (code, errors)
        assert "h.0.mlp.c_fc.weight" in errors[0] and "float16" in errors[0] and "--dtype" in errors[0], errors
    assert not out.exists()
    assert _run([*args[:-4], "--dtype", "bfloat16", "--dry-run"], capsys)[0] == 0


def test_a_plain_average_into_a_half_precision_first_model_is_refused_not_written_as_inf(tmp_path, capsys):
    """A float16 A and a float32 B holding 2e5 (half of it, the average, is beyond float16): with no --dtype the average keeps A's dtype, where
    the sum does not fit. Both runs refuse it naming the tensor and --dtype (it used to be written
    as inf); with --dtype float32 it merges, finite."""
    a, b = _pair(tmp_path, "gpt2", lambda m: m.transformer.h[0].mlp.c_fc.weight.__setitem__((0, 0), 2e5), only_b=True)
    half = build_model(tiny_configs()["gpt2"], seed=1, dtype=torch.float16)
    half.save_pretrained(a)
    out = tmp_path / "out"
    args = ["merge", a, b, "-o", str(out), "--method", "average", "--device", "cpu"]
    for code, errors in _dry_and_real(args, capsys):
        assert code == 2 and len(errors) == 1 and "h.0.mlp.c_fc.weight" in errors[0] and "--dtype" in errors[0], errors
    assert not out.exists()
    assert _run([*args, "--dtype", "float32", "-q"], capsys)[0] == 0
    from safetensors.torch import load_file

    merged = load_file(str(out / "model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in merged.values() if t.is_floating_point())


def _large_folded_gain(model) -> None:
    """A norm gain and the column it scales, each within float16, whose product (the folded
    reader an aligned merge writes) is not: 2000 * 50 = 1e5 > 65504."""
    layer = model.model.layers[0]
    layer.post_attention_layernorm.weight[0] = 2000.0
    layer.mlp.up_proj.weight[:, 0] = 50.0
    layer.mlp.gate_proj.weight[:, 0] = 50.0


@pytest.mark.parametrize("method, refused", [("weight", True), ("average", False)])
def test_a_norm_gain_folded_beyond_float16_is_refused_where_the_merge_folds_it(method, refused, tmp_path, capsys):
    """An aligned merge writes the gain folded into the readers and refuses it; the plain average
    writes the stored tensors and does not. The dry run estimates the folded magnitudes with the
    merge's own folding, so it agrees in both."""
    a, b = _pair(tmp_path, "llama", _large_folded_gain, same=True)
    out = tmp_path / "out"
    args = ["merge", a, b, "-o", str(out), "--method", method, "--dtype", "float16", "--device", "cpu"]
    (dry, dry_errors), (real, real_errors) = _dry_and_real(args, capsys)
    assert dry == real == (2 if refused else 0), (dry_errors, real_errors)
    if refused:
        assert (
            len(dry_errors) == len(real_errors) == 1 and "layers.0.mlp" in dry_errors[0] and "float16" in dry_errors[0]
        )
    assert out.exists() != refused


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    """This machine as one that never logged in: no token in the environment or the token file."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def _no_work(monkeypatch) -> None:
    """Reading a model (the first work after the checks) fails the test."""
    monkeypatch.setattr(pipeline, "_read_models", lambda *args, **kwargs: pytest.fail("a model was read first"))


def test_a_push_without_a_token_is_refused_before_any_work(no_token, tmp_path, capsys, monkeypatch):
    a, b = _pair(tmp_path, "gpt2")
    monkeypatch.setattr(HfApi, "whoami", lambda *args, **kwargs: pytest.fail("the Hub was asked without a token"))
    _no_work(monkeypatch)
    out = tmp_path / "out"
    for code, errors in _dry_and_real(["merge", a, b, "-o", str(out), "--push-to-hub", "me/merged"], capsys):
        assert code == 1 and len(errors) == 1 and "me/merged" in errors[0], (code, errors)
    assert not out.exists()


def test_a_push_to_an_unreachable_hub_is_refused_before_any_work(no_token, tmp_path, capsys, monkeypatch):
    """A token, but no network: the Hub's ``whoami`` (the network boundary) fails to connect."""
    a, b = _pair(tmp_path, "gpt2")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")

    def unreachable(self, *args, **kwargs):
        raise ConnectionError("[Errno -3] Temporary failure in name resolution\nand a traceback's worth more")

    monkeypatch.setattr(HfApi, "whoami", unreachable)
    _no_work(monkeypatch)
    out = tmp_path / "out"
    for code, errors in _dry_and_real(["merge", a, b, "-o", str(out), "--push-to-hub", "me/merged"], capsys):
        assert code == 1 and len(errors) == 1 and "me/merged" in errors[0] and "ConnectionError" in errors[0], errors
    assert not out.exists()


@pytest.mark.parametrize("repo, writable", [("me/merged", True), ("team/merged", False), ("other/merged", False)])
def test_the_push_namespace_is_one_the_token_writes_to(repo, writable, no_token, tmp_path, capsys, monkeypatch):
    """``whoami`` answers for user ``me``, a reader of ``team``: only ``me/...`` may be pushed to."""
    a, b = _pair(tmp_path, "gpt2")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    account = {
        "name": "me",
        "orgs": [{"name": "team", "roleInOrg": "read"}],
        "auth": {"accessToken": {"role": "write"}},
    }
    monkeypatch.setattr(HfApi, "whoami", lambda self, *args, **kwargs: account)
    code, errors = _run(["merge", a, b, "-o", str(tmp_path / "out"), "--push-to-hub", repo, "--dry-run"], capsys)
    assert (code, len(errors)) == ((0, 0) if writable else (1, 1)), errors
    if not writable:
        assert repo in errors[0]


@pytest.mark.parametrize("method, data", [("average", "--eval-data"), ("activation", "--data")])
def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_any_work(method, data, tmp_path, capsys, monkeypatch):
    """Six tokens for a model of four embedding rows: the merge failed with an IndexError inside
    the model after its work; now it and the dry run refuse at once, naming the tokenizer's folder
    and both sizes."""
    config = copy.deepcopy(tiny_configs()["gpt2"])
    config.vocab_size = 4
    a, b = _pair(tmp_path, "gpt2", config=config)
    char_tokenizer_folder(a, 4)  # 6 tokens
    (tmp_path / "text.txt").write_text("abc ab. ca\n" * 40)
    monkeypatch.setattr(pipeline, "align", lambda *args, **kwargs: pytest.fail("aligned before the data was checked"))
    out = tmp_path / "out"
    args = ["merge", a, b, "-o", str(out), "--method", method, data, str(tmp_path / "text.txt"), "--seq-len", "8"]
    for code, errors in _dry_and_real([*args, "--device", "cpu"], capsys):
        assert code == 1 and len(errors) == 1, (code, errors)
        assert a in errors[0] and {"6", "4"} <= set(re.findall(r"\b\d+\b", errors[0])), errors
    assert not out.exists()


def test_the_plan_reads_every_weight_and_states_what_it_did_not_check(tmp_path, capsys):
    a, b = _pair(tmp_path, "gpt2")
    capsys.readouterr()
    assert main(["merge", a, b, "-o", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "every weight" in out and "not checked: the merge's own numbers" in out, out
