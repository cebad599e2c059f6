"""The command line: help, the built-in exactness check, and clear errors."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import build_parser, main
from tests.models import build_model

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_commands_and_examples():
    out = subprocess.run(
        [sys.executable, "-m", "hf_lmc.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "check" in out and "symmetries" in out and "examples:" in out


def _commands(parser: argparse.ArgumentParser, name: str = "hf-lmc"):
    """``(name, parser)`` for the program and every command and sub-command under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from _commands(sub, f"{name} {command}")


def test_every_flag_that_help_names_exists():
    """A flag named in a command's help is one of that command's options, and every example
    line runs its command with that command's flags: help that names a flag no parser has sends
    users to an error."""
    flag = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
    parsers = dict(_commands(build_parser()))
    options = {name: {s for action in p._actions for s in action.option_strings} for name, p in parsers.items()}
    for name, parser in parsers.items():
        epilog = parser.epilog or ""
        body = parser.format_help().replace(epilog, "")  # the shared examples are checked line by line below
        assert set(flag.findall(body)) <= options[name], (name, set(flag.findall(body)) - options[name])
        for line in epilog.splitlines():
            words = line.split("#")[0].split()
            if words[:1] != ["hf-lmc"]:
                continue
            command = max((n for n in parsers if words[: len(n.split())] == n.split()), key=len)
            named = set(flag.findall(" ".join(words)))
            assert named <= options[command], (line, named - options[command])


def test_check_on_builtin_tiny_models_passes(capsys):
    assert main(["check", "--compute-dtype", "float64"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert all(any(arch in row and row[-1] == "ok" for row in rows) for arch in ("gpt2", "gpt_neox", "llama", "vit")), (
        rows
    )
    assert not any("FAILED" in row for row in rows)


def test_check_on_a_local_folder(tmp_path, capsys):
    build_model(tiny_configs()["gpt_neox"], dtype=torch.float32).save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--symmetries", "permutation"]) == 0
    assert "gpt_neox" in capsys.readouterr().out


def test_symmetries_prints_the_axes_table(tmp_path, capsys):
    tiny_configs()["llama"].save_pretrained(tmp_path)
    assert main(["symmetries", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layers.0.attn.k.weight" in out and "attn.0:k, residual:in" in out


def test_missing_folder_is_a_one_line_error(capsys):
    assert main(["check", "./no/such/model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error:") and "no/such/model" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv, code",
    [
        (["merge", "./a", "./b", "-o", "out", "--alpha", "0.5", "--weights", "0.5", "0.5"], 2),  # conflicting flags
        (["merge", "./a", "./b", "-o", "out", "--alpha", "1.5"], 2),  # a value out of range
        (["merge", "./a", "./b", "-o", "out", "--method", "dual"], 2),  # a data method without --data
        (
            ["merge", "./a", "./b", "-o", "out", "--eval-data", "x.txt", "--alphas", "0"],
            2,
        ),  # a grid with no line, before any reading
        (["merge", "./a", "./b", "-o", "out", "--eval-data", "x.txt", "--alphas", "1"], 2),
        (["merge", "./a", "./b", "-o", "out", "--device", "cuda:0"], 2)
        if not torch.cuda.is_available()
        else (["check", "--sample-seed", "x"], 2),
        (["merge", "./no/such/a", "./no/such/b", "-o", "out"], 1),  # the run fails on what it reads
        (["barrier", "./no/such/a", "./no/such/b", "--eval-data", "plays.txt"], 1),
    ],
)
def test_exit_codes_are_2_for_usage_and_1_for_a_failed_run(argv, code, capsys, tmp_path, monkeypatch):
    """As argparse, ``hf`` and mergekit: 2 when the command as written cannot run, 1 when the run
    fails; either way one ``hf-lmc: error:`` line."""
    monkeypatch.chdir(tmp_path)
    try:
        got = main(argv)
    except SystemExit as exit:  # argparse's own usage errors
        got = exit.code
    assert got == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" in err.strip().splitlines()[-1], err


def test_ctrl_c_ends_a_command_with_one_line_and_the_shells_code(capsys, monkeypatch):
    """Ctrl-C is a way a run ends, not a crash: one line and 130, as a shell reports it."""
    import hf_lmc.merging.pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_lmc.merging.pipeline, "run", interrupted)
    assert main(["merge", "./a", "./b", "-o", "out"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("fails", [False, True])
def test_a_command_destroys_the_process_group_it_set_up_and_no_other(fails, monkeypatch):
    """A launched run's process group is destroyed before ``main`` returns, whether the run
    succeeded or failed: gloo's worker threads, left to interpreter shutdown, can abort the
    process after its work is done. A group that existed before the command is left alone."""
    import weakref

    import torch.distributed as dist

    import hf_lmc.merging.pipeline

    made = []

    def run_that_sets_up_a_group(*args, **kwargs):
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        holder = {"group": dist.new_group()}  # a run's mesh, kept in a cycle as modules keep it
        holder["self"] = holder
        dist.all_reduce(torch.ones(2), group=holder["group"])
        made.append(weakref.ref(holder["group"]))
        if fails:
            raise ValueError("the run failed")
        return argparse.Namespace(wrote=False)  # as a launch's other processes report

    monkeypatch.setattr(hf_lmc.merging.pipeline, "run", run_that_sets_up_a_group)
    try:
        code = main(["merge", "./a", "./b", "-o", "out"])
        assert (code == 1) == fails
        assert not dist.is_initialized()
        assert made and made[0]() is None  # destroyed, not only forgotten: its threads joined

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the caller's
        main(["merge", "./a", "./b", "-o", "out"])
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_generated_learning_flags_reach_the_options_model():
    """The flags are generated from :class:`LearnOptions`' fields: none given gives the model's
    defaults, and every flag arrives in its field."""
    from hf_lmc import cli
    from hf_lmc.commands import common
    from hf_lmc.config.options import LearnOptions

    parser = cli.build_parser()
    assert common.LEARN.build(parser.parse_args(["merge", "a", "b", "--output", "o"])) == LearnOptions()
    flags = [
        "--steps",
        "7",
        "--lr",
        "0.1",
        "--residual-lr",
        "0.2",
        "--schedule",
        "cosine",
        "--warmup",
        "3",
        "--permutations",
        "ste",
        "--orthogonal",
        "exp",
        "--frame",
        "target",
        "--objective",
        "ensemble",
        "--worst-fraction",
        "0.3",
        "--focus",
        "excess",
        "--input-noise",
        "0.25",
        "--concentration",
        "2",
        "--seed",
        "5",
        "--lambda-range",
        "0.3",
        "0.7",
    ]
    options = common.LEARN.build(parser.parse_args(["merge", "a", "b", "--output", "o", *flags]))
    assert options == LearnOptions(
        steps=7,
        lr=0.1,
        residual_lr=0.2,
        schedule="cosine",
        warmup=3,
        permutations="ste",
        orthogonal="exp",
        frame="target",
        objective="ensemble",
        worst_fraction=0.3,
        focus="excess",
        input_noise=0.25,
        concentration=2.0,
        seed=5,
        lambda_range=(0.3, 0.7),
    )
    assert set(common.LEARN.fields) == set(LearnOptions.model_fields)  # every option has its flag


def test_an_out_of_range_fraction_is_refused_before_any_work(capsys):
    assert main(["merge", "./no/such/a", "./no/such/b", "--output", "out", "--worst-fraction", "1.5"]) == 2
    _names_in_one_error_line(capsys, "--worst-fraction", "1.5")


def test_a_frame_the_parameterisation_cannot_take_is_refused_before_any_work(capsys):
    """Checked when the options are read, not when the maps are built after loading and matching."""
    assert (
        main(
            [
                "merge",
                "./no/such/a",
                "./no/such/b",
                "--output",
                "out",
                "--method",
                "learned",
                "--data",
                "./no/such/data",
                "--orthogonal",
                "polar",
                "--frame",
                "target",
            ]
        )
        == 2
    )
    _names_in_one_error_line(capsys, "polar", "target")


def test_generated_accelerate_flags_reach_the_options_model():
    from hf_lmc import cli
    from hf_lmc.commands import common
    from hf_lmc.config.options import AccelerateOptions

    parser = cli.build_parser()
    flags = [
        "--mixed-precision",
        "bf16",
        "--gradient-accumulation-steps",
        "2",
        "--shard-endpoints",
        "--offload-endpoints",
        "--checkpoint-dir",
        "state",
        "--checkpoint-every",
        "5",
        "--resume",
    ]
    options = common.ACCELERATE.build(parser.parse_args(["merge", "a", "b", "--output", "o", *flags]))
    assert options == AccelerateOptions(
        mixed_precision="bf16",
        gradient_accumulation_steps=2,
        shard_endpoints=True,
        offload_endpoints=True,
        checkpoint_dir="state",
        checkpoint_every=5,
        resume=True,
    )
    assert set(common.ACCELERATE.fields) == set(AccelerateOptions.model_fields)


@pytest.mark.parametrize(
    "flags, named", [(["--offload-endpoints"], ("offload", "shard")), (["--resume"], ("resume", "checkpoint"))]
)
def test_an_accelerate_flag_without_the_one_it_needs_is_refused_before_any_work(capsys, flags, named):
    assert main(["merge", "./no/such/a", "./no/such/b", "--output", "out", *flags]) == 2
    _names_in_one_error_line(capsys, *named)


def test_negative_input_noise_is_refused_before_any_work(capsys):
    assert main(["merge", "./no/such/a", "./no/such/b", "--output", "out", "--input-noise", "-0.1"]) == 2
    _names_in_one_error_line(capsys, "--input-noise", "-0.1")


def _names_in_one_error_line(capsys, *named):
    """stderr holds one error line (after argparse's usage, if any), naming each of ``named``; no traceback."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert all(name in errors[0] for name in named), err


def test_every_option_is_described_once_for_flags_recipes_and_the_api():
    """Each option model's field carries the description that becomes its ``--help`` line and its
    recipe schema entry; a field added without one fails here."""
    from hf_lmc import cli
    from hf_lmc.commands import common
    from hf_lmc.config import options
    from hf_lmc.config.recipe import Recipe

    models = (
        options.LearnOptions,
        options.AccelerateOptions,
        options.EvalOptions,
        options.OutputOptions,
        options.MergeRequest,
    )
    undescribed = [
        f"{m.__name__}.{name}" for m in models for name, field in m.model_fields.items() if not field.description
    ]
    assert not undescribed
    schema = Recipe.model_json_schema()["$defs"]
    assert (
        set(schema["LearnOptions"]["properties"]) == set(common.LEARN.flags) == set(options.LearnOptions.model_fields)
    )
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["merge"].format_help()
    assert all(
        flag in help_text
        for flag in (*common.LEARN.flags.values(), *common.ACCELERATE.flags.values(), *common.OUTPUT.flags.values())
    )


def test_data_flags_mean_the_same_in_merge_and_barrier():
    """``--data`` is fitting data and ``--eval-data`` evaluation data in every command, each
    with its split and dataset configuration."""
    from hf_lmc import cli
    from hf_lmc.commands import common

    parser = cli.build_parser()
    flags = [
        "--data",
        "fit.txt",
        "--data-split",
        "validation",
        "--data-name",
        "raw",
        "--eval-data",
        "eval.txt",
        "--eval-data-split",
        "dev",
        "--eval-data-name",
        "clean",
        "--batch-size",
        "4",
    ]
    for command in (["merge", "a", "b", "-o", "out"], ["barrier", "a", "b"]):
        args = parser.parse_args([*command, *flags])
        assert (args.data, args.eval_data) == ("fit.txt", "eval.txt")
        fit, evaluation = common.fit_options(args), common.eval_options(args)
        assert (fit.split, fit.name, fit.batch_size) == ("validation", "raw", 4)
        assert (evaluation.split, evaluation.name, evaluation.batch_size) == ("dev", "clean", 4)
    with pytest.raises(SystemExit):  # the barrier has nothing to measure without evaluation data
        parser.parse_args(["barrier", "a", "b", "--data", "fit.txt"])


def test_data_sets_keep_their_own_batch_size_unless_one_is_given():
    """Without ``--batch-size`` fitting and evaluation data take their own defaults, which the
    help shows; with it both take the one given."""
    from hf_lmc import cli
    from hf_lmc.commands import common
    from hf_lmc.config.options import EVAL_OPTIONS, FIT_OPTIONS

    assert FIT_OPTIONS.batch_size != EVAL_OPTIONS.batch_size
    parser = cli.build_parser()
    args = parser.parse_args(["merge", "a", "b", "-o", "out", "--data", "fit.txt", "--eval-data", "eval.txt"])
    assert (common.fit_options(args).batch_size, common.eval_options(args).batch_size) == (
        FIT_OPTIONS.batch_size,
        EVAL_OPTIONS.batch_size,
    )
    help_line = next(
        a.help
        for a in parser._subparsers._group_actions[0].choices["merge"]._actions
        if "--batch-size" in a.option_strings
    )
    assert (
        f"{FIT_OPTIONS.batch_size} for --data" in help_line
        and f"{EVAL_OPTIONS.batch_size} for --eval-data" in help_line
    )
    with pytest.raises(TypeError):  # flags with a default per use build no single model
        common.BATCHES.build(args)


def test_a_misspelt_data_file_is_one_line_without_trying_the_hub(tmp_path, capsys, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("a file name was tried as a Hub dataset"))
    folder = tmp_path / "m"
    build_model(tiny_configs()["gpt2"], dtype=torch.float32).save_pretrained(folder)
    from tests.models import char_tokenizer_folder

    char_tokenizer_folder(folder, tiny_configs()["gpt2"].vocab_size)
    (tmp_path / "eval.txt").write_text("some text " * 50)
    capsys.readouterr()
    assert main(["barrier", str(folder), str(folder), "--eval-data", str(tmp_path / "eval.tx"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eval.tx" in err, err


# -- refusals before the heavy imports, the dry run, docs that match the parser ----------------------

#: Runs ``main(argv)`` and then prints, last, which heavy modules the process had loaded.
_HEAVY_AT_EXIT = """
import json, sys
from hf_lmc.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exit:  # argparse's own usage errors
    code = exit.code
print(sorted(m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["merge", "./a", "./b", "-o", "existing"],  # an output that exists, without --overwrite
        ["merge", "./a", "./b", "-o", "."],  # the working folder
        ["merge", "./a", "./b", "-o", "a/inside"],  # an output inside an input
        ["merge", "./a", "./b", "./c", "-o", "new", "--weights", "0.5", "0.6", "0.1"],  # weights off the simplex
        ["merge", "./a", "./b", "-o", "new", "--alpha", "1.5"],
        ["merge", "./a", "./b", "-o", "new", "--method", "dual"],  # a data method without --data
        [
            "merge",
            "./a",
            "./b",
            "-o",
            "new",
            "--method",
            "learned",
            "--data",
            "x.txt",
            "--schedule",
            "reduce_lr_on_plateau",
        ],
        ["merge", "./a", "./b", "-o", "new", "--revisions", "main"],  # one revision for two models
        ["barrier", "./a", "./b", "--eval-data", "x.txt", "--method", "learned"],
        ["barrier", "./a", "./b", "--eval-data", "x.txt", "--alphas", "1"],
        ["barrier", "./a", "./b", "./c", "./d", "--eval-data", "x.txt", "--plot", "p.png"],
        ["explain", "./a", "./b", "./c", "--eval-data", "x.txt"],  # explain compares two models, as its help says
        ["explain", "./a", "./b", "--eval-data", "x.txt", "--method", "dual"],
        ["explain", "./a", "./b", "--eval-data", "x.txt", "--orders", "0"],
        ["align", "./a", "./b", "-o", "a/inside"],  # align writes by the same protocol
        ["align", "./a", "./b", "-o", "new", "--method", "average"],  # a method that finds no symmetries
        ["align", "./a", "-o", "new"],  # one model
    ],
)
def test_usage_errors_come_before_torch_is_imported(argv, tmp_path):
    """Every refusal that needs no model (flags, weights, the method against the data, the output
    folder against the inputs) exits 2 before torch, transformers or huggingface_hub are imported."""
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "note.txt").write_text("mine")  # an empty folder would be taken as the output
    (tmp_path / "a").mkdir()
    run = subprocess.run(
        [sys.executable, "-c", _HEAVY_AT_EXIT, json.dumps(argv)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert run.stdout.splitlines()[-1] == "[]", run.stdout
    assert "Traceback" not in run.stderr and run.stderr.strip().splitlines()[-1].startswith("hf-lmc: error:"), (
        run.stderr
    )


@pytest.mark.parametrize("output", ["existing", "a"])  # an output that exists without --overwrite; an input
def test_a_recipe_is_refused_before_torch_is_imported(output, tmp_path):
    """``hf-lmc run`` reads the recipe and checks the folders it writes before the runner (torch,
    peft) loads; the Hub client may load, it is what names a model."""
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "note.txt").write_text("mine")  # an empty folder would be taken as the output
    (tmp_path / "a").mkdir()
    (tmp_path / "r.yaml").write_text(
        f"models: [./a, ./b]\noutput: {{dir: {output}, overwrite: {str(output == 'a').lower()}}}\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", _HEAVY_AT_EXIT, json.dumps(["run", "r.yaml"])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert run.returncode == 2, run.stderr
    assert "torch" not in run.stdout.splitlines()[-1] and "transformers" not in run.stdout.splitlines()[-1], run.stdout
    assert run.stderr.strip().splitlines()[-1].startswith("hf-lmc: error:") and "Traceback" not in run.stderr, (
        run.stderr
    )


def test_every_schedule_the_options_accept_is_one_transformers_runs():
    """The names are listed without transformers (checked before torch loads); each is one of
    transformers' and steps with the warmup and total steps alone, as the training loop calls it."""
    from transformers import SchedulerType, get_scheduler

    from hf_lmc.config.options import SCHEDULES

    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    for name in SCHEDULES:
        assert name in {s.value for s in SchedulerType}, name
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=2, num_training_steps=10)
        for _ in range(3):
            optimizer.step()
            scheduler.step()


def _tiny_pair(tmp_path, arch_b="gpt2"):
    """Two tiny language-model folders with a tokenizer, and a text file to evaluate on."""
    from tests.models import char_tokenizer_folder

    folders = []
    for k, arch in enumerate(("gpt2", arch_b)):
        config = tiny_configs()[arch]
        folder = tmp_path / f"m{k}"
        build_model(config, seed=k, dtype=torch.float32).save_pretrained(folder)
        char_tokenizer_folder(folder, config.vocab_size)
        folders.append(str(folder))
    (tmp_path / "text.txt").write_text("to be or not to be, that is the question. " * 40)
    return folders, str(tmp_path / "text.txt")


def test_dry_run_checks_prints_the_plan_and_reads_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """``merge --dry-run`` exits 0 with the models, the data's batches and the estimates, loads no
    model (the weights are streamed, tensor by tensor, to be checked; tests/test_dry_run.py) and
    leaves every folder as it was."""
    import hf_lmc.merging.pipeline

    (a, b), text = _tiny_pair(tmp_path)
    monkeypatch.setattr(
        hf_lmc.merging.pipeline, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded")
    )
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert (
        main(
            [
                "merge",
                a,
                b,
                "-o",
                str(tmp_path / "out"),
                "--method",
                "dual",
                "--data",
                text,
                "--eval-data",
                text,
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "m0" in out and "m1" in out and "estimates" in out and "batches" in out and "on disk" in out, out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_dry_run_refuses_as_the_merge_does(tmp_path, capsys):
    """A pair the merge refuses (two architectures) is refused by the dry run, with the exit code
    and the one line of the merge."""
    (a, b), _ = _tiny_pair(tmp_path, arch_b="gpt_neox")
    capsys.readouterr()  # saving the models shows progress bars
    assert main(["merge", a, b, "-o", str(tmp_path / "out"), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error:") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_recipe_check_takes_several_files(tmp_path, capsys):
    """Each recipe is validated on its own: the valid ones list their runs, each invalid one is one
    error line naming its file, and the exit code is the worst (2: an invalid recipe)."""
    import yaml

    good = [tmp_path / f"good{k}.yaml" for k in range(2)]
    for k, path in enumerate(good):
        path.write_text(yaml.safe_dump({"models": ["./a", "./b"], "output": {"dir": f"out{k}"}}))
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [a, {path: b, revison: x}]\noutput: {dir: o}\n")
    assert main(["recipe", "check", str(good[0]), str(bad), str(good[1])]) == 2
    captured = capsys.readouterr()
    assert all(f"{path}: valid" in captured.out for path in good), captured.out
    errors = captured.err.strip().splitlines()
    assert len(errors) == 1 and "bad.yaml" in errors[0], captured.err
    assert main(["recipe", "check", *map(str, good)]) == 0


def test_recipe_check_refuses_an_output_that_is_an_input_and_changes_nothing(tmp_path, capsys):
    """``recipe check`` holds the folders a recipe writes to the paths it reads, as ``run`` does
    before any work, without tidying anything on disk."""
    import yaml

    model = tmp_path / "a"
    model.mkdir()
    (model / "config.json").write_text("{}")
    debris = tmp_path / ".a.tmp-1-x"  # what check must not touch, even if it were a dead run's
    debris.mkdir()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"models": [str(model), "./b"], "output": {"dir": str(model), "overwrite": True}}))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["recipe", "check", str(recipe)]) == 2
    assert "output.dir" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def _documented_flags(document: str) -> tuple[str, dict[str, str]]:
    """docs/cli.md's text before the first command's section (it applies to every command), and
    each command's section by its name (``merge``, ``recipe``)."""
    intro, _, rest = document.partition("\n## `hf-lmc ")
    sections = {}
    for section in ("## `hf-lmc " + rest).split("\n## ")[0:]:
        name = re.match(r"#* ?`hf-lmc (\w+)`", section.strip())
        if name:
            sections[name.group(1)] = section
    return intro, sections


def test_docs_cli_names_every_flag_of_every_command_and_no_other():
    """docs/cli.md names every long flag of every command in the command's section (a flag that
    barrier, explain or align shares with merge may be described once, in merge's; -q/-v, shared by all,
    in the opening), every flag it names exists, and a flag's value is named as --help names it
    (``--push-to-hub REPO_ID``)."""
    flag = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
    intro, sections = _documented_flags((ROOT / "docs" / "cli.md").read_text(encoding="utf-8"))
    parsers = dict(_commands(build_parser()))
    everywhere = set()
    for name, parser in parsers.items():
        words = name.split()[1:]
        everywhere |= {s for action in parser._actions for s in action.option_strings if s.startswith("--")}
        shown = [
            action for action in parser._actions if action.help != argparse.SUPPRESS
        ]  # not a renamed flag's old name
        flags = {s for action in shown for s in action.option_strings if s.startswith("--")}
        flags -= {"--help", "--version"}
        if not words:
            continue
        described = set(flag.findall(intro + sections.get(words[0], "")))
        if words[0] in ("barrier", "explain", "align"):
            described |= set(flag.findall(sections["merge"]))
        assert flags <= described, (name, sorted(flags - described))
    document = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    quoted = re.findall(r"`([^`\n]*)`", document)
    code = [line for line in document.splitlines() if line.startswith("hf-lmc ")]
    named = {f for text in quoted + code if "hf-lmc" in text or text.startswith("-") for f in flag.findall(text)}
    assert named <= everywhere, sorted(named - everywhere)
    metavars = {
        s: action.metavar
        for p in parsers.values()
        for action in p._actions
        for s in action.option_strings
        if isinstance(action.metavar, str)
    }
    for option, value in re.findall(r"`(--[a-z][a-z0-9-]*) ([A-Z][\w.]*)", document):
        if option in metavars:
            assert metavars[option] == value, (option, value, metavars[option])


def test_each_command_shows_its_own_examples():
    """A command's --help shows examples of that command alone; ``hf-lmc --help`` shows them all,
    and every command has at least one."""
    parsers = dict(_commands(build_parser()))
    top = parsers.pop("hf-lmc")
    for name, parser in parsers.items():
        lines = [line.split("#")[0].split() for line in (parser.epilog or "").splitlines()[1:]]
        assert lines and all(words[: len(name.split())] == name.split() for words in lines), (name, parser.epilog)
        assert all(line in top.epilog for line in parser.epilog.splitlines()[1:]), name


@pytest.mark.slow
def test_verbose_names_the_dtype_written_and_quiet_hides_the_default_loss_notice(tmp_path):
    """``-v``'s writing line names what is written (never ``None`` for A's dtype kept), and
    transformers' ``loss_type=None`` notice (a GPT-2 given labels) is not shown: the default loss
    is the right one."""
    (a, b), _ = _tiny_pair(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "hf_lmc", "merge", a, b, "-o", str(tmp_path / "out"), "--method", "average", "-v", "-q"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    writing = next(line for line in run.stderr.splitlines() if line.startswith("hf-lmc: writing"))
    assert "None" not in writing, writing
    from hf_lmc.cli import _messages

    script = (
        "import argparse, torch; from hf_lmc.cli import _messages; from hf_lmc.canonical.exactness import tiny_configs; "
        "from transformers import GPT2LMHeadModel; model = GPT2LMHeadModel(tiny_configs()['gpt2']); "
        "ids = torch.zeros(1, 4, dtype=torch.long)\n"
        "with _messages(argparse.Namespace(quiet=True, verbose=0)): model(input_ids=ids, labels=ids)"
    )
    assert _messages  # the filter under test
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert run.returncode == 0 and "loss_type" not in run.stderr, run.stderr


def test_the_merge_requests_flags_are_generated_from_its_fields():
    """``--method``, ``--symmetries``, ``--weights``, ``--device``, ``--output``, ``--revisions``,
    ``--data``, ``--eval-data`` and ``--alphas`` come from :class:`MergeRequest`'s fields: parsed
    to the field's default when absent, and helped with the wording the field declares."""
    from hf_lmc import cli
    from hf_lmc.commands import common
    from hf_lmc.config.options import MergeRequest, flag_of

    parser = cli.build_parser()
    merge = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["merge"]
    actions = {action.dest: action for action in merge._actions}
    for name in common.REQUEST.fields:
        field, action = MergeRequest.model_fields[name], actions[name]
        assert action.default == (None if field.is_required() else field.default), name
        assert (flag_of(field).help or field.description) in action.help, name
        assert action.required == flag_of(field).required, name
    args = parser.parse_args(["merge", "a", "b", "-o", "out"])
    assert args.method == MergeRequest.model_fields["method"].default
    assert args.symmetries == MergeRequest.model_fields["symmetries"].default


@pytest.mark.parametrize(
    ("command", "old", "new"),
    [
        (["check"], "--dtype", "--compute-dtype"),
        (["check"], "--seed", "--sample-seed"),
        (["demo"], "--steps", "--train-steps"),
        (["apply", "m", "x", "-o", "out"], "--revision", "--revision-model"),
    ],
)
def test_a_renamed_flag_is_one_line_naming_its_new_spelling(capsys, command, old, new):
    """One meaning per flag across commands: where a command's flag meant something else than
    the same flag elsewhere it was renamed, and the old spelling says so before anything runs."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command, old, "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and new in err and err.count("\n") == 0, err
