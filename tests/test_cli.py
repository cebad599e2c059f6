"""The command line: help, the built-in exactness check, and clear errors."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest
import torch

from hf_lmc.cli import build_parser, main
from hf_lmc.verify import tiny_configs
from tests.models import build_model


def test_help_lists_commands_and_examples():
    out = subprocess.run([sys.executable, "-m", "hf_lmc.cli", "--help"], capture_output=True, text=True, check=True).stdout
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
    assert main(["check", "--dtype", "float64"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert all(any(arch in row and row[-1] == "ok" for row in rows) for arch in ("gpt2", "gpt_neox", "llama", "vit")), rows
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


@pytest.mark.parametrize("argv, code", [
    (["merge", "./a", "./b", "-o", "out", "--alpha", "0.5", "--weights", "0.5", "0.5"], 2),  # conflicting flags
    (["merge", "./a", "./b", "-o", "out", "--alpha", "1.5"], 2),  # a value out of range
    (["merge", "./a", "./b", "-o", "out", "--method", "dual"], 2),  # a data method without --data
    (["merge", "./a", "./b", "-o", "out", "--eval-data", "x.txt", "--alphas", "0"], 2),  # a grid with no line, before any reading
    (["merge", "./a", "./b", "-o", "out", "--eval-data", "x.txt", "--alphas", "1"], 2),
    (["merge", "./a", "./b", "-o", "out", "--device", "cuda:0"], 2) if not torch.cuda.is_available() else (["check", "--seed", "x"], 2),
    (["merge", "./no/such/a", "./no/such/b", "-o", "out"], 1),  # the run fails on what it reads
    (["barrier", "./no/such/a", "./no/such/b", "--eval-data", "plays.txt"], 1),
])
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
    import hf_lmc.pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_lmc.pipeline, "merge", interrupted)
    assert main(["merge", "./a", "./b", "-o", "out"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_generated_learning_flags_reach_the_options_model():
    """The flags are generated from :class:`LearnOptions`' fields: none given gives the model's
    defaults, and every flag arrives in its field."""
    from hf_lmc import cli
    from hf_lmc.options import LearnOptions

    parser = cli.build_parser()
    assert cli.LEARN.build(parser.parse_args(["merge", "a", "b", "--output", "o"])) == LearnOptions()
    flags = ["--steps", "7", "--lr", "0.1", "--residual-lr", "0.2", "--schedule", "cosine", "--warmup", "3", "--permutations", "ste",
             "--orthogonal", "exp", "--frame", "target", "--objective", "ensemble", "--worst-fraction", "0.3", "--focus", "excess", "--input-noise", "0.25",
             "--concentration", "2", "--seed", "5", "--lambda-range", "0.3", "0.7"]
    options = cli.LEARN.build(parser.parse_args(["merge", "a", "b", "--output", "o", *flags]))
    assert options == LearnOptions(
        steps=7, lr=0.1, residual_lr=0.2, schedule="cosine", warmup=3, permutations="ste", orthogonal="exp", frame="target", objective="ensemble",
        worst_fraction=0.3, focus="excess", input_noise=0.25, concentration=2.0, seed=5, lambda_range=(0.3, 0.7),
    )
    assert set(cli.LEARN.fields) == set(LearnOptions.model_fields)  # every option has its flag


def test_an_out_of_range_fraction_is_refused_before_any_work(capsys):
    assert main(["merge", "./no/such/a", "./no/such/b", "--output", "out", "--worst-fraction", "1.5"]) == 2
    _names_in_one_error_line(capsys, "--worst-fraction", "1.5")


def test_a_frame_the_parameterisation_cannot_take_is_refused_before_any_work(capsys):
    """Checked when the options are read, not when the maps are built after loading and matching."""
    assert main(["merge", "./no/such/a", "./no/such/b", "--output", "out", "--method", "learned", "--data", "./no/such/data",
                 "--orthogonal", "polar", "--frame", "target"]) == 2
    _names_in_one_error_line(capsys, "polar", "target")


def test_generated_accelerate_flags_reach_the_options_model():
    from hf_lmc import cli
    from hf_lmc.options import AccelerateOptions

    parser = cli.build_parser()
    flags = ["--mixed-precision", "bf16", "--gradient-accumulation-steps", "2", "--shard-endpoints", "--offload-endpoints",
             "--checkpoint-dir", "state", "--checkpoint-every", "5", "--resume"]
    options = cli.ACCELERATE.build(parser.parse_args(["merge", "a", "b", "--output", "o", *flags]))
    assert options == AccelerateOptions(mixed_precision="bf16", gradient_accumulation_steps=2, shard_endpoints=True, offload_endpoints=True,
                                        checkpoint_dir="state", checkpoint_every=5, resume=True)
    assert set(cli.ACCELERATE.fields) == set(AccelerateOptions.model_fields)


@pytest.mark.parametrize("flags, named", [(["--offload-endpoints"], ("offload", "shard")), (["--resume"], ("resume", "checkpoint"))])
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
    from hf_lmc import cli, options
    from hf_lmc.recipe import Recipe

    models = (options.LearnOptions, options.AccelerateOptions, options.EvalOptions, options.OutputOptions, options.MergeSpec)
    undescribed = [f"{m.__name__}.{name}" for m in models for name, field in m.model_fields.items() if not field.description]
    assert not undescribed
    schema = Recipe.model_json_schema()["$defs"]
    assert set(schema["LearnOptions"]["properties"]) == set(cli.LEARN.flags) == set(options.LearnOptions.model_fields)
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["merge"].format_help()
    assert all(flag in help_text for flag in (*cli.LEARN.flags.values(), *cli.ACCELERATE.flags.values(), *cli.OUTPUT.flags.values()))


def test_data_flags_mean_the_same_in_merge_and_barrier():
    """``--data`` is fitting data and ``--eval-data`` evaluation data in every command, each
    with its split and dataset configuration."""
    from hf_lmc import cli

    parser = cli.build_parser()
    flags = ["--data", "fit.txt", "--data-split", "validation", "--data-name", "raw",
             "--eval-data", "eval.txt", "--eval-data-split", "dev", "--eval-data-name", "clean", "--batch-size", "4"]
    for command in (["merge", "a", "b", "-o", "out"], ["barrier", "a", "b"]):
        args = parser.parse_args([*command, *flags])
        assert (args.data, args.eval_data) == ("fit.txt", "eval.txt")
        fit, evaluation = cli._fit_options(args), cli._eval_options(args)
        assert (fit.split, fit.name, fit.batch_size) == ("validation", "raw", 4)
        assert (evaluation.split, evaluation.name, evaluation.batch_size) == ("dev", "clean", 4)
    with pytest.raises(SystemExit):  # the barrier has nothing to measure without evaluation data
        parser.parse_args(["barrier", "a", "b", "--data", "fit.txt"])


def test_data_sets_keep_their_own_batch_size_unless_one_is_given():
    """Without ``--batch-size`` fitting and evaluation data take their own defaults, which the
    help shows; with it both take the one given."""
    from hf_lmc import cli
    from hf_lmc.options import EVAL_OPTIONS, FIT_OPTIONS

    assert FIT_OPTIONS.batch_size != EVAL_OPTIONS.batch_size
    parser = cli.build_parser()
    args = parser.parse_args(["merge", "a", "b", "-o", "out", "--data", "fit.txt", "--eval-data", "eval.txt"])
    assert (cli._fit_options(args).batch_size, cli._eval_options(args).batch_size) == (FIT_OPTIONS.batch_size, EVAL_OPTIONS.batch_size)
    help_line = next(a.help for a in parser._subparsers._group_actions[0].choices["merge"]._actions if "--batch-size" in a.option_strings)
    assert f"{FIT_OPTIONS.batch_size} for --data" in help_line and f"{EVAL_OPTIONS.batch_size} for --eval-data" in help_line
    with pytest.raises(TypeError):  # flags with a default per use build no single model
        cli.BATCHES.build(args)


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
