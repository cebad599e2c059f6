"""No input is lost and no output is half-written, however the output is spelled or the run ends:
an output that is, contains or lies inside an input is refused; concurrent writers cannot both
succeed; runs killed by SIGKILL leave debris that the next run removes; SIGTERM cleans up as
Ctrl-C does; an interrupted ``--overwrite`` never loses the old folder."""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.config.options import OutputExistsError
from hf_lmc.io import export, outputs
from hf_lmc.io.export import save_canonical, write_checkpoint
from hf_lmc.io.outputs import (
    MARKER,
    _try_lock,
    check_apart,
    check_replaceable,
    clean_stale,
    discard,
    mark,
    staging_folder,
)
from tests.models import build_model, char_tokenizer_folder

ROOT = Path(__file__).resolve().parents[1]


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"m{seed}"
        build_model(tiny_configs()["gpt2"], seed=seed, dtype=torch.float32).save_pretrained(folder)
        char_tokenizer_folder(folder, tiny_configs()["gpt2"].vocab_size)
        folders.append(folder)
    return folders[0], folders[1]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _debris(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if any(f".{kind}-" in p.name for kind in ("tmp", "old", "new")))


def test_an_output_that_is_contains_or_lies_inside_an_input_is_refused_and_the_inputs_stay(
    tmp_path, capsys, monkeypatch
):
    a, b = _pair(tmp_path)
    before = {folder: _snapshot(folder) for folder in (a, b)}
    capsys.readouterr()  # what saving the pair printed
    monkeypatch.chdir(tmp_path)
    for output in (str(b), "./m1/", "m1/.", str(tmp_path), str(a / "merged")):
        assert main(["merge", str(a), "m1", "-o", output, "--overwrite"]) == 2, output
        err = capsys.readouterr().err
        assert err.startswith("hf-lmc: error: --output") and err.count("\n") == 1, err
    link = tmp_path / "link"
    link.symlink_to(b, target_is_directory=True)  # the same folder under another name
    assert main(["merge", str(a), str(b), "-o", str(link), "--overwrite"]) == 2
    assert {folder: _snapshot(folder) for folder in (a, b)} == before
    with pytest.raises(ValueError, match="output"):  # the Python API names its parameter
        hf_lmc.merge(a, b, b, overwrite=True, progress=False)


def test_a_recipe_writing_over_an_input_is_refused(tmp_path, capsys):
    a, b = _pair(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"models": [str(a), str(b)], "output": {"dir": str(b), "overwrite": True}}))
    before = _snapshot(b)
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    assert "output.dir" in capsys.readouterr().err and _snapshot(b) == before


def test_of_two_writers_to_one_output_without_overwrite_the_second_fails_and_the_first_stays(tmp_path, monkeypatch):
    """The existence check at the start is repeated by the final rename itself: a run that
    finds the folder written meanwhile says so and leaves it as it is."""
    out = tmp_path / "out"
    real_finish = export._ShardWriter.finish

    def finish_after_another_run(writer):
        real_finish(writer)
        out.mkdir()
        (out / "other.txt").write_text("the other run's merge")

    monkeypatch.setattr(export._ShardWriter, "finish", finish_after_another_run)
    with pytest.raises(OutputExistsError, match="meanwhile"):
        save_canonical(hf_lmc.canonicalize(build_model(tiny_configs()["gpt2"])), out, progress=False)
    assert [p.name for p in out.iterdir()] == ["other.txt"] and not _debris(tmp_path)


def test_the_next_run_removes_dead_runs_debris_and_restores_a_set_aside_output(tmp_path):
    out = tmp_path / "out"
    (tmp_path / ".out.tmp-12-abcdefgh").mkdir()  # a staging folder of a killed run
    (tmp_path / ".out.old-12-defghijk" / "out").mkdir(parents=True)  # killed between the two renames of --overwrite
    (tmp_path / ".out.old-12-defghijk" / "out" / "model.txt").write_text("the previous merge")
    live = staging_folder(out)  # a run still writing: it holds the lock
    clean_stale(out)
    assert (out / "model.txt").read_text() == "the previous merge"
    assert _debris(tmp_path) == [live.name]
    discard(live)


def test_a_live_runs_debris_is_kept_whatever_its_pid_looks_like(tmp_path):
    """Liveness is the run's lock on its folder, not its PID: a PID from another PID namespace
    may look dead here (or belong to another process), and a dead run's PID may be reused."""
    out = tmp_path / "out"
    held = []
    for name in (".out.tmp-999999999-abcdefgh", ".out.old-999999999-bcdefghi"):  # no such PID here
        (tmp_path / name / "out").mkdir(parents=True)
        held.append(_try_lock(tmp_path / name))  # this process stands in for the live run
    (tmp_path / f".out.tmp-{os.getpid()}-cdefghij").mkdir()  # a live PID (ours), but no run holds it
    clean_stale(out)
    assert _debris(tmp_path) == [".out.old-999999999-bcdefghi", ".out.tmp-999999999-abcdefgh"] and not out.exists()
    for fd in held:  # the run ends (as a killed run's locks go with it)
        os.close(fd)
    clean_stale(out)
    assert not _debris(tmp_path) and out.is_dir()  # the set-aside folder went back: the output was missing


@pytest.mark.parametrize("name", ["m[1]", "a*b", "q?", "x]"])
def test_debris_of_an_output_named_with_glob_characters_is_found_by_exact_name(tmp_path, name):
    """Debris is matched by its exact prefix, never by a pattern built from the user's name: the
    set-aside folder of ``m[1]`` goes back, and ``m1``'s (which the glob ``m[1]`` matched) stays."""
    out = tmp_path / name
    (tmp_path / f".{name}.old-12-abcdefgh" / name).mkdir(parents=True)
    (tmp_path / f".{name}.old-12-abcdefgh" / name / "model.txt").write_text("the previous merge")
    (tmp_path / f".{name}.tmp-12-bcdefghi").mkdir()
    other = tmp_path / ".m1.old-12-cdefghij" / "m1"  # another output's set-aside folder (m1 is missing)
    other.mkdir(parents=True)
    clean_stale(out)
    assert (out / "model.txt").read_text() == "the previous merge"
    assert _debris(tmp_path) == [".m1.old-12-cdefghij"]
    clean_stale(tmp_path / "m1")
    assert (tmp_path / "m1").is_dir() and not _debris(tmp_path)


def _no_alignment(monkeypatch) -> None:
    from hf_lmc.merging import pipeline

    monkeypatch.setattr(
        pipeline, "align", lambda *args, **kwargs: pytest.fail("aligned before the outputs were checked")
    )


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error: ") and err.count("\n") == 1, err
    return err


def test_overwrite_replaces_only_a_folder_hf_lmc_wrote_and_names_what_else_is_in_it(tmp_path, capsys, monkeypatch):
    a, b = _pair(tmp_path)
    out = tmp_path / "out"
    (out / ".git").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "notes.md").write_text("the user's notes")
    theirs = _snapshot(out)
    merge = ["merge", str(a), str(b), "-o", str(out), "--device", "cpu", "--quiet"]
    capsys.readouterr()
    with monkeypatch.context() as patched:
        _no_alignment(patched)
        assert main([*merge, "--overwrite"]) == 2
        err = _one_error_line(capsys)
        assert err.startswith("hf-lmc: error: --output") and str(out) in err and ".git" in err and "notes.md" in err, (
            err
        )
    assert _snapshot(out) == theirs
    shutil.rmtree(out)
    assert main(merge) == 0
    assert "config.json" in json.loads((out / MARKER).read_text())["files"]
    (out / "mine.txt").write_text("added by the user")  # a marked folder with a file hf_lmc did not write
    capsys.readouterr()
    with monkeypatch.context() as patched:
        _no_alignment(patched)
        assert main([*merge, "--overwrite"]) == 2
        assert "mine.txt" in _one_error_line(capsys)
        (out / "eval.txt").write_text("abc abc\n" * 40)  # evaluation data inside the output: an input
        mark(out, "merge")  # even listed as hf_lmc's
        assert main([*merge, "--overwrite", "--eval-data", str(out / "eval.txt")]) == 2
        assert "contains the input" in _one_error_line(capsys)
    assert (out / "mine.txt").read_text() == "added by the user" and (out / "eval.txt").is_file()
    (out / "mine.txt").unlink()
    (out / "eval.txt").unlink()
    assert main([*merge, "--overwrite"]) == 0 and not _debris(tmp_path)


def test_an_input_under_another_path_is_refused_by_its_device_and_inode(tmp_path, monkeypatch):
    """A hard link, or a bind mount (stood in for by a link that path resolution does not see
    through, as it cannot see through a mount), is the same file or folder under another path."""
    from hf_lmc.config.options import ParameterError

    model, data = tmp_path / "model", tmp_path / "eval.txt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data.write_text("abc\n")
    out = tmp_path / "out"
    out.mkdir()
    os.link(data, out / "eval.txt")  # the evaluation data, hard-linked into the output
    with pytest.raises(ParameterError, match="contains the input"):
        check_apart(out, [data])
    alias = tmp_path / "mounted"
    alias.symlink_to(model, target_is_directory=True)
    monkeypatch.setattr(
        Path, "resolve", lambda self, strict=False: Path(os.path.abspath(self))
    )  # sees no link: a mount
    for output, where in ((alias, "is"), (alias / "merged", "lies inside"), (tmp_path / "elsewhere", None)):
        if where is None:
            check_apart(output, [model, data])
            continue
        with pytest.raises(ParameterError, match=where) as refused:
            check_apart(output, [model])
        assert str(model) in str(refused.value) and str(output) in str(refused.value)
    os.rename(model, tmp_path / "away")  # the input inside the output, under a name resolution cannot see
    (tmp_path / "wrapper").mkdir()
    (tmp_path / "wrapper" / "inner").symlink_to(tmp_path / "away", target_is_directory=True)
    with pytest.raises(ParameterError, match="contains"):
        check_apart(tmp_path / "wrapper", [tmp_path / "away"])


def test_what_can_be_checked_before_the_work_is_checked_before_it(tmp_path, capsys, monkeypatch):
    a, b = _pair(tmp_path)
    _no_alignment(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("years of work")
    merged = tmp_path / "merged"
    merged.mkdir()
    mark(merged, "merge")
    merge = ["merge", str(a), str(b), "--device", "cpu", "--quiet"]
    capsys.readouterr()
    for extra, flag, named in (
        (["-o", "."], "--output", "working folder"),
        (["-o", str(tmp_path)], "--output", "working folder"),
        (["-o", "x" * 240], "--output", "xxx…xxx"),  # its hidden staging siblings could not be named
        (["-o", "a-file", "--overwrite"], "--output", "a-file"),
        (["-o", "out", "--checkpoint-dir", "out"], "--checkpoint-dir", "out"),
        (["-o", "out", "--checkpoint-dir", "out/state"], "--checkpoint-dir", "out"),
        (["-o", "out", "--checkpoint-dir", str(b)], "--checkpoint-dir", str(b)),
        (["-o", "out", "--checkpoint-dir", str(theirs)], "--checkpoint-dir", "thesis.tex"),
        (["-o", "out", "--checkpoint-dir", str(merged)], "--checkpoint-dir", "merge"),
    ):
        assert main([*merge, *extra]) == 2, extra
        err = _one_error_line(capsys)
        assert err.startswith(f"hf-lmc: error: {flag}") and named in err, (extra, err)
    assert (theirs / "thesis.tex").read_text() == "years of work" and not (tmp_path / "out").exists()


def test_a_recipe_checks_its_run_folders_and_everything_it_reads_before_any_work(tmp_path, capsys, monkeypatch):
    a, b = _pair(tmp_path)
    _no_alignment(monkeypatch)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump({"sweep": [{"name": "summary.md", "models": [str(a), str(b)]}], "output": {"dir": "x"}})
    )
    capsys.readouterr()
    assert main(["recipe", "check", str(recipe)]) == 2  # its folder would be the summary's file
    assert "summary.md" in _one_error_line(capsys)
    for names, named in ((["Big", "big"], "'big'"), (["x" * 101, "y"], "sweep[0].name")):  # one folder; too long a name
        sweep = [{"name": name, "models": [str(a), str(b)]} for name in names]
        recipe.write_text(yaml.safe_dump({"sweep": sweep, "output": {"dir": "x"}}))
        assert main(["recipe", "check", str(recipe)]) == 2
        assert named in _one_error_line(capsys)
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval.txt").write_text("abc abc\n" * 40)
    inside = out / "r.yaml"
    for data in (
        {"files": [str(out / "eval.txt")]},
        None,
    ):  # the evaluation data, then the recipe itself, inside output.dir
        body = {"models": [str(a), str(b)], "output": {"dir": str(out), "overwrite": True}}
        if data is not None:
            body["eval"] = {"data": data}
        inside.write_text(yaml.safe_dump(body))
        mark(out, "recipe")  # even listed as hf_lmc's
        assert main(["run", str(inside)]) == 2
        assert "output.dir" in _one_error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "eval.txt", "r.yaml"])


def test_the_demo_replaces_only_a_folder_hf_lmc_wrote(tmp_path, monkeypatch):
    from hf_lmc.commands import demo

    monkeypatch.setattr(demo.zoo, "pair", lambda *args, **kwargs: pytest.fail("trained before the output was checked"))
    theirs = tmp_path / "hf-lmc-demo"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="notes.txt"):
        demo.run_demo(theirs, progress=False)
    legacy = tmp_path / "legacy"  # what an older demo wrote: its own record, no marker
    legacy.mkdir()
    for name in ("hf_lmc_demo.json", "config.json", "model.safetensors", "README.md", "loss_along_path.png"):
        (legacy / name).write_text("{}")
    check_replaceable(legacy, "output", kinds=demo.DEMO_KINDS)
    (legacy / "notes.txt").write_text("added by the user")
    with pytest.raises(OutputExistsError, match="notes.txt"):
        check_replaceable(legacy, "output")
    merged = tmp_path / "merged"  # a merge of the user's, written by hf_lmc: the demo has no --overwrite to ask for
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    mark(merged, "merge")
    with pytest.raises(OutputExistsError, match="merge"):
        demo.run_demo(merged, progress=False)
    assert (merged / "config.json").read_text() == "{}"


def test_a_refusal_names_a_folder_whose_name_holds_braces_or_is_very_long(tmp_path):
    """The message is a template whose ``{}`` the front end fills with its flag: a user's name
    must not be read as one, nor fill the line."""
    from hf_lmc.config.options import ParameterError

    folder = tmp_path / "run{0}"
    folder.mkdir()
    (folder / ("n" * 200 + "{x}")).write_text("mine")
    with pytest.raises(OutputExistsError) as refused:
        check_replaceable(folder, "output")
    assert (
        str(folder) in refused.value.named("--output") and "{x}" in str(refused.value) and len(str(refused.value)) < 500
    )
    with pytest.raises(ParameterError) as refused:
        check_apart(folder / "sub", [folder])
    assert refused.value.named("--output").startswith(f"--output {folder}")
    quoted = ParameterError("{} differs ({'height': 8} vs {0})", "size")  # a value quoted from a file, braces and all
    assert quoted.named("--size") == "--size differs ({'height': 8} vs {0})" and str(quoted).startswith("size differs")


def test_the_marker_is_not_pushed(tmp_path):
    from hf_lmc.io import hub

    class RecordingApi:
        def create_repo(self, repo_id, **kwargs):
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, **kwargs):
            self.kwargs = kwargs

    api = RecordingApi()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    mark(folder, "merge")
    hub.push_folder(folder, "me/m", api=api)
    assert MARKER in api.kwargs["ignore_patterns"]


def test_the_free_space_check_counts_a_tied_embedding_twice(tmp_path):
    """A tied embedding is stored once but may be written twice (untied by the export)."""
    from transformers import AutoConfig

    from hf_lmc.merging import pipeline

    folder = tmp_path / "m"
    build_model(tiny_configs()["gpt2"], dtype=torch.float32).save_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    assert config.tie_word_embeddings
    stored = (folder / "model.safetensors").stat().st_size
    embedding = config.vocab_size * config.hidden_size * 4
    assert pipeline._written_bytes([folder], [config], None) >= stored + embedding


class _Injected(Exception):
    """What a stand-in raises at the step under test."""


class _Faults:
    """Stand-ins for every file-system step of a write and swap (each rename, mkdir, rmdir,
    unlink, chmod, rmtree, file opened for writing, ``renameat2``), counting them and failing the
    ``at``-th one as ``mode`` says: an exception, Ctrl-C, a full disk before the step; SIGINT or
    SIGKILL (in a forked child) right after it."""

    STEPS = (
        (os, "rename"),
        (os, "replace"),
        (os, "mkdir"),
        (os, "rmdir"),
        (os, "unlink"),
        (os, "chmod"),
        (shutil, "rmtree"),
        (outputs, "_rename2"),
        (builtins, "open"),
        (io, "open"),
    )

    def __init__(self, monkeypatch):
        self.count, self.at, self.mode = 0, None, None
        for owner, name in self.STEPS:
            monkeypatch.setattr(owner, name, self._stand_in(getattr(owner, name), name == "open"))

    def _stand_in(self, real, opens):
        def step(*args, **kwargs):
            mode = kwargs.get("mode", args[1] if len(args) > 1 else "r")
            if opens and not any(c in str(mode) for c in "wax+"):  # reading changes nothing
                return real(*args, **kwargs)
            self.count += 1
            if self.count == self.at and self.mode in ("error", "interrupt", "full"):
                raise {
                    "error": _Injected("injected"),
                    "interrupt": KeyboardInterrupt(),
                    "full": OSError(errno.ENOSPC, "No space left on device"),
                }[self.mode]
            result = real(*args, **kwargs)
            if self.count == self.at and self.mode == "signal":
                signal.raise_signal(signal.SIGINT)
            if self.count == self.at and self.mode == "kill":
                os._exit(137)
            return result

        return step

    def arm(self, at, mode):
        self.count, self.at, self.mode = 0, at, mode


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["new", "exchange", "two-renames"])
def test_a_fault_at_any_step_of_the_write_and_swap_leaves_a_whole_output_and_the_inputs_as_they_were(
    tmp_path, monkeypatch, scenario
):
    """Fault injection over every step of ``write_checkpoint`` and ``move_into_place``: after
    each fault (and the next run's tidying), the output is the whole old folder or the whole new
    one, no input changed, and no debris is left. ``new``: a first write; ``exchange`` and
    ``two-renames``: ``--overwrite`` of a folder a merge wrote, swapped atomically or (where
    ``renameat2`` is missing) by two renames."""
    from transformers import GPT2Config

    config = GPT2Config(n_embd=4, n_layer=1, n_head=1, vocab_size=6, n_positions=8)
    source = char_tokenizer_folder(tmp_path / "source", 6)
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"not really a png")
    inputs = {"source": _snapshot(source), "plot": plot.read_bytes()}
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"

    def write(value: float, target: Path = out) -> None:
        groups = [
            {"transformer.wte.weight": torch.full((6, 4), value)},
            {"transformer.h.0.ln_1.weight": torch.full((4,), value)},
        ]
        write_checkpoint(
            groups,
            config,
            target,
            shard_size=64,
            source_folder=source,
            extra_files={"plot.png": plot},
            overwrite=scenario != "new",
            progress=False,
        )

    write(1.0, tmp_path / "old")
    write(2.0, tmp_path / "new")
    old, new = _snapshot(tmp_path / "old"), _snapshot(tmp_path / "new")
    if scenario == "two-renames":
        monkeypatch.setattr(outputs, "_renameat2", None)

    def reset():
        shutil.rmtree(out, ignore_errors=True)
        if scenario != "new":
            shutil.copytree(tmp_path / "old", out)

    faults = _Faults(monkeypatch)
    reset()
    faults.arm(None, None)
    write(2.0)
    steps = faults.count
    assert steps > 20  # the walk covers the whole write
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for mode in ("error", "interrupt", "full", "signal", "kill"):
            for at in range(1, steps + 1):
                reset()
                faults.arm(at, mode)
                if mode == "kill":
                    child = os.fork()
                    if child == 0:  # the run, killed right after step ``at``
                        try:
                            write(2.0)
                        finally:
                            os._exit(0)
                    os.waitpid(child, 0)
                else:
                    with contextlib.suppress(_Injected, KeyboardInterrupt, OSError):
                        write(2.0)
                faults.arm(None, None)
                where = f"{mode} at step {at} of {steps}"
                clean_stale(out)  # what the next run does first
                whole = _snapshot(out) if out.exists() else None
                assert whole in ((old, new) if scenario != "new" else (None, new)), where
                assert {"source": _snapshot(source), "plot": plot.read_bytes()} == inputs, where
                assert not _debris(work), (where, _debris(work))
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_a_merge_killed_during_export_leaves_no_output_and_the_next_run_no_debris(tmp_path):
    """Fault injection: the merge's process dies by SIGKILL with one shard written."""
    a, b = _pair(tmp_path)
    out = tmp_path / "out"
    killed = _run_dying(a, b, out, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists() and _debris(tmp_path)  # what the dead run left
    assert main(["merge", str(a), str(b), "-o", str(out), "--device", "cpu"]) == 0
    assert (out / "config.json").is_file() and not _debris(tmp_path)


@pytest.mark.slow
def test_sigterm_cleans_up_as_ctrl_c_does(tmp_path):
    a, b = _pair(tmp_path)
    out = tmp_path / "out"
    terminated = _run_dying(a, b, out, signal.SIGTERM)
    assert terminated.returncode == 128 + signal.SIGTERM, terminated.stderr
    assert not out.exists() and not _debris(tmp_path)


def _run_dying(a: Path, b: Path, out: Path, signum: int) -> subprocess.CompletedProcess:
    """``hf-lmc merge`` in a child that sends itself ``signum`` once the first shard is on disk."""
    script = textwrap.dedent(f"""
        import os, hf_lmc.io.export as export
        from hf_lmc.cli import main
        real_flush = export._ShardWriter.flush
        def flush(writer):
            real_flush(writer)
            os.kill(os.getpid(), {int(signum)})
        export._ShardWriter.flush = flush
        raise SystemExit(main(["merge", {str(a)!r}, {str(b)!r}, "-o", {str(out)!r}, "--shard-size", "2KB", "--device", "cpu"]))
    """)
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
        check=False,
    )


def _dead_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(child.stdout)


@pytest.mark.slow  # subprocesses that import torch
def test_a_folder_that_needs_custom_code_is_refused_without_running_it_or_asking(tmp_path):
    """transformers asks on stdin whether to run a folder's code for an unknown model type with an
    ``auto_map``; hf_lmc passes ``trust_remote_code=False`` everywhere, so nothing asks and the
    folder's code never runs, even with a "y" waiting on stdin."""
    a, _ = _pair(tmp_path)
    custom = tmp_path / "custom"
    custom.mkdir()
    marker = tmp_path / "code-ran"
    (custom / "configuration_custom.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\nclass CustomConfig(PretrainedConfig):\n    model_type = 'custom_lmc'\n"
    )
    (custom / "config.json").write_text(
        '{"model_type": "custom_lmc", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}'
    )
    for args in (["merge", str(a), str(custom), "-o", str(tmp_path / "out")], ["symmetries", str(custom)]):
        run = subprocess.run(
            [sys.executable, "-m", "hf_lmc", *args],
            cwd=ROOT,
            input="y\ny\n",
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert run.returncode == 1, run.stderr  # the input cannot be used: a failed run
        assert "custom code" in run.stderr and "[y/N]" not in run.stdout + run.stderr and "Traceback" not in run.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["average", "weight"])
def test_a_weight_beyond_the_written_dtype_is_refused_by_name_and_nothing_is_written(tmp_path, capsys, method):
    """Inputs are finite, but 1e6 is beyond float16: the written tensors are checked after the cast."""
    a, b = _pair(tmp_path)
    for folder in (a, b):
        model = type(build_model(tiny_configs()["gpt2"])).from_pretrained(folder)
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, 0] = 1e6
        model.save_pretrained(folder)
    capsys.readouterr()
    assert (
        main(
            [
                "merge",
                str(a),
                str(b),
                "-o",
                str(tmp_path / "out"),
                "--method",
                method,
                "--dtype",
                "float16",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # below the progress bars
    assert (
        len(errors) == 1 and "h.0.mlp.c_fc.weight" in errors[0] and "float16" in errors[0] and "--dtype" in errors[0]
    ), errors
    assert not (tmp_path / "out").exists() and not _debris(tmp_path)
    assert (
        main(
            [
                "merge",
                str(a),
                str(b),
                "-o",
                str(tmp_path / "out"),
                "--method",
                method,
                "--dtype",
                "bfloat16",
                "--device",
                "cpu",
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    "arch, change",
    [
        ("gpt2", {"activation_function": "relu"}),
        ("gpt2", {"scale_attn_weights": False}),
        ("gpt_neox", {"use_parallel_residual": False}),
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
        ("gpt2", {"n_positions": 8}),  # another context length: weight matching failed on a matmul
        ("vit", {"image_size": 16}),  # another image size (another number of patches)
    ],
)
def test_models_whose_settings_change_the_function_are_refused_with_the_setting_named(tmp_path, capsys, arch, change):
    """Same shapes, another function: merged under A's config, B's part would compute something
    else (the issue measured a relative logit error up to 0.44 at alpha = 1)."""
    config = tiny_configs()[arch]
    if arch == "gpt2":
        config.scale_attn_weights = True
    if arch == "gpt_neox":
        config.use_parallel_residual = True
    other = type(config).from_dict({**config.to_dict(), **change})
    a, b = tmp_path / "a", tmp_path / "b"
    build_model(config, dtype=torch.float32).save_pretrained(a)
    build_model(other, seed=1, dtype=torch.float32).save_pretrained(b)
    capsys.readouterr()
    for method in ("weight", "average"):
        assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--method", method, "--device", "cpu"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and next(iter(change)) in err, err
    assert not (tmp_path / "out").exists()


def test_the_merge_keeps_a_generation_config_and_gets_the_umask_permissions(tmp_path):
    """A's ``generation_config.json`` (its eos ids, its sampling settings) is kept rather than
    rebuilt from config.json, and the folder is as open as ``save_pretrained``'s would be."""
    from transformers import GenerationConfig

    a, b = _pair(tmp_path)
    for folder in (a, b):  # one generation config: one that differs in its eos ids is refused (tests/test_inherited.py)
        GenerationConfig(eos_token_id=[0, 3], do_sample=True, top_p=0.9, max_new_tokens=7).save_pretrained(folder)
    out = tmp_path / "out"
    hf_lmc.merge(a, b, out, device="cpu", progress=False)
    kept = GenerationConfig.from_pretrained(out)
    assert (kept.eos_token_id, kept.do_sample, kept.top_p, kept.max_new_tokens) == ([0, 3], True, 0.9, 7)
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_shard_size_in_bare_bytes_unit_is_refused_when_parsed(capsys):
    """``5B`` reads as five billion to mergekit users; here it would be five bytes (29 shards)."""
    assert main(["merge", "./no/such/a", "./no/such/b", "-o", "out", "--shard-size", "5B"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error: --shard-size") and "5GB" in err and err.count("\n") == 1


@pytest.mark.slow  # subprocesses that import torch
def test_quiet_and_tqdm_disable_silence_every_progress_bar(tmp_path):
    """hf_lmc's bars once passed ``disable=False`` explicitly, which overrides TQDM_DISABLE."""
    a, b = _pair(tmp_path)
    for extra, env in ((["--quiet"], {}), ([], {"TQDM_DISABLE": "1"})):
        out = tmp_path / f"out{len(extra)}"
        run = subprocess.run(
            [sys.executable, "-m", "hf_lmc", "merge", str(a), str(b), "-o", str(out), "--device", "cpu", *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=300,
            check=False,
        )
        assert run.returncode == 0 and "it/s" not in run.stderr and "%|" not in run.stderr, run.stderr
        assert f"merged model written to {out}" in run.stdout
    loud = subprocess.run(
        [sys.executable, "-m", "hf_lmc", "merge", str(a), str(b), "-o", str(tmp_path / "loud"), "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"},
        timeout=300,
        check=False,
    )
    assert loud.returncode == 0 and "%|" in loud.stderr  # the bars are there to silence


@pytest.mark.parametrize("has_safetensors", [True, False])
def test_a_hub_model_is_downloaded_in_one_weight_format_with_its_card(tmp_path, monkeypatch, has_safetensors):
    """At the network boundary only: a recording stand-in for ``snapshot_download``. The config,
    tokenizer and card come first, weightless (a revision without config.json is refused before
    any weight: tests/test_hub_repos.py); then model.safetensors, and only a repo without it gets
    its PyTorch pickle asked for (the files transformers reads: hf_lmc.io.weights,
    tests/test_checkpoints.py)."""
    from hf_lmc.io import hub

    calls = []

    def snapshot_download(repo_id, *, revision, allow_patterns, ignore_patterns):
        calls.append(allow_patterns)
        folder = tmp_path / "snapshot"
        folder.mkdir(exist_ok=True)
        for name in ("config.json", "model.safetensors" if has_safetensors else "pytorch_model.bin"):
            if name in allow_patterns or (name.endswith(".json") and "*.json" in allow_patterns):
                (folder / name).write_bytes(b"{}" if name.endswith(".json") else b"")
        assert "trainer_state.json" in ignore_patterns and "training_args.bin" in ignore_patterns
        return str(folder)

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    hub.resolve_checkpoint("org/model", "main")
    assert "README.md" in calls[0] and not any("safetensors" in p or p.endswith(".bin") for p in calls[0])
    assert calls[1] == ["model.safetensors"]
    if has_safetensors:  # no pickles
        assert len(calls) == 2
    else:  # only then the PyTorch pickle
        assert len(calls) == 3 and calls[2] == ["pytorch_model.bin"]


def _rewrite_header(file: Path, change) -> None:
    """Rewrite a safetensors file's JSON header with ``change(header)`` (the data stays)."""
    import json

    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = change(json.loads(raw[8 : 8 + length]))
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda h: list(h), "header"),
        (
            lambda h: {**h, _first_tensor(h): {k: v for k, v in h[_first_tensor(h)].items() if k != "data_offsets"}},
            "malformed",
        ),
        (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "shape": [10**6, 10]}}, "bytes"),
        (
            lambda h: {
                **h,
                _first_tensor(h): {**h[_first_tensor(h)], "data_offsets": h[_first_tensor(h)]["data_offsets"][::-1]},
            },
            "bytes",
        ),
        (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "dtype": "F8_E4M3"}}, "F8_E4M3"),
    ],
)
def test_a_damaged_safetensors_header_is_one_line_naming_the_file(tmp_path, capsys, damage, named):
    a, b = _pair(tmp_path)
    _rewrite_header(b / "model.safetensors", damage)
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--device", "cpu"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "model.safetensors" in errors[0] and named in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_a_failed_push_keeps_the_merge_and_says_how_to_push_it(tmp_path, capsys, monkeypatch):
    from hf_lmc.io import hub

    class OfflineApi:  # online for the check before the merge (hub.check_push), gone by the push
        token = "hf_test_token"

        def whoami(self, *args, **kwargs):
            return {"name": "me", "orgs": []}

        def create_repo(self, repo_id, **kwargs):
            raise ConnectionError("[Errno -3] Temporary failure in name resolution\nand a long traceback's worth")

    monkeypatch.setattr(hub, "HfApi", OfflineApi)
    a, b = _pair(tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()
    assert (
        main(["merge", str(a), str(b), "-o", str(out), "--device", "cpu", "--push-to-hub", "me/merged", "--quiet"]) == 1
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"hf upload me/merged {out}" in errors[0] and "ConnectionError" in errors[0], errors
    assert (out / "model.safetensors").is_file()  # kept


def test_a_hub_id_may_carry_its_revision(tmp_path, monkeypatch):
    """``org/model@rev``, as mergekit accepts it; a second, different revision is refused."""
    from hf_lmc.io import hub

    calls = []

    def snapshot_download(repo_id, *, revision, allow_patterns, ignore_patterns):
        calls.append((repo_id, revision))
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "model.safetensors").write_bytes(b"")
        return str(tmp_path)

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    hub.resolve_checkpoint("org/model@v1.0")
    hub.resolve_checkpoint("org/model@v1.0", "v1.0")
    assert set(calls) == {("org/model", "v1.0")}
    with pytest.raises(ValueError, match="v1.0"):
        hub.resolve_checkpoint("org/model@v1.0", "main")


def test_text_data_for_a_model_without_tokenizer_files_is_one_line(tmp_path, capsys):
    """transformers 5 returns an empty tokenizer for such a folder, and the batches came out empty."""
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, seed in ((a, 0), (b, 1)):
        build_model(tiny_configs()["gpt2"], seed=seed, dtype=torch.float32).save_pretrained(folder)  # no tokenizer
    (tmp_path / "eval.txt").write_text("abc abc abc\n" * 50)
    capsys.readouterr()
    assert (
        main(
            [
                "merge",
                str(a),
                str(b),
                "-o",
                str(tmp_path / "out"),
                "--eval-data",
                str(tmp_path / "eval.txt"),
                "--device",
                "cpu",
            ]
        )
        == 1
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "tokenizer" in errors[0] and str(a) in errors[0], errors
    assert not (tmp_path / "out").exists()


def _bin_folder(folder: Path, seed: int, legacy: bool) -> Path:
    """A tiny GPT-2 saved as ``pytorch_model.bin``, in PyTorch's zip format or its legacy one."""
    model = build_model(tiny_configs()["gpt2"], seed=seed, dtype=torch.float32)
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    return folder


def test_old_format_bin_checkpoints_merge_and_a_pickle_of_other_objects_is_named_not_corrupt(tmp_path, capsys):
    a, b = _bin_folder(tmp_path / "a", 0, legacy=True), _bin_folder(tmp_path / "b", 1, legacy=False)
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--device", "cpu", "--quiet"]) == 0
    marker = tmp_path / "code-ran"
    state = torch.load(b / "pytorch_model.bin", weights_only=True)
    state["extra"] = _RunsCode(str(marker))
    torch.save(state, b / "pytorch_model.bin")
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out2"), "--device", "cpu", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "other than tensors" in err and "corrupt" not in err, err
    assert not marker.exists()


class _RunsCode:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, ("ran",))


def test_a_malformed_pt_image_file_is_one_line(tmp_path, capsys):
    folder = tmp_path / "vit"
    build_model(tiny_configs()["vit"], dtype=torch.float32).save_pretrained(folder)
    bad = tmp_path / "images.pt"
    bad.write_bytes(b"not a torch file at all")
    capsys.readouterr()
    assert main(["barrier", str(folder), str(folder), "--eval-data", str(bad), "--quiet"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "images.pt" in errors[0], errors


def test_the_card_names_hub_models_with_their_commit_and_records_barrier_version_and_command(
    tmp_path, monkeypatch, capsys
):
    """``base_model`` holds Hub ids only (a local model is described in the body), each Hub
    model's commit is in the body, the barrier on local data is in the body alone, and the hf_lmc
    version and the exact command are in the card."""
    from huggingface_hub import ModelCard

    from hf_lmc.io import hub

    a, b = _pair(tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "cache" / "models--org--model-b" / "snapshots" / commit
    snapshot.parent.mkdir(parents=True)
    b.rename(snapshot)
    monkeypatch.setattr(
        hub, "snapshot_download", lambda repo_id, *, revision, allow_patterns, ignore_patterns: str(snapshot)
    )
    (tmp_path / "eval.txt").write_text("abc ab. ca\n" * 40)
    out = tmp_path / "out"
    argv = [
        "merge",
        str(a),
        "org/model-b@v1",
        "-o",
        str(out),
        "--device",
        "cpu",
        "--eval-data",
        str(tmp_path / "eval.txt"),
        "--seq-len",
        "8",
        "--alphas",
        "3",
        "--quiet",
    ]
    assert main(argv) == 0
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == ["org/model-b"] and data["base_model_relation"] == "merge"
    described = card.text.split("## How to use")[0]
    assert f"`{a.name}` (a local model)" in described and str(tmp_path) not in described
    assert f"(https://huggingface.co/org/model-b) at revision `{commit}`" in card.text
    # local evaluation data: named in the body, with no model-index dataset for the Hub to link (tests/test_cards.py)
    assert "model-index" not in data and "Measured on `eval.txt` (local data" in card.text
    assert re.search(r"^\| weight \|", card.text, re.MULTILINE)
    assert f"`hf-lmc` {hf_lmc.__version__}" in card.text
    # the command as typed, local paths by their final component (the Hub id as given)
    assert (
        "hf-lmc merge m0 org/model-b@v1 -o out --device cpu --eval-data eval.txt --seq-len 8 --alphas 3 --quiet"
        in card.text
    )
    assert str(tmp_path) not in card.text


def test_a_python_merge_records_its_settings_and_a_license_conflict_is_a_warning(tmp_path, caplog):
    from huggingface_hub import ModelCard

    from hf_lmc import merge

    a, b = _pair(tmp_path)
    (a / "README.md").write_text("---\nlicense: mit\n---\n# A\n")
    (b / "README.md").write_text("---\nlicense: apache-2.0\n---\n# B\n")
    with caplog.at_level("WARNING", logger="hf_lmc"):
        merge(a, b, tmp_path / "out", alpha=0.25, device="cpu", progress=False)
    assert any("licenses differ" in r.getMessage() for r in caplog.records)
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "license" not in card.data.to_dict()
    assert '"weights": [\n    0.75,\n    0.25\n  ]' in card.text and '"device": "cpu"' in card.text


def test_verbose_says_what_each_stage_does_and_is_silent_by_default(tmp_path, capsys):
    a, b = _pair(tmp_path)
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "quiet"), "--device", "cpu", "-q"]) == 0
    assert "hf-lmc:" not in capsys.readouterr().err
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "loud"), "--device", "cpu", "-q", "-v"]) == 0
    err = capsys.readouterr().err
    assert all(f"hf-lmc: {stage}" in err for stage in ("A: ", "B: ", "aligning 2 models: weight", "writing ")), err
    assert "%|" not in err  # -q -v: a log without bars


def test_an_unwritable_output_fails_before_any_alignment(tmp_path, capsys, monkeypatch):
    """A read-only parent folder is reported before alignment, naming the folder. (The suite may
    run as root, who writes anywhere, so the permission answer is stood in for.)"""
    from hf_lmc.merging import pipeline

    a, b = _pair(tmp_path)
    monkeypatch.setattr(pipeline, "align", lambda *args, **kwargs: pytest.fail("aligned before the output was checked"))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    real_access = os.access
    monkeypatch.setattr(
        export.os, "access", lambda path, mode: False if Path(path) == locked else real_access(path, mode)
    )
    try:
        capsys.readouterr()
        assert main(["merge", str(a), str(b), "-o", str(locked / "deep" / "out"), "--device", "cpu"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not writable" in err and str(locked) in err, err
    finally:
        locked.chmod(0o700)


def test_a_disk_without_room_for_the_merge_fails_before_any_alignment(tmp_path, capsys, monkeypatch):
    import shutil

    from hf_lmc.merging import pipeline

    a, b = _pair(tmp_path)
    monkeypatch.setattr(pipeline, "align", lambda *args, **kwargs: pytest.fail("aligned before the disk was checked"))
    monkeypatch.setattr(export.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--device", "cpu", "--dtype", "float16"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GB free" in err, err
    assert not (tmp_path / "out").exists() and not _debris(tmp_path)
