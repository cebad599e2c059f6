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
