"""Nothing hf_lmc, its benchmarks or its tests load can run code: a rule over the source, checked
with ``ast`` (so a comment or a string that names a loader is not a call, and an alias is one).

Refused: ``torch.load`` without ``weights_only=True``, ``torch.jit.load`` (TorchScript is code),
``numpy.load`` with ``allow_pickle=True``, the pickle family's loaders (``pickle.load``/``loads``,
``pickle.Unpickler``, and ``_pickle``'s, ``dill``'s and ``cloudpickle``'s), ``yaml.load`` other
than with a safe loader (``yaml.SafeLoader`` or ``CSafeLoader``, or a class of the same module
that subclasses one) and ``yaml.unsafe_load`` / ``full_load`` (and their ``_all`` forms), and
accelerate's pickle readers: ``.load_state(...)`` and ``load_custom_state``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
_PICKLES = ("pickle", "_pickle", "cPickle", "dill", "cloudpickle")
_BANNED = {
    *(f"{module}.{name}" for module in _PICKLES for name in ("load", "loads", "Unpickler")),
    "yaml.unsafe_load",
    "yaml.unsafe_load_all",
    "yaml.full_load",
    "yaml.full_load_all",
    "torch.jit.load",
    "accelerate.checkpointing.load_custom_state",
    "accelerate.checkpointing.load_accelerator_state",
}
#: accelerate's: ``Accelerator.load_state`` unpickles the state it reads
_BANNED_METHODS = {"load_state", "load_custom_state"}
_SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader"}


def code_loading(source: str, filename: str = "<snippet>") -> list[str]:
    """``file:line: what`` for every call (or reference) in ``source`` that could load code."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # a local name: the dotted name it was imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    safe_loaders = set(_SAFE_YAML_LOADERS)
    for node in ast.walk(tree):  # classes of this module that subclass a safe loader (one level is enough here)
        if isinstance(node, ast.ClassDef) and any(dotted(base) in _SAFE_YAML_LOADERS for base in node.bases):
            safe_loaders.add(node.name)

    def keyword(call: ast.Call, name: str) -> ast.expr | None:
        return next((k.value for k in call.keywords if k.arg == name), None)

    def is_true(value: ast.expr | None) -> bool:
        return isinstance(value, ast.Constant) and value.value is True

    found, judged = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        judged.add(id(node.func))
        name = dotted(node.func)
        problem = None
        if name == "torch.load" and not is_true(keyword(node, "weights_only")):
            problem = "torch.load without weights_only=True"
        elif name in ("numpy.load", "np.load") and is_true(keyword(node, "allow_pickle")):
            problem = "numpy.load with allow_pickle=True"
        elif name in ("yaml.load", "yaml.load_all"):
            loader = keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or dotted(loader) not in safe_loaders:
                problem = "yaml.load without a safe loader"
        elif name in _BANNED:
            problem = name
        elif isinstance(node.func, ast.Attribute) and node.func.attr in _BANNED_METHODS:
            problem = f".{node.func.attr}(...)"
        elif isinstance(node.func, ast.Name) and node.func.id in _BANNED_METHODS:
            problem = node.func.id
        if problem:
            found.append(f"{filename}:{node.lineno}: {problem}")
    for node in ast.walk(tree):  # a loader passed on rather than called (``load = pickle.loads``)
        imported = isinstance(node, ast.Attribute) or (
            isinstance(node, ast.Name) and node.id in aliases
        )  # not a local name
        if imported and id(node) not in judged and dotted(node) in _BANNED | {"torch.load"}:
            found.append(f"{filename}:{node.lineno}: {dotted(node)} referenced")
    return sorted(set(found))


def test_no_source_file_loads_code():
    files = [p for folder in ("hf_lmc", "benchmarks", "tests") for p in sorted((_ROOT / folder).rglob("*.py"))]
    assert len(files) > 50  # the scan reads the tree, not an empty folder
    found = [hit for p in files for hit in code_loading(p.read_text(encoding="utf-8"), str(p.relative_to(_ROOT)))]
    assert found == []


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load('x')",
        "import torch\ntorch.load('x', weights_only=False)",
        "import torch as t\nt.load('x', map_location='cpu')",
        "from torch import load\nload('x')",
        "import torch\ntorch.jit.load('x')",
        "import pickle\npickle.load(open('x', 'rb'))",
        "import pickle\npickle.loads(b'')",
        "from pickle import Unpickler\nUnpickler(f).load()",
        "import _pickle as p\np.loads(b'')",
        "import dill\ndill.load(f)",
        "import pickle\nload = pickle.loads",
        "import yaml\nyaml.load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.Loader)",
        "import yaml\nyaml.load(text, yaml.FullLoader)",
        "import yaml\nyaml.unsafe_load(text)",
        "import yaml\nyaml.full_load(text)",
        "import yaml\nyaml.load_all(text)",
        "from yaml import unsafe_load\nunsafe_load(text)",
        "import numpy as np\nnp.load('x', allow_pickle=True)",
        "accelerator.load_state('folder')",
        "from accelerate.checkpointing import load_custom_state\nload_custom_state(obj, 'folder')",
    ],
)
def test_the_rule_finds_a_loader_that_can_run_code(snippet):
    assert len(code_loading(snippet)) == 1, snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load('x', weights_only=True, mmap=True)",
        "import yaml\nyaml.safe_load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
        "import yaml\nyaml.load_all(text, Loader=yaml.CSafeLoader)",
        "import yaml\nclass Strict(yaml.SafeLoader):\n    pass\nyaml.load(text, Loader=Strict)",
        "import numpy as np\nnp.load('x')",
        "import pickle\npickle.dumps(obj)",
        "model.load_state_dict(state)",
        "text = 'pickle.loads(torch.load(x))'  # pickle.loads(b'') in a comment",
        "def load(x):\n    return x\nload(1)",
    ],
)
def test_the_rule_passes_loaders_that_cannot_run_code(snippet):
    assert code_loading(snippet) == [], snippet
