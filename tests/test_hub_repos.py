"""Hub repositories as they really are: PolyPythia-style revisions (``main`` holds only
``.gitattributes``, the checkpoints live on ``step…`` branches), served over HTTP by a real
self-hosted Hub mirror (olah, serving local git repositories offline) and read again from the Hub
cache offline; and the mission's command verbatim, ``hf-lmc merge org/model-a org/model-b
--push-to-hub``, with a stand-in for ``HfApi`` only at the network boundary."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub import HfApi
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hf_lmc.cli import main
from hf_lmc.config.options import MergeRequest, default_output
from hf_lmc.config.recipe import load_recipe
from hf_lmc.io import hub
from hf_lmc.merging import pipeline
from tests.models import build_model, char_tokenizer_folder

REPO = "EleutherAI/pythia-tiny-seed1"
STEPS = ("step0", "step1000", "step143000")


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("hf-lmc: error:")]


# -- which revisions hold a model --------------------------------------------------------------


class RefsApi:
    """``HfApi`` at the network boundary for a repo of ``branches`` (``held``: those with a config.json)."""

    def __init__(self, branches, held):
        self.branches, self.held, self.asked = branches, set(held), []

    def list_repo_refs(self, repo_id):
        ref = lambda name: huggingface_hub.GitRefInfo(name=name, ref=f"refs/heads/{name}", target_commit="0" * 40)
        return huggingface_hub.GitRefs(branches=[ref(n) for n in self.branches], converts=[], tags=[])

    def file_exists(self, repo_id, filename, revision=None):
        self.asked.append(revision)
        return revision in self.held


def test_revisions_are_listed_in_natural_order_and_only_those_holding_a_model(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    api = RefsApi(["main", "step10", "step2", "step143000", "v1"], held=["step2", "step10", "step143000"])
    names, count, source = hub.model_revisions(REPO, exclude="main", api=api)
    assert (names, count, source) == (["step2", "step10", "step143000"], 4, "hub")  # v1 holds no config.json


def test_a_repo_with_hundreds_of_branches_checks_only_the_ends(monkeypatch):
    """PolyPythia has one branch per saved step: the line lists the first and last, checked, not all 154."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    branches = ["main", *(f"step{n}" for n in range(0, 143001, 1000))]
    api = RefsApi(branches, held=branches[1:])
    message = hub.no_model_message(REPO, None, "no config.json", api=api)
    assert len(api.asked) <= 6 and "main" not in api.asked
    assert "step0, step1000, step2000, …, step141000, step142000, step143000" in message
    assert "144 in all" in message and REPO in message and "main" in message and "\n" not in message


def _cache_repo(cache: Path, refs: dict[str, tuple[str, bool]]) -> None:
    """The Hub cache's layout of ``REPO``: ``refs/NAME`` -> commit, a snapshot with a config.json where asked."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    for name, (commit, holds) in refs.items():
        (repo / "refs" / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(commit)
        if holds:
            (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
            (repo / "snapshots" / commit / "config.json").write_text("{}")


def test_offline_the_cache_tells_which_revisions_hold_a_model(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _cache_repo(tmp_path, {"main": ("a" * 40, False), "step143000": ("b" * 40, True), "step0": ("c" * 40, True)})
    assert hub.model_revisions(REPO, exclude="main") == (["step0", "step143000"], 2, "cache")
    with pytest.raises(hub.NoModelAtRevisionError) as err:
        hub.check_holds_model(REPO, None, tmp_path / "absent")
    assert "step0, step143000" in str(err.value) and "Hub cache" in str(err.value)


# -- a PolyPythia-style repo over HTTP: a real local Hub mirror ----------------------------------


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def _polypythia_mirror(root: Path) -> Path:
    """A git repo laid out as a PolyPythia's: ``main`` holds ``.gitattributes`` alone (its one
    "initial commit"), each ``step…`` branch a tiny GPT-NeoX (its own seed) with its tokenizer."""
    repo = root / "models" / REPO
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "test@example.com")
    _git(repo, "config", "user.name", "test")
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "initial commit")
    tokenizer = char_tokenizer_folder(root / "tokenizer", 64)
    for seed, step in enumerate(STEPS):
        _git(repo, "checkout", "-q", "-b", step, "main")
        config = GPTNeoXConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            rotary_pct=0.25,
        )
        model = build_model(config, seed=seed, dtype=torch.float32)
        assert isinstance(model, GPTNeoXForCausalLM)
        model.save_pretrained(repo)
        for file in tokenizer.iterdir():
            (repo / file.name).write_bytes(file.read_bytes())
        _git(repo, "add", ".")
        _git(repo, "commit", "-q", "-m", step)
    _git(repo, "checkout", "-q", "main")
    return root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def hub_mirror(tmp_path):
    """olah, a self-hosted Hub mirror, serving the PolyPythia-style repo offline at ``HF_ENDPOINT``."""
    pytest.importorskip("olah", reason="olah is a test extra: pip install -e '.[test]'")
    mirrors = _polypythia_mirror(tmp_path / "mirrors")
    port = _free_port()
    config = tmp_path / "olah.toml"
    config.write_text(
        f'[basic]\nhost = "127.0.0.1"\nport = {port}\nmirror-netloc = "127.0.0.1:{port}"\n'
        f'mirror-lfs-netloc = "127.0.0.1:{port}"\nmirrors-path = ["{mirrors}"]\nrepos-path = "{tmp_path / "olah-repos"}"\n'
        "[accessibility]\noffline = true\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", "from olah.server import cli; cli()", "-c", str(config), "--log-path", str(tmp_path)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("the olah Hub mirror did not start")
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _hf_lmc(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    environment.update(env, TQDM_DISABLE="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run(
        [sys.executable, "-m", "hf_lmc", *args],
        check=False,
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _weights_in_cache(home: Path) -> list[Path]:
    return [path for path in (home / "hub").rglob("*.safetensors")]


@pytest.mark.slow
def test_polypythia_revisions_over_http_and_from_the_cache(hub_mirror, tmp_path):
    home = tmp_path / "hf-home"
    online = {"HF_ENDPOINT": hub_mirror, "HF_HOME": str(home)}

    # main holds no model: refused before any weight is downloaded, the revisions that do listed
    done = _hf_lmc(["merge", REPO, f"{REPO}@step143000", "-o", "out"], tmp_path, **online)
    errors = _errors(done.stderr)
    assert done.returncode == 1 and len(errors) == 1, done.stderr
    assert REPO in errors[0] and "main" in errors[0] and "step0, step1000, step143000" in errors[0]
    assert "--revision-a" in errors[0] and "revision key" in errors[0]
    assert _weights_in_cache(home) == [] and not (tmp_path / "out").exists()

    # pinned revisions merge, as the recipes pin them
    done = _hf_lmc(["merge", f"{REPO}@step0", REPO, "--revision-b", "step143000", "-o", "out"], tmp_path, **online)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()

    # offline, the cache's refs/ tell which revisions hold a model
    done = _hf_lmc(["merge", REPO, f"{REPO}@step0", "-o", "out2"], tmp_path, HF_HOME=str(home), HF_HUB_OFFLINE="1")
    errors = _errors(done.stderr)
    assert done.returncode == 1 and len(errors) == 1, done.stderr
    assert REPO in errors[0] and "step0, step143000" in errors[0] and "step1000" not in errors[0]

    # recipe check: a revision with no model is refused with the same line, an unpinned one warned about
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"models": [REPO, f"{REPO}@step0"], "output": {"dir": "runs"}}))
    done = _hf_lmc(["recipe", "check", str(recipe)], tmp_path, HF_ENDPOINT=hub_mirror, HF_HOME=str(tmp_path / "h2"))
    errors = _errors(done.stderr)
    assert done.returncode == 1 and len(errors) == 1 and "step0, step1000, step143000" in errors[0], done.stderr
    recipe.write_text(
        yaml.safe_dump(
            {"models": [{"path": REPO, "revision": "step143000"}, f"{REPO}@step0"], "output": {"dir": "runs"}}
        )
    )
    done = _hf_lmc(["recipe", "check", str(recipe)], tmp_path, **online)
    assert done.returncode == 0 and "warning" not in done.stdout, done.stdout + done.stderr


def test_recipe_check_warns_about_hub_models_at_no_pinned_revision(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # configs left out, not downloaded
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {"sweep": [{"name": "g", "models": ["org/a", "org/b@step1", "zoo:gpt2/seed0"]}], "output": {"dir": "o"}}
        )
    )
    assert main(["recipe", "check", str(recipe)]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "org/a" in warnings[0] and "sweep[0].models[0].revision" in warnings[0]


def test_the_shipped_pythia_recipes_pin_every_model():
    from hf_lmc.merging.sweep import unpinned_models

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    for name in ("pythia-scaling-weight.yaml", "pythia-scaling-dual.yaml"):
        recipe = load_recipe(recipes / name)
        assert unpinned_models(recipe) == []
        assert all(ref.path.endswith("@step143000") for _, refs in recipe.groups for ref in refs)


# -- the mission's command, verbatim -----------------------------------------------------------


def test_the_default_output_is_named_after_the_models_and_is_a_repo_name():
    assert default_output(["org/model-a", "org/model-b"]) == "model-a-model-b-merged"
    assert default_output(["EleutherAI/pythia-160m-seed1@step143000", "./b/"]) == "pythia-160m-seed1-b-merged"
    for models in (["a b", "c..d"], ["-x-", "_y"], ["é" * 80, "z" * 80]):
        MergeRequest(models=models, output=default_output(models), push_to_hub=True)  # a valid Hub name, always


def test_a_push_to_an_output_not_named_as_a_repo_needs_the_repo_id(tmp_path, capsys):
    code = main(["merge", str(tmp_path), str(tmp_path), "-o", str(tmp_path / "my merge"), "--push-to-hub"])
    errors = _errors(capsys.readouterr().err)
    assert code == 2 and len(errors) == 1 and "my merge" in errors[0]


@pytest.fixture
def stand_in_hub(tmp_path, monkeypatch):
    """A token of user ``me``, and ``HfApi``'s calls that reach the network recorded."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    calls = []
    account = {"name": "me", "orgs": [], "auth": {"accessToken": {"role": "write"}}}
    monkeypatch.setattr(HfApi, "whoami", lambda self, *args, **kwargs: account)

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id))
        return f"https://huggingface.co/{repo_id if '/' in repo_id else 'me/' + repo_id}"

    def upload_folder(self, **kwargs):
        calls.append(("upload_folder", kwargs["repo_id"], Path(kwargs["folder_path"]).resolve()))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def _org_pair(root: Path) -> None:
    """``org/model-a`` and ``org/model-b`` as folders under ``root`` (the mission's command reads them from there)."""
    from hf_lmc.canonical.exactness import tiny_configs

    config = tiny_configs()["gpt2"]
    for seed, name in enumerate(("model-a", "model-b")):
        build_model(config, seed=seed, dtype=torch.float32).save_pretrained(root / "org" / name)


def test_the_mission_command_verbatim(stand_in_hub, tmp_path, capsys, monkeypatch):
    _org_pair(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["merge", "org/model-a", "org/model-b", "--push-to-hub"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "model-a-model-b-merged" in out[0]  # said first
    written = tmp_path / "model-a-model-b-merged"
    assert (written / "model.safetensors").is_file()
    assert stand_in_hub == [
        ("create_repo", "me/model-a-model-b-merged"),
        ("upload_folder", "me/model-a-model-b-merged", written.resolve()),
    ]
    assert "me/model-a-model-b-merged" in (written / "README.md").read_text()  # the card loads it from there


def test_a_default_push_that_cannot_succeed_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(pipeline, "_read_models", lambda *args, **kwargs: pytest.fail("a model was read first"))
    _org_pair(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["merge", "org/model-a", "org/model-b", "--push-to-hub"]) == 1
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and "model-a-model-b-merged" in errors[0]
    assert not (tmp_path / "model-a-model-b-merged").exists()


def test_a_recipe_pushes_each_run_under_the_token_namespace_when_told_true(stand_in_hub, tmp_path, capsys):
    _org_pair(tmp_path)
    (tmp_path / "runs").mkdir()  # an empty folder is taken as the output
    recipe = load_recipe(
        {
            "sweep": [{"name": "g", "models": [str(tmp_path / "org" / "model-a"), str(tmp_path / "org" / "model-b")]}],
            "method": ["average", "weight"],
            "output": {"dir": str(tmp_path / "runs"), "push_to_hub": True},
        }
    )
    assert recipe.output.push_to_hub == "runs-{group}-{method}"
    from hf_lmc.merging.sweep import run_recipe

    run_recipe(recipe, progress=False)
    pushed = [call[1] for call in stand_in_hub if call[0] == "upload_folder"]
    assert pushed == ["me/runs-g-average", "me/runs-g-weight"]
