"""Recipes: the schema and its errors, the shipped recipes, and runs end to end on tiny models."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub import ModelCard

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.config.options import EVAL_OPTIONS, FIT_OPTIONS, LearnOptions
from hf_lmc.config.recipe import DataSection, RecipeError, load_recipe
from hf_lmc.evaluation.batches import DataError
from hf_lmc.io import zoo
from hf_lmc.merging import pipeline
from hf_lmc.merging.sweep import RecipeFailedError, RunFailedError, fold_adapter, load_data, run_recipe
from tests.models import MODEL_CLASSES, build_model, char_tokenizer_folder, logits, relative_error, sample_inputs
from tests.test_merge import RecordingApi

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = sorted(RECIPES.glob("*.yaml"))


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    """No test here reaches the Hub: ``recipe check`` reads a Hub model's config from the cache alone."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _recipe(**changes) -> dict:
    return {"models": ["a", "b"], "output": {"dir": "out"}} | changes


def _error(raw) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(raw)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- the schema --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_recipe_is_valid(path):
    recipe = load_recipe(path)
    assert recipe.runs() and recipe.output.dir.startswith("runs/")
    if path.name.startswith("pythia"):
        sizes = [name for name, _ in recipe.groups]
        assert sizes == ["14m", "31m", "70m", "160m", "410m"]
        for size, models in recipe.groups:
            assert [m.path for m in models] == [  # each pinned to its final checkpoint
                f"EleutherAI/pythia-{size}-seed1@step143000",
                f"EleutherAI/pythia-{size}-seed2@step143000",
            ]
        assert recipe.eval.data.dataset == "Salesforce/wikitext" and recipe.eval.data.name == "wikitext-103-raw-v1"


def test_editors_accept_every_shipped_recipe_by_the_printed_schema(capsys):
    jsonschema = pytest.importorskip("jsonschema")
    assert main(["recipe", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    for path in SHIPPED:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)  # string shorthands and single methods included
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_recipe(method="wieght"), schema)


def test_errors_name_the_key_on_one_line():
    assert "models[1].revison: unknown key; did you mean revision?" in _error(
        _recipe(models=["a", {"path": "b", "revison": "v1"}])
    )
    assert "models[1].revision: Input should be a valid string" in _error(
        _recipe(models=["a", {"path": "b", "revision": 3}])
    )
    assert "data: method 'dual' learns from data" in _error(_recipe(method=["weight", "dual"]))
    assert "method: unknown method 'wieght'; choose from average, weight" in _error(_recipe(method="wieght"))
    assert "weights: 2 weights but models has 3 models" in _error(_recipe(models=["a", "b", "c"], weights=[0.5, 0.5]))
    assert "weights: weights must sum to 1" in _error(_recipe(weights=[0.5, 0.6]))
    assert "weights: weights must be non-negative" in _error(_recipe(weights=[1.5, -0.5]))
    assert "alpha: Input should be less than or equal to 1" in _error(_recipe(alpha=1.5))
    assert "models[0].path: no zoo entry 'bert'" in _error(_recipe(models=["zoo:bert/seed0", "b"]))
    assert "models[0].revision: a zoo model has no revisions" in _error(
        _recipe(models=[{"path": "zoo:gpt2/seed0", "revision": "main"}, "b"])
    )
    assert "eval.data.split: the zoo corpus has splits train and test" in _error(
        _recipe(eval={"data": {"zoo": "shakespeare", "split": "validation"}})
    )
    assert "eval.data: give exactly one of dataset, files, zoo or sampled (got dataset and zoo)" in _error(
        _recipe(eval={"data": {"dataset": "x", "zoo": "digits"}})
    )
    assert "eval.alphas: the grid must increase from 0 to 1" in _error(
        _recipe(eval={"data": {"dataset": "x"}, "alphas": [0, 0.5]})
    )
    assert "output.shard_size: cannot read shard size '5XB'" in _error(
        _recipe(output={"dir": "o", "shard_size": "5XB"})
    )
    assert "device: unknown device 'tpu9'; use cpu, cuda or cuda:N" in _error(_recipe(device="tpu9"))
    assert "device: unknown device 'meta'" in _error(_recipe(device="meta"))
    assert "output: required key is missing" in _error({"models": ["a", "b"]})
    assert "output.dir: name a folder of its own" in _error(_recipe(output={"dir": "."}))
    assert "output.shard_size: Input should be a valid string or Input should be a valid integer" in _error(
        _recipe(output={"dir": "o", "shard_size": [1]})
    )
    assert "sweep: give models (one group of models) or sweep" in _error({"output": {"dir": "o"}})
    sweep = [{"name": "s", "models": ["a", "b"]}, {"name": "t", "models": ["c", "d"]}]
    message = _error(
        {"sweep": sweep, "method": ["weight", "average"], "output": {"dir": "o", "push_to_hub": "me/x-{group}"}}
    )
    assert "output.push_to_hub: 2 methods would push to one repo; put {method} in the repo id" in message
    assert "learn.schedule: unknown schedule 'cosine_decay'; choose from linear, cosine" in _error(
        _recipe(learn={"schedule": "cosine_decay"})
    )
    assert "learn.warmup: 300 warmup steps exceed the 200 training steps" in _error(
        _recipe(learn={"steps": 200, "warmup": 300})
    )
    polar = _error(_recipe(learn={"orthogonal": "polar", "frame": "target"}))
    assert "learn.frame: the polar parameterisation has no fixed base to step around" in polar
    assert "learn.residual_lr" in _error(_recipe(learn={"residual_lr": 0}))
    assert "learn.worst_fraction" in _error(_recipe(learn={"worst_fraction": 1.5}))
    assert "learn.input_noise" in _error(_recipe(learn={"input_noise": -0.1}))
    both = _error(_recipe(learn={"lambda_range": [0.7, 0.2]}, accelerate={"mixed_precision": "fp8"}))
    assert "learn.lambda_range" in both and "accelerate.mixed_precision" in both  # every bad key, in one line


def test_overrides_and_yaml_errors(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"sweep": [{"name": "s", "models": ["a", "b"]}], "output": {"dir": "o"}}))
    recipe = load_recipe(path, {"sweep.0.name": "tiny", "eval.data.zoo": "digits", "method": ["weight", "average"]})
    assert recipe.groups[0][0] == "tiny" and recipe.eval.data.zoo == "digits" and recipe.method == ["weight", "average"]
    with pytest.raises(RecipeError, match=r"\bsweep\b"):
        load_recipe(path, {"sweep.3.name": "x"})
    path.write_text("models: [a, b\noutput: {dir: o}\n")
    with pytest.raises(RecipeError, match=r"r\.yaml:\d+:\d+"):  # file, line and column
        load_recipe(path)


def test_cli_check_schema_and_bad_recipe(tmp_path, capsys):
    assert main(["recipe", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"models", "sweep", "method", "data", "learn", "accelerate", "eval", "output", "zoo"} <= set(
        schema["properties"]
    )
    assert main(["recipe", "check", str(RECIPES / "pythia-scaling-dual.yaml"), "--set", "learn.steps=100"]) == 0
    assert "15 run(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [a, {path: b, revison: x}]\noutput: {dir: o}\n")
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error: ") and err.count("\n") == 1 and "models[1].revison" in err
    assert main(["run", str(bad), "--set", "nokey"]) == 2
    err = capsys.readouterr().err
    assert "--set" in err and "nokey" in err and err.count("\n") == 1, err


def test_recipe_check_refuses_a_nan_alpha_grid(tmp_path, capsys):
    for grid in ("[0, .nan, 1]", "[0, 0.5, .inf]"):
        path = tmp_path / "r.yaml"
        path.write_text(f"models: [./a, ./b]\neval: {{data: {{dataset: x}}, alphas: {grid}}}\noutput: {{dir: o}}\n")
        assert main(["recipe", "check", str(path)]) == 2, grid
        err = capsys.readouterr().err
        assert err.startswith("hf-lmc: error: ") and err.count("\n") == 1 and "eval.alphas" in err, err
    assert "eval.alphas" in _error(_recipe(eval={"data": {"dataset": "x"}, "alphas": [0, float("nan"), 1]}))


def test_recipe_check_compares_the_configs_of_each_group(tmp_path, capsys):
    """``recipe check`` reads each model's config.json (no weight: the folders hold none) and
    refuses a group the merge would refuse, in one line naming the group and its models; a config
    it cannot read here (a folder not here, a Hub model not cached while offline) is a note."""
    for name, arch in (("gpt-a", "gpt2"), ("gpt-b", "gpt2"), ("vit", "vit")):
        tiny_configs()[arch].save_pretrained(tmp_path / name)
    sweep = [
        {"name": "same", "models": [str(tmp_path / "gpt-a"), str(tmp_path / "gpt-b")]},
        {"name": "elsewhere", "models": [str(tmp_path / "gpt-a"), "./not-here", "someone/not-cached"]},
        {"name": "mixed", "models": [str(tmp_path / "gpt-b"), str(tmp_path / "vit")]},
    ]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"sweep": sweep, "output": {"dir": str(tmp_path / "out")}}))
    capsys.readouterr()
    assert main(["recipe", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error: ") and err.count("\n") == 1, err
    assert "'mixed'" in err and "gpt-b" in err and str(tmp_path / "vit") in err and "'same'" not in err, err

    sweep.pop()
    path.write_text(yaml.safe_dump({"sweep": sweep, "output": {"dir": str(tmp_path / "out")}}))
    assert main(["recipe", "check", str(path)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "not compared" in line]
    assert len(notes) == 2 and "./not-here" in notes[0] + notes[1] and "someone/not-cached" in notes[0] + notes[1]
    assert not (tmp_path / "out").exists()


# -- runs --------------------------------------------------------------------------------------


def _twins(tmp_path, arch="vit"):
    """A and B = A moved by a random symmetry: every alignment method must find B's way back."""
    model = build_model(tiny_configs()[arch], seed=0, dtype=torch.float32)
    canonical = hf_lmc.canonicalize(model)
    twin = hf_lmc.to_hf(hf_lmc.random_symmetry(canonical.spec, seed=7, dtype=torch.float32).apply(canonical))
    model.save_pretrained(tmp_path / "a")
    twin.save_pretrained(tmp_path / "b")
    return model, tmp_path / "a", tmp_path / "b"


def _digits_like(path, n=8):
    torch.save({"pixel_values": torch.randn(n, 3, 8, 8), "labels": torch.randint(0, 3, (n,))}, path)
    return str(path)


@pytest.mark.slow
def test_sweep_writes_models_and_one_summary_table(tmp_path):
    model, a, b = _twins(tmp_path)
    data = _digits_like(tmp_path / "d.pt")
    recipe = {
        "name": "twins",
        "sweep": [{"name": "one", "models": [str(a), str(b)]}, {"name": "two", "models": [str(b), str(a)]}],
        "method": ["weight", "average"],
        "eval": {"data": {"files": [data], "batch_size": 4}, "alphas": [0, 0.5, 1]},
        "output": {"dir": str(tmp_path / "out"), "shard_size": "3KB"},
    }
    result = run_recipe(recipe, progress=False)
    out = tmp_path / "out"
    assert [(r.group, r.method) for r in result.runs] == [
        ("one", "weight"),
        ("one", "average"),
        ("two", "weight"),
        ("two", "average"),
    ]
    for run in result.runs[::2]:
        assert abs(run.barrier) < 1e-4 and run.barriers["average"] > 1e-3  # twins: alignment removes the barrier
    merged = MODEL_CLASSES["vit"].from_pretrained(out / "one" / "weight").eval()
    inputs = sample_inputs(model.config)
    assert relative_error(logits(merged, inputs), logits(model, inputs)) < 1e-3
    assert (out / "one" / "weight" / "model.safetensors.index.json").is_file()  # shard_size reached the writer
    card = (out / "two" / "weight" / "README.md").read_text()
    assert (
        'from_pretrained("out/two/weight")' in card and str(tmp_path) not in card and ".tmp-" not in card
    )  # the final folder, by its place in the recipe's output
    table = (out / "summary.md").read_text()
    assert "# twins" in table and "| models | average | weight |" in table and "| two |" in table
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["folder"] for r in rows] == ["one/weight", "one/average", "two/weight", "two/average"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"][0]["average_barrier"] == pytest.approx(result.runs[0].barriers["average"])
    assert (
        summary["recipe"]["eval"]["alphas"] == [0, 0.5, 1]
        and summary["recipe"]["learn"]["steps"] == LearnOptions().steps
    )  # defaults filled in
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    with pytest.raises(FileExistsError, match="output.overwrite"):
        run_recipe(recipe, progress=False)


def _with_nan(source: Path, target: Path) -> Path:
    """A copy of the model folder ``source`` with one NaN in its weights: a checkpoint the merge refuses."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = (
        tensors[name].clone().flatten().index_fill(0, torch.tensor([0]), float("nan")).view_as(tensors[name])
    )
    save_file(tensors, weights, metadata={"format": "pt"})
    return target


def _sweep_with_a_bad_group(tmp_path, **output) -> tuple[Path, Path]:
    """A recipe of three groups whose second holds a model with a NaN weight, and its output folder."""
    _, a, b = _twins(tmp_path)
    nan = _with_nan(b, tmp_path / "nan")
    out = tmp_path / "out"
    recipe = {
        "sweep": [
            {"name": "first", "models": [str(a), str(b)]},
            {"name": "second", "models": [str(a), str(nan)]},
            {"name": "third", "models": [str(b), str(a)]},
        ],
        "method": "average",
        "output": {"dir": str(out), **output},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, out


def test_a_failing_run_is_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    """One group that fails (a NaN weight) keeps the merge before it, the next group still runs,
    the summary records the failure with its one-line error, and the command exits 1."""
    path, out = _sweep_with_a_bad_group(tmp_path)
    capsys.readouterr()
    assert main(["run", str(path)]) == 1
    printed = capsys.readouterr()
    assert (out / "first" / "average" / "config.json").is_file() and (
        out / "third" / "average" / "config.json"
    ).is_file()
    assert not (out / "second").exists()  # nothing half-written of the run that failed
    rows = {r["group"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert [rows[g]["status"] for g in ("first", "second", "third")] == ["ok", "failed", "ok"]
    error = rows["second"]["error"]
    assert "NaN" in error and "\n" not in error and rows["first"]["error"] == ""
    summary = json.loads((out / "summary.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["ok", "failed", "ok"] and summary["runs"][1]["folder"] is None
    assert "failed" in (out / "summary.md").read_text()
    table = [line for line in printed.out.splitlines() if line.startswith("| second ")]
    assert table and "failed" in table[0], printed.out  # the printed table shows the failed run
    errors = [line for line in printed.err.splitlines() if line.startswith("hf-lmc: error:")]
    assert len(errors) == 1 and "second" in errors[0] and "NaN" in errors[0], printed.err
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert (
        main(["run", str(path), "--overwrite", "--set", "sweep.1.models.1=" + str(tmp_path / "b")]) == 0
    )  # replaceable


def test_fail_fast_stops_at_the_first_failure_and_keeps_what_finished(tmp_path, monkeypatch):
    """``--fail-fast`` (``output.fail_fast``) stops the sweep at the failing group: the group
    after it never runs, the group before it is kept, and the summary is written."""
    path, out = _sweep_with_a_bad_group(tmp_path)
    merged = []
    run = pipeline.run
    monkeypatch.setattr(
        pipeline,
        "run",
        lambda request, **options: merged.append(Path(request.output).parent.name) or run(request, **options),
    )
    assert main(["run", str(path), "--fail-fast", "-q"]) == 1
    assert merged == ["first", "second"]  # the third never started
    assert (out / "first" / "average" / "config.json").is_file() and not (out / "third").exists()
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [(r["group"], r["status"]) for r in rows] == [("first", "ok"), ("second", "failed"), ("third", "skipped")]
    with pytest.raises(RecipeFailedError, match=r"^second / average: .*NaN") as info:  # the Python API: the same
        run_recipe(path, overrides={"output.fail_fast": True, "output.overwrite": True}, progress=False)
    assert [r.status for r in info.value.result.runs] == ["ok", "failed", "skipped"]
    assert (out / "first" / "average" / "config.json").is_file()


def test_a_failing_run_pushes_only_what_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the stand-in is the network
    _, a, b = _twins(tmp_path)
    api = RecordingApi()
    recipe = {
        "sweep": [
            {"name": "good", "models": [str(a), str(b)]},
            {"name": "bad", "models": [str(a), str(tmp_path / "missing")]},
        ],
        "output": {"dir": str(tmp_path / "out"), "push_to_hub": "me/m-{group}"},
    }
    with pytest.raises(RunFailedError, match=r"^bad / weight: .*missing") as info:  # the run and the folder it lacks
        run_recipe(recipe, progress=False, api=api)
    assert [call[:2] for call in api.calls] == [("create_repo", "me/m-good"), ("upload_folder", "me/m-good")]
    assert [run.url for run in info.value.result.runs] == ["https://huggingface.co/me/m-good", None]
    assert (tmp_path / "out" / "good" / "weight" / "config.json").is_file()
    assert not (tmp_path / "out" / "bad").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    recipe["sweep"].pop()
    recipe["output"] |= {"dir": str(tmp_path / "out2")}
    result = run_recipe(recipe, progress=False, api=api)
    assert result.runs[0].url == "https://huggingface.co/me/m-good"
    assert json.loads((tmp_path / "out2" / "summary.json").read_text())["runs"][0]["url"] == result.runs[0].url
    assert "me/m-good" in (tmp_path / "out2" / "good" / "weight" / "README.md").read_text()


def test_peft_adapter_is_folded_into_its_model_first(tmp_path):
    from peft import LoraConfig, get_peft_model

    config = tiny_configs()["gpt2"]
    base = build_model(config, seed=1, dtype=torch.float32)
    base.save_pretrained(tmp_path / "base")
    char_tokenizer_folder(tmp_path / "base", config.vocab_size)
    lora = get_peft_model(
        build_model(config, seed=1, dtype=torch.float32),
        LoraConfig(r=2, target_modules=["c_attn", "c_fc"], init_lora_weights=False),
    )
    lora.save_pretrained(tmp_path / "lora")
    inputs = sample_inputs(config)
    expected = logits(lora.eval(), inputs)

    folded = (
        MODEL_CLASSES["gpt2"]
        .from_pretrained(fold_adapter(tmp_path / "base", tmp_path / "lora", tmp_path / "folded"))
        .eval()
    )
    assert relative_error(logits(folded, inputs), expected) < 1e-5
    assert relative_error(logits(base.eval(), inputs), expected) > 1e-3  # the adapter changes the function
    assert (tmp_path / "folded" / "tokenizer.json").is_file()

    recipe = _recipe(
        models=[{"path": str(tmp_path / "base"), "adapter": str(tmp_path / "lora")}, str(tmp_path / "base")],
        method="average",
        alpha=0.0,
        output={"dir": str(tmp_path / "out")},
    )
    run_recipe(recipe, progress=False)
    merged = MODEL_CLASSES["gpt2"].from_pretrained(tmp_path / "out" / "average").eval()
    assert relative_error(logits(merged, inputs), expected) < 1e-5  # alpha 0: the folded model itself
    card = ModelCard.load(tmp_path / "out" / "average" / "README.md")
    assert "base_model" not in card.data.to_dict()  # local models: named in the body
    assert "`base+lora` (a local model) and `base` (a local model)" in card.text and str(tmp_path) not in card.text

    recipe["models"][0]["adapter"] = str(tmp_path / "no-lora")
    recipe["output"]["dir"] = str(tmp_path / "out2")
    with pytest.raises(RunFailedError, match="^models / average: .*no-lora;"):
        run_recipe(recipe, progress=False)


def test_data_sources(tmp_path):
    (tmp_path / "a.txt").write_text("to be")
    (tmp_path / "b.txt").write_text("or not")
    assert load_data(DataSection(files=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]), "train") == [
        "to be",
        "or not",
    ]
    assert load_data(DataSection(files=[str(tmp_path)]), "train") == str(
        tmp_path
    )  # a folder of .txt files: load_batches reads it
    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    rows = load_data(DataSection(files=[str(tmp_path / "rows.jsonl")]), "train")
    assert rows["text"] == ["one", "two"]
    with pytest.raises(DataError, match="files mixes kinds"):
        load_data(DataSection(files=[str(tmp_path / "a.txt"), str(tmp_path / "rows.jsonl")]), "train")
    with pytest.raises(DataError, match="missing.txt"):
        load_data(DataSection(files=[str(tmp_path / "missing.txt")]), "train")
    rows.save_to_disk(str(tmp_path / "saved"))
    assert load_data(DataSection(dataset=str(tmp_path / "saved")), "test") == str(tmp_path / "saved")
    assert load_data(DataSection(zoo="shakespeare"), "train") == zoo.shakespeare()[0]
    excerpts = load_data(DataSection(zoo="shakespeare", samples=64, seq_len=64), "test")
    assert sum(map(len, excerpts)) >= 64 * 64 and all(
        any(e in play for play in zoo.shakespeare()[1]) for e in excerpts
    )  # held out


def _recording_run(calls: list):
    """Stands in for :func:`hf_lmc.merging.pipeline.run`: records each merge request."""

    def run(spec, **options):
        calls.append(spec)
        Path(spec.output).mkdir(parents=True)
        return pipeline.MergeResult(Path(spec.output), spec.method, 0.5)

    return run


def test_more_than_two_models_are_one_merge_of_all(tmp_path, monkeypatch):
    recipe = _recipe(models=["a", "b", "c"], weights=[0.2, 0.3, 0.5], output={"dir": str(tmp_path / "out")})
    calls = []
    monkeypatch.setattr(pipeline, "run", _recording_run(calls))
    result = run_recipe(recipe, progress=False)
    (spec,) = calls
    assert spec.models == ("a", "b", "c") and spec.weights == (0.2, 0.3, 0.5) and spec.revisions == (None,) * 3
    assert spec.device is None  # unset: the pipeline's default (a GPU when torch sees one)
    assert result.runs[0].folder == Path("weight") and (tmp_path / "out" / "summary.md").is_file()


def test_fitting_and_evaluation_data_keep_their_own_batch_size(tmp_path, monkeypatch):
    """A data section without batch_size takes its use's default (fitting and evaluation differ),
    ``samples`` rounds up to whole batches of that size, and a batch_size given is kept."""
    (tmp_path / "text.txt").write_text("to be or not to be")
    calls = []
    monkeypatch.setattr(pipeline, "run", _recording_run(calls))
    data = {"files": [str(tmp_path / "text.txt")], "samples": 100}
    for folder, batch in (("defaults", {}), ("given", {"batch_size": 4})):
        recipe = _recipe(
            method="dual", data=data | batch, eval={"data": data | batch}, output={"dir": str(tmp_path / folder)}
        )
        run_recipe(recipe, progress=False)
    (fit_default, eval_default), (fit_given, eval_given) = [(spec.data_options, spec.eval_options) for spec in calls]
    assert FIT_OPTIONS.batch_size != EVAL_OPTIONS.batch_size
    assert (fit_default.batch_size, fit_default.split) == (FIT_OPTIONS.batch_size, "train")
    assert (eval_default.batch_size, eval_default.split) == (EVAL_OPTIONS.batch_size, "test")
    assert (
        fit_default.max_batches * FIT_OPTIONS.batch_size >= 100 > (fit_default.max_batches - 1) * FIT_OPTIONS.batch_size
    )
    assert (fit_given.batch_size, fit_given.max_batches, eval_given.batch_size, eval_given.max_batches) == (
        4,
        25,
        4,
        25,
    )


def test_accelerate_options_reach_the_training_loop(tmp_path, monkeypatch):
    seen = {}

    def fit(
        self, batches, learn=None, *, accelerate=None, **options
    ):  # the loop's options objects, as the path receives them
        seen.update(learn=learn, accelerate=accelerate)
        return []

    monkeypatch.setattr(hf_lmc.DualMatcher, "fit", fit)
    _, a, b = _twins(tmp_path)
    recipe = _recipe(
        models=[str(a), str(b)],
        method="dual",
        data={"files": [_digits_like(tmp_path / "d.pt")], "batch_size": 4},
        learn={"steps": 7, "lr": 1e-4, "residual_lr": 5e-5, "schedule": "cosine", "warmup": 2, "permutations": "fixed"},
        accelerate={"mixed_precision": "bf16", "gradient_accumulation_steps": 4},
        output={"dir": str(tmp_path / "out")},
    )
    run_recipe(recipe, progress=False)
    learn, accelerate = seen["learn"], seen["accelerate"]
    assert (learn.steps, learn.lr, learn.residual_lr, learn.schedule, learn.warmup_steps) == (
        7,
        1e-4,
        5e-5,
        "cosine",
        2,
    )
    assert (accelerate.mixed_precision, accelerate.gradient_accumulation_steps) == ("bf16", 4)


@pytest.mark.slow
def test_a_recipe_under_torchrun_writes_once_what_one_process_writes(tmp_path):
    """``torchrun --nproc_per_node 2 -m hf_lmc run recipe.yaml``: one output folder, one summary,
    no staging folders left, and the merges of a one-process run (dual: to all-reduce rounding)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parent.parent
    for seed, name in ((1, "a"), (2, "b")):  # independent models: dual matching has something to learn
        build_model(tiny_configs()["vit"], seed=seed, dtype=torch.float32).save_pretrained(tmp_path / name)
    torch.manual_seed(0)
    data = _digits_like(tmp_path / "d.pt", n=16)
    env = os.environ | {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    launches = {
        "one": [sys.executable, "-m", "hf_lmc"],
        "two": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hf_lmc"],
    }
    for name, launch in launches.items():
        recipe = _recipe(
            models=[str(tmp_path / "a"), str(tmp_path / "b")],
            method=["weight", "dual"],
            data={"files": [data], "batch_size": 4},
            learn={"steps": 3, "lr": 1e-2, "seed": 0, "target_barrier": 0},
            output={"dir": str(tmp_path / name)},
        )
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        done = subprocess.run(
            [*launch, "run", str(tmp_path / f"{name}.yaml")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("written to") == 1, done.stdout  # the main process reports
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["runs"]
    for method in ("weight", "dual"):
        one, two = (load_file(tmp_path / name / method / "model.safetensors") for name in ("one", "two"))
        for key in one:
            torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5, msg=f"{method}: {key}")


@pytest.fixture
def tiny_zoo(monkeypatch):
    """The zoo's architectures at toy width and depth, so the offline recipe runs in seconds."""
    shrink = {
        "gpt2": {"n_embd": 16, "n_layer": 1, "n_head": 2},
        "pythia": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32},
        "llama": {
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 32,
        },
    }
    for name, config in shrink.items():
        monkeypatch.setitem(zoo.ZOO, name, zoo.ZOO[name].scaled(config=config, batch_size=4))


@pytest.mark.slow
def test_the_offline_recipe_runs(tiny_zoo, tmp_path, capsys):
    out = tmp_path / "out"
    args = [
        "run",
        str(RECIPES / "zoo-offline.yaml"),
        "--set",
        "zoo.steps=2",
        "--set",
        f"zoo.cache={tmp_path / 'zoo'}",
        "--set",
        f"output.dir={out}",
        "--set",
        "data.samples=4",
        "--set",
        "data.batch_size=4",
        "--set",
        "eval.data.samples=4",
        "--set",
        "eval.data.batch_size=4",
        "--set",
        "eval.alphas=3",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert any(
        all(word in line for word in ("models", "average", "weight", "activation")) for line in printed.splitlines()
    ), printed
    assert len(list(out.glob("*/*/config.json"))) == 6  # weight and activation merges of three pairs
    for arch in ("gpt2", "pythia", "llama"):
        for method in ("weight", "activation"):
            card = ModelCard.load(out / arch / method / "README.md")
            assert "base_model" not in card.data.to_dict()
            assert f"`zoo:{arch}/seed0` (a local model) and `zoo:{arch}/seed1` (a local model)" in card.text
            assert "```yaml" in card.text and "method:" in card.text  # the recipe that made it
    summary = (out / "summary.md").read_text()
    assert all(f"| {arch} " in summary for arch in ("gpt2", "pythia", "llama")), summary


def test_device_reaches_the_merge(tmp_path, monkeypatch):
    """``device:`` goes to every merge of the recipe, validated when the recipe is read (a
    recipe naming cuda can be checked on a machine without one; the run says so)."""
    calls = []
    monkeypatch.setattr(pipeline, "run", _recording_run(calls))
    for device in ("cpu", "cuda:1"):
        run_recipe(_recipe(device=device, output={"dir": str(tmp_path / device.replace(":", "-"))}), progress=False)
    assert [spec.device for spec in calls] == ["cpu", "cuda:1"]


def test_a_recipe_that_states_its_launch_refuses_another_and_prints_the_command(tmp_path, monkeypatch, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_recipe(output={"dir": str(tmp_path / "o")}, launch={"processes": 2})))
    assert main(["run", str(path)]) == 2  # started as one process: a usage error, before any work
    err = capsys.readouterr().err
    assert f"torchrun --nproc_per_node 2 -m hf_lmc run {path}" in err and "accelerate launch --num_processes 2" in err
    assert not (tmp_path / "o").exists()
    assert main(["recipe", "check", str(path)]) == 0
    assert f"runs as 2 processes: torchrun --nproc_per_node 2 -m hf_lmc run {path}" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "3")  # a launch of another size is refused too
    with pytest.raises(RecipeError, match="this launch started 3"):
        run_recipe(path, progress=False)
    assert "launch.processes" in _error(_recipe(launch={"processes": 0}))


def test_a_push_that_cannot_succeed_is_refused_before_the_first_merge(tmp_path, monkeypatch):
    from hf_lmc.io.hub import PushRefusedError
    from hf_lmc.merging import pipeline

    _, a, b = _twins(tmp_path)
    monkeypatch.setattr(pipeline, "run", lambda *args, **kwargs: pytest.fail("a merge began"))
    recipe = {"models": [str(a), str(b)], "output": {"dir": str(tmp_path / "out"), "push_to_hub": "me/m"}}
    with pytest.raises(PushRefusedError):  # offline here (the autouse fixture)
        run_recipe(recipe, progress=False, api=RecordingApi())
    assert not (tmp_path / "out").exists()


def test_an_existing_empty_output_dir_is_used_and_a_full_one_refused(tmp_path):
    """As ``merge`` takes an empty output folder (and ``save_pretrained`` and mergekit do)."""
    from hf_lmc.config.recipe import check_outputs

    out = tmp_path / "runs"
    out.mkdir()
    recipe = load_recipe({"models": ["zoo:gpt2/seed0", "zoo:gpt2/seed1"], "output": {"dir": str(out)}})
    check_outputs(recipe)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="output.overwrite"):
        check_outputs(recipe)
