"""The README's Python blocks run as written, in seconds, on tiny local models: a user who
copies one gets what it says (the folders it names, batches built as it shows)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from hf_lmc.canonical.exactness import tiny_configs
from tests.models import build_model, char_tokenizer_folder

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(text: str) -> list[str]:
    """Every fenced ``python`` block of a markdown text."""
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


@pytest.mark.slow
def test_the_readme_python_block_runs_as_written(tmp_path, monkeypatch):
    config = tiny_configs()["gpt2"]
    config.n_positions = 128  # the block's sequences are 128 tokens long
    for seed, name in ((1, "a"), (2, "b")):
        build_model(config, seed=seed, dtype=torch.float32).save_pretrained(tmp_path / name)
        char_tokenizer_folder(tmp_path / name, config.vocab_size)
    (tmp_path / "plays.txt").write_text("abc cab bca.\n" * 400)  # 5200 characters: five batches of 8 x 128
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "the README has no python block"
    for block in blocks:
        scope: dict = {}
        exec(compile(block, str(README), "exec"), scope)  # noqa: S102 (the README's own code)
    assert isinstance(scope["model"], PreTrainedModel)
    for folder in ("merged", "merged-weight", "merged-dual"):
        assert (tmp_path / folder / "config.json").is_file(), folder


def example_lines() -> list[str]:
    """Every ``hf-lmc`` command line of the README's shell blocks and of ``hf-lmc --help``'s examples."""
    from hf_lmc.cli import EXAMPLES

    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines()] + EXAMPLES.splitlines()[1:]
    return [line.split("#")[0].strip() for line in lines if line.strip().startswith("hf-lmc ")]


def test_every_example_parses_and_reads_only_files_one_documented_command_writes(tmp_path, capsys):
    """Each example of the README and of --help parses as printed; the text files it reads are
    the plays ``hf-lmc demo --write-plays .`` writes (the README's quickstart says so before it
    uses them), and the recipes it names ship with the repository."""
    import shlex

    from hf_lmc.cli import build_parser, main
    from hf_lmc.commands.demo import PLAYS_FILES

    root = README.parent
    lines = example_lines()
    assert len(lines) > 20
    parser = build_parser()
    for line in lines:
        words = shlex.split(line)[1:]
        words = [
            found
            for word in words
            for found in ([str(p.relative_to(root)) for p in sorted(root.glob(word))] if "*" in word else [word])
        ]
        if ">" in words:  # a redirection: the shell's, not the command's
            words = words[: words.index(">")]
        try:
            parser.parse_args(words)
        except SystemExit as err:
            pytest.fail(f"{line!r} does not parse (exit {err.code})")
        for word in words:
            if word.endswith(".txt"):
                assert word in PLAYS_FILES, f"{line!r} reads {word}, which no documented command writes"
            if word.endswith(".yaml") and not word.endswith("schema.json"):
                assert (root / word).is_file(), f"{line!r} names {word}, which is not in the repository"
    text = README.read_text(encoding="utf-8")
    assert text.index("hf-lmc demo --write-plays .") < text.index("--eval-data plays.txt")
    assert main(["demo", "--write-plays", str(tmp_path), "-q"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PLAYS_FILES)
    assert all((tmp_path / name).stat().st_size > 100_000 for name in PLAYS_FILES)
