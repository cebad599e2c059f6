"""No input is lost and no output is half-written, however the output is spelled or the run ends:
an output that is, contains or lies inside an input is refused; concurrent writers cannot both
succeed; runs killed by SIGKILL leave debris that the next run removes; SIGTERM cleans up as
Ctrl-C does; an interrupted ``--overwrite`` never loses the old folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

import hf_lmc
import hf_lmc.export as export
from hf_lmc.cli import main
from hf_lmc.export import clean_stale, move_into_place, save_canonical, staging_folder
from hf_lmc.options import OutputExistsError
from hf_lmc.verify import tiny_configs
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
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_an_output_that_is_contains_or_lies_inside_an_input_is_refused_and_the_inputs_stay(tmp_path, capsys, monkeypatch):
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


def test_an_interrupted_overwrite_gets_its_old_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("the previous merge")
    staging = staging_folder(out)
    real_rename = Path.rename

    def failing_second_rename(self, target):
        if self == staging:
            raise OSError("disk gone")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_second_rename)
    with pytest.raises(OSError, match="disk gone"):
        move_into_place(staging, out, overwrite=True)
    assert (out / "old.txt").read_text() == "the previous merge" and _debris(tmp_path) == [staging.name]


def test_the_next_run_removes_dead_runs_debris_and_restores_a_set_aside_output(tmp_path):
    dead = _dead_pid()
    out = tmp_path / "out"
    (tmp_path / f".out.tmp-{dead}-abc").mkdir()  # a staging folder of a killed run
    (tmp_path / f".out.old-{dead}-def" / "out").mkdir(parents=True)  # killed between the two renames of --overwrite
    (tmp_path / f".out.old-{dead}-def" / "out" / "model.txt").write_text("the previous merge")
    live = tmp_path / f".out.tmp-{os.getpid()}-ghi"  # a run still writing
    live.mkdir()
    clean_stale(out)
    assert (out / "model.txt").read_text() == "the previous merge"
    assert _debris(tmp_path) == [live.name]


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
        import os, hf_lmc.export as export
        from hf_lmc.cli import main
        real_flush = export._ShardWriter.flush
        def flush(writer):
            real_flush(writer)
            os.kill(os.getpid(), {int(signum)})
        export._ShardWriter.flush = flush
        raise SystemExit(main(["merge", {str(a)!r}, {str(b)!r}, "-o", {str(out)!r}, "--shard-size", "2KB", "--device", "cpu"]))
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
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
        run = subprocess.run([sys.executable, "-m", "hf_lmc", *args], cwd=ROOT, input="y\ny\n", capture_output=True, text=True, timeout=300)
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
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--method", method, "--dtype", "float16", "--device", "cpu"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # below the progress bars
    assert len(errors) == 1 and "h.0.mlp.c_fc.weight" in errors[0] and "float16" in errors[0] and "--dtype" in errors[0], errors
    assert not (tmp_path / "out").exists() and not _debris(tmp_path)
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--method", method, "--dtype", "bfloat16", "--device", "cpu"]) == 0


@pytest.mark.parametrize("arch, change", [
    ("gpt2", {"activation_function": "relu"}),
    ("gpt2", {"scale_attn_weights": False}),
    ("gpt_neox", {"use_parallel_residual": False}),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    ("gpt2", {"n_positions": 8}),  # another context length: weight matching failed on a matmul
    ("vit", {"image_size": 16}),  # another image size (another number of patches)
])
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
    GenerationConfig(eos_token_id=[0, 3], do_sample=True, top_p=0.9, max_new_tokens=7).save_pretrained(a)
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
            cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
        )
        assert run.returncode == 0 and "it/s" not in run.stderr and "%|" not in run.stderr, run.stderr
        assert f"merged model written to {out}" in run.stdout
    loud = subprocess.run([sys.executable, "-m", "hf_lmc", "merge", str(a), str(b), "-o", str(tmp_path / "loud"), "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}, timeout=300)
    assert loud.returncode == 0 and "%|" in loud.stderr  # the bars are there to silence


@pytest.mark.parametrize("has_safetensors", [True, False])
def test_a_hub_model_is_downloaded_in_one_weight_format_with_its_card(tmp_path, monkeypatch, has_safetensors):
    """At the network boundary only: a recording stand-in for ``snapshot_download``."""
    import hf_lmc.hub as hub

    calls = []

    def snapshot_download(repo_id, *, revision, allow_patterns, ignore_patterns):
        calls.append(allow_patterns)
        folder = tmp_path / "snapshot"
        folder.mkdir(exist_ok=True)
        if has_safetensors and "*.safetensors" in allow_patterns:
            (folder / "model.safetensors").write_bytes(b"")
        assert "trainer_state.json" in ignore_patterns and "training_args.bin" in ignore_patterns
        return str(folder)

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    hub.resolve_checkpoint("org/model", "main")
    assert all("README.md" in patterns for patterns in calls)
    if has_safetensors:  # one call, no pickles
        assert len(calls) == 1 and not any(p.endswith(".bin") for p in calls[0])
    else:  # only then the PyTorch pickles
        assert len(calls) == 2 and "pytorch_model*.bin" in calls[1] and "*.safetensors" not in calls[1]


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


@pytest.mark.parametrize("damage, named", [
    (lambda h: list(h), "header"),
    (lambda h: {**h, _first_tensor(h): {k: v for k, v in h[_first_tensor(h)].items() if k != "data_offsets"}}, "malformed"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "shape": [10**6, 10]}}, "bytes"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "data_offsets": h[_first_tensor(h)]["data_offsets"][::-1]}}, "bytes"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "dtype": "F8_E4M3"}}, "F8_E4M3"),
])
def test_a_damaged_safetensors_header_is_one_line_naming_the_file(tmp_path, capsys, damage, named):
    a, b = _pair(tmp_path)
    _rewrite_header(b / "model.safetensors", damage)
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--device", "cpu"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "model.safetensors" in errors[0] and named in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_a_failed_push_keeps_the_merge_and_says_how_to_push_it(tmp_path, capsys, monkeypatch):
    import hf_lmc.hub as hub

    class OfflineApi:
        def create_repo(self, repo_id, **kwargs):
            raise ConnectionError("[Errno -3] Temporary failure in name resolution\nand a long traceback's worth")

    monkeypatch.setattr(hub, "HfApi", OfflineApi)
    a, b = _pair(tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "-o", str(out), "--device", "cpu", "--push-to-hub", "me/merged", "--quiet"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"hf upload me/merged {out}" in errors[0] and "ConnectionError" in errors[0], errors
    assert (out / "model.safetensors").is_file()  # kept


def test_a_hub_id_may_carry_its_revision(tmp_path, monkeypatch):
    """``org/model@rev``, as mergekit accepts it; a second, different revision is refused."""
    import hf_lmc.hub as hub

    calls = []

    def snapshot_download(repo_id, *, revision, allow_patterns, ignore_patterns):
        calls.append((repo_id, revision))
        (tmp_path / "model.safetensors").write_bytes(b"")
        return str(tmp_path)

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    hub.resolve_checkpoint("org/model@v1.0")
    hub.resolve_checkpoint("org/model@v1.0", "v1.0")
    assert calls == [("org/model", "v1.0")] * 2
    with pytest.raises(ValueError, match="v1.0"):
        hub.resolve_checkpoint("org/model@v1.0", "main")


def test_text_data_for_a_model_without_tokenizer_files_is_one_line(tmp_path, capsys):
    """transformers 5 returns an empty tokenizer for such a folder, and the batches came out empty."""
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, seed in ((a, 0), (b, 1)):
        build_model(tiny_configs()["gpt2"], seed=seed, dtype=torch.float32).save_pretrained(folder)  # no tokenizer
    (tmp_path / "eval.txt").write_text("abc abc abc\n" * 50)
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--eval-data", str(tmp_path / "eval.txt"), "--device", "cpu"]) == 1
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


def test_the_card_names_hub_models_with_their_commit_and_records_barrier_version_and_command(tmp_path, monkeypatch, capsys):
    """``base_model`` holds Hub ids only (a local model is described in the body), each Hub
    model's commit is in the body, the barrier is ``model-index`` metadata, and the hf_lmc
    version and the exact command are in the card."""
    import hf_lmc.hub as hub
    from huggingface_hub import ModelCard

    a, b = _pair(tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "cache" / "models--org--model-b" / "snapshots" / commit
    snapshot.parent.mkdir(parents=True)
    b.rename(snapshot)
    monkeypatch.setattr(hub, "snapshot_download", lambda repo_id, *, revision, allow_patterns, ignore_patterns: str(snapshot))
    (tmp_path / "eval.txt").write_text("abc ab. ca\n" * 40)
    out = tmp_path / "out"
    argv = ["merge", str(a), "org/model-b@v1", "-o", str(out), "--device", "cpu", "--eval-data", str(tmp_path / "eval.txt"),
            "--seq-len", "8", "--alphas", "3", "--quiet"]
    assert main(argv) == 0
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == ["org/model-b"] and data["base_model_relation"] == "merge"
    described = card.text.split("## How to use")[0]
    assert f"`{a.name}` (a local model)" in described and str(tmp_path) not in described
    assert f"(https://huggingface.co/org/model-b) at revision `{commit}`" in card.text
    results = data["model-index"][0]["results"][0]
    assert results["dataset"] == {"name": "eval.txt", "type": "local"}
    metrics = {m["name"]: m["value"] for m in results["metrics"]}
    assert set(metrics) == {"loss barrier, average (nats)", "loss barrier, weight (nats)"} and all(isinstance(v, float) for v in metrics.values())
    assert f"`hf-lmc` {hf_lmc.__version__}" in card.text
    assert "hf-lmc " + " ".join(argv) in card.text  # the exact command (no argument here needs quoting)


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
    import hf_lmc.pipeline as pipeline

    a, b = _pair(tmp_path)
    monkeypatch.setattr(pipeline, "align", lambda *args, **kwargs: pytest.fail("aligned before the output was checked"))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    real_access = os.access
    monkeypatch.setattr(export.os, "access", lambda path, mode: False if Path(path) == locked else real_access(path, mode))
    try:
        capsys.readouterr()
        assert main(["merge", str(a), str(b), "-o", str(locked / "deep" / "out"), "--device", "cpu"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not writable" in err and str(locked) in err, err
    finally:
        locked.chmod(0o700)


def test_a_disk_without_room_for_the_merge_fails_before_any_alignment(tmp_path, capsys, monkeypatch):
    import shutil

    import hf_lmc.pipeline as pipeline

    a, b = _pair(tmp_path)
    monkeypatch.setattr(pipeline, "align", lambda *args, **kwargs: pytest.fail("aligned before the disk was checked"))
    monkeypatch.setattr(export.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--device", "cpu", "--dtype", "float16"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GB free" in err, err
    assert not (tmp_path / "out").exists() and not _debris(tmp_path)
