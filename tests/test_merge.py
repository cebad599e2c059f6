"""The merge pipeline end to end: output folder, card, push, and every kind of bad input."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open

from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.merging.pipeline import merge
from tests.models import (
    MODEL_CLASSES,
    build_model,
    char_tokenizer_folder,
    logits,
    relative_error,
    sample_inputs,
    twin_folders,
)


def _save(model, folder, **kwargs):
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "vit"])
def test_weight_merge_of_a_twin_is_a(arch, tmp_path):
    model, (a, b) = twin_folders(tmp_path, arch, [7])
    out = merge(a, b, tmp_path / "merged", shard_size="3KB", progress=False).output
    assert (out / "model.safetensors.index.json").is_file()  # small shards: several files + index
    merged = MODEL_CLASSES[arch].from_pretrained(out).eval()
    inputs = sample_inputs(model.config)
    assert relative_error(logits(merged, inputs), logits(model, inputs)) < 1e-3
    card = ModelCard.load(out / "README.md").data.to_dict()
    assert "base_model" not in card  # local folders: the Hub could not resolve them
    assert {"merge", "hf-lmc", arch} <= set(card["tags"]) and card["library_name"] == "transformers"
    assert not any(p.name.startswith(".merged.tmp") for p in tmp_path.iterdir())


@pytest.mark.slow
def test_alpha_endpoints_and_dtype(tmp_path):
    config = tiny_configs()["llama"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float32),
        build_model(config, seed=2, dtype=torch.float32),
    )
    a, b = _save(model_a, tmp_path / "a"), _save(model_b, tmp_path / "b")
    inputs = sample_inputs(config)
    for alpha, expected in ((0.0, model_a), (1.0, model_b)):
        out = merge(a, b, tmp_path / f"m{alpha}", alpha=alpha, progress=False).output
        merged = MODEL_CLASSES["llama"].from_pretrained(out).eval()
        assert relative_error(logits(merged, inputs), logits(expected, inputs)) < 1e-4
    out = merge(a, b, tmp_path / "bf16", dtype="bfloat16", progress=False).output
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_average_is_the_plain_mean_of_stored_weights(tmp_path):
    config = tiny_configs()["gpt_neox"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float32),
        build_model(config, seed=2, dtype=torch.float32),
    )
    out = merge(
        _save(model_a, tmp_path / "a"),
        _save(model_b, tmp_path / "b"),
        tmp_path / "avg",
        method="average",
        progress=False,
    ).output
    merged = MODEL_CLASSES["gpt_neox"].from_pretrained(out)
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(value, (model_a.state_dict()[key] + model_b.state_dict()[key]) / 2, msg=key)
    assert "none (plain average" in (out / "README.md").read_text()


def test_eval_data_puts_barrier_table_and_plot_in_the_card_and_tokenizer_is_copied(tmp_path):
    config = tiny_configs()["gpt2"]
    a = _save(build_model(config, seed=1, dtype=torch.float32), tmp_path / "a")
    char_tokenizer_folder(a, config.vocab_size)
    b = _save(build_model(config, seed=2, dtype=torch.float32), tmp_path / "b")
    (tmp_path / "eval.txt").write_text("abc cab bca. " * 40)
    rc = main(
        [
            "merge",
            str(a),
            str(b),
            "-o",
            str(tmp_path / "m"),
            "--eval-data",
            str(tmp_path / "eval.txt"),
            "--alphas",
            "3",
            "--seq-len",
            "8",
            "--max-batches",
            "2",
        ]
    )
    assert rc == 0
    text = (tmp_path / "m" / "README.md").read_text()
    assert "| average |" in text and "| weight |" in text and "loss_along_path.png" in text
    assert (tmp_path / "m" / "loss_along_path.png").stat().st_size > 1000
    assert (tmp_path / "m" / "tokenizer.json").is_file() and (tmp_path / "m" / "generation_config.json").is_file()


class RecordingApi:
    """Stands in for ``HfApi`` at the network boundary: a token of user ``user``, who may write
    to ``me`` too; the calls that change the Hub are recorded (``whoami`` is not)."""

    token = "hf_test_token"

    def __init__(self):
        self.calls = []

    def whoami(self, *args, **kwargs):
        return {
            "name": "user",
            "orgs": [{"name": "me", "roleInOrg": "write"}],
            "auth": {"accessToken": {"role": "write"}},
        }

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs["repo_id"], kwargs))


def test_push_to_hub_creates_repo_and_uploads_the_folder(tmp_path):
    _, (a, b) = twin_folders(tmp_path, "gpt2", [7])
    api = RecordingApi()
    result = merge(a, b, tmp_path / "m", push_to_hub="user/merged", private=True, api=api, progress=False)
    assert result.url == "https://huggingface.co/user/merged"
    (kind, repo, kwargs), (kind2, repo2, kwargs2) = api.calls
    assert (kind, repo, kwargs["private"], kwargs["exist_ok"]) == ("create_repo", "user/merged", True, True)
    assert (kind2, repo2, kwargs2["folder_path"]) == ("upload_folder", "user/merged", str(tmp_path / "m"))
    assert "user/merged" in (tmp_path / "m" / "README.md").read_text()


# -- bad input: one clear line, non-zero exit, nothing left behind --------------------------------


def _fails(args, capsys, tmp_path, match):
    capsys.readouterr()  # drop what fixtures printed (transformers' own save progress)
    rc = main(args)
    err = capsys.readouterr().err
    assert rc != 0
    errors = [line for line in err.replace("\r", "\n").splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("hf-lmc: error:") and err.endswith("\n"), err
    assert match in err, err
    assert not (tmp_path / "out").exists()
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def test_bad_inputs(tmp_path, capsys):
    configs = tiny_configs()
    gpt2 = _save(build_model(configs["gpt2"], seed=1, dtype=torch.float32), tmp_path / "gpt2")
    llama = _save(build_model(configs["llama"], seed=1, dtype=torch.float32), tmp_path / "llama")
    wide = configs["gpt2"]
    wide.n_embd, wide.n_head = 12, 2
    gpt2_wide = _save(build_model(wide, seed=2, dtype=torch.float32), tmp_path / "gpt2_wide")
    out = str(tmp_path / "out")

    _fails(["merge", str(gpt2), str(llama), "-o", out], capsys, tmp_path, "one architecture")
    # Two widths merge (tests/test_widths.py), but not two head sizes: 8 / 2 heads vs 12 / 2 heads.
    _fails(["merge", str(gpt2), str(gpt2_wide), "-o", out], capsys, tmp_path, "head_dim 4 vs 6")

    sharded = _save(
        build_model(configs["llama"], seed=2, dtype=torch.float32), tmp_path / "sharded", max_shard_size="2KB"
    )
    shard = max(sharded.glob("model-*.safetensors"))
    shard.rename(tmp_path / "moved.safetensors")
    _fails(["merge", str(llama), str(sharded), "-o", out], capsys, tmp_path, "missing shard")
    (tmp_path / "moved.safetensors").rename(shard)

    corrupt = _save(build_model(configs["llama"], seed=3, dtype=torch.float32), tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\0" * 64)
    _fails(["merge", str(llama), str(corrupt), "-o", out], capsys, tmp_path, "corrupt")

    bad = build_model(configs["llama"], seed=4, dtype=torch.float32)
    with torch.no_grad():
        bad.model.layers[1].mlp.up_proj.weight[3, 2] = float("nan")
    nan = _save(bad, tmp_path / "nan")
    _fails(["merge", str(llama), str(nan), "-o", out], capsys, tmp_path, "NaN or Inf")
    _fails(["merge", str(llama), str(nan), "-o", out, "--method", "average"], capsys, tmp_path, "NaN or Inf")

    import transformers as tf

    _fails(["merge", str(llama), str(llama), "-o", out, "--method", "activation"], capsys, tmp_path, "pass --data")
    _fails(
        ["merge", str(llama), str(llama), "-o", out, "--method", "dual", "--data", str(tmp_path / "none.txt")],
        capsys,
        tmp_path,
        "no such",
    )

    bert = _save(
        tf.BertForMaskedLM(
            tf.BertConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8)
        ),
        tmp_path / "bert",
    )
    _fails(["merge", str(bert), str(bert), "-o", out], capsys, tmp_path, "model type 'bert' is not supported")
    _fails(["merge", str(llama), str(llama), "-o", out, "--alpha", "1.5"], capsys, tmp_path, "[0, 1]")

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["merge", str(llama), str(llama), "-o", out]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert main(["merge", str(llama), str(llama), "-o", out, "--overwrite"]) == 2  # not a folder hf_lmc wrote
    assert "keep.txt" in capsys.readouterr().err and (tmp_path / "out" / "keep.txt").read_text() == "mine"
    (tmp_path / "out" / "keep.txt").unlink()
    assert main(["merge", str(llama), str(llama), "-o", out, "--overwrite"]) == 0  # an empty folder
    assert main(["merge", str(llama), str(llama), "-o", out, "--overwrite"]) == 0  # one hf_lmc wrote
    assert (tmp_path / "out" / "config.json").is_file()


def test_barrier_cli_prints_json(tmp_path, capsys):
    _, (a, b) = twin_folders(tmp_path, "vit", [7])
    torch.save({"pixel_values": torch.randn(8, 3, 8, 8), "labels": torch.randint(0, 3, (8,))}, tmp_path / "d.pt")
    assert (
        main(
            [
                "barrier",
                str(a),
                str(b),
                "--eval-data",
                str(tmp_path / "d.pt"),
                "--alphas",
                "3",
                "--json",
                "--plot",
                str(tmp_path / "p.png"),
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert abs(report["barriers"]["weight"]) < 1e-4 and (tmp_path / "p.png").is_file()


@pytest.mark.parametrize(
    "method",
    [pytest.param("activation", marks=pytest.mark.slow), pytest.param("learned", marks=pytest.mark.slow), "dual"],
)
def test_data_driven_merge_of_a_twin_is_a(method, tmp_path, capsys):
    """Twins stay exact through every data-driven method (learned ones start at weight matching)."""
    model, (a, b) = twin_folders(tmp_path, "vit", [7])
    torch.save({"pixel_values": torch.randn(12, 3, 8, 8), "labels": torch.randint(0, 3, (12,))}, tmp_path / "fit.pt")
    torch.save({"pixel_values": torch.randn(8, 3, 8, 8), "labels": torch.randint(0, 3, (8,))}, tmp_path / "eval.pt")
    args = [
        "merge",
        str(a),
        str(b),
        "-o",
        str(tmp_path / "m"),
        "--method",
        method,
        "--data",
        str(tmp_path / "fit.pt"),
        "--batch-size",
        "4",
        "--steps",
        "3",
        "--lr",
        "1e-4",
        "--eval-data",
        str(tmp_path / "eval.pt"),
        "--alphas",
        "3",
    ]
    if method == "dual":
        args += ["--permutations", "sinkhorn", "--input-noise", "0.1", "--seed", "3", "--objective", "labels"]
    if method == "learned":
        args += ["--permutations", "fixed", "--residual-lr", "1e-5"]  # the default objective, ensemble
    assert main(args) == 0
    merged = MODEL_CLASSES["vit"].from_pretrained(tmp_path / "m").eval()
    inputs = sample_inputs(model.config)
    assert relative_error(logits(merged, inputs), logits(model, inputs)) < 1e-3
    card = (tmp_path / "m" / "README.md").read_text()
    assert f"| method | `{method}` |" in card and f"| {method} |" in card  # the barrier table has the method's row
    assert ("hardened" in card) == (method == "dual")
    assert ("objective `ensemble`" in card) == (method == "learned")
    assert ("Gaussian noise of std 0.1 added" in card) == (method == "dual")
    assert ("## Training" in card) == (method != "activation")
    assert ("| seed | 3 |" in card) == (method == "dual")
    if method == "learned":
        assert "| steps | 3 (gradient accumulation 1) |" in card
        assert "| launch | 1 process, mixed precision `no` |" in card  # the launch it trained in
        assert "fit.pt' (split `train`, batches of 4) |" in card
        assert (
            "Adam, lr 0.0001, residual maps 1e-05, schedule `cosine`" in card and "frame `own`" in card
        )  # the default schedule


def test_barrier_of_a_learned_method_needs_fit_data(tmp_path, capsys):
    _, (a, b) = twin_folders(tmp_path, "vit", [7])
    torch.save({"pixel_values": torch.randn(8, 3, 8, 8), "labels": torch.randint(0, 3, (8,))}, tmp_path / "d.pt")
    assert main(["barrier", str(a), str(b), "--eval-data", str(tmp_path / "d.pt"), "--method", "learned"]) == 2
    assert "pass --data" in capsys.readouterr().err
    args = [
        "barrier",
        str(a),
        str(b),
        "--eval-data",
        str(tmp_path / "d.pt"),
        "--method",
        "activation",
        "--data",
        str(tmp_path / "d.pt"),
        "--alphas",
        "3",
        "--json",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert abs(report["barriers"]["activation"]) < 1e-4


def test_plain_average_sums_large_tensors_in_row_blocks_exactly():
    from hf_lmc.canonical.form import weighted_sum
    from hf_lmc.merging.average import weighted_rows

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(17, 3, generator=g).half() for _ in range(3))
    for tensors, weights in (([a, b], [0.7, 0.3]), ([a, b, c], [0.2, 0.5, 0.3])):
        expected = weighted_sum([t.float() for t in tensors], weights).half()
        assert torch.equal(weighted_rows(tensors, weights, block=5), expected)  # blocks of one row
        assert torch.equal(weighted_rows(tensors, weights), expected)


@pytest.mark.parametrize("settings", [{"alpha": "half"}, {"alpha": True}, {"alpha": None}])
def test_an_alpha_that_is_not_a_number_is_named_not_a_traceback(settings):
    """Checked before any model is read: the models here do not exist."""
    from hf_lmc.config.options import ParameterError

    with pytest.raises(ParameterError, match="alpha"):
        merge("./no/such/a", "./no/such/b", "out", progress=False, **settings)
