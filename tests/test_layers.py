"""The package's shape, kept by tools rather than memory: imports only point down the layers
that ``pyproject.toml`` declares (import-linter), and the command line starts without torch."""

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    """``lint-imports`` with the contracts of ``[tool.importlinter]``: a module importing from a
    layer above its own, or the option models importing torch, fails here."""
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _layers() -> list[list[str]]:
    """The import-linter layers of ``pyproject.toml``, top to bottom, each as its modules' names
    without the package prefix."""
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    return [[name.strip().removeprefix("hf_lmc.") for name in re.split(r"[|:]", layer)] for layer in layers]


def test_every_module_is_in_a_layer_and_on_both_maps():
    """The layers cover the whole package (a module outside them is checked by nothing), and the
    maps people read name every layered module in the layers' order: design §9's table and the
    README's layout (both say imports point down their list)."""
    package = ROOT / "hf_lmc"
    modules = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    modules |= {p.parent.name for p in package.glob("*/__init__.py")}
    layered = [name for layer in _layers() for name in layer]
    assert modules == set(layered), (
        f"not in a layer: {sorted(modules - set(layered))}; no such module: {sorted(set(layered) - modules)}"
    )
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = design[design.index("## 9. Layers") :].split("\n## ", 1)[0]
    block = (ROOT / "README.md").read_text(encoding="utf-8").split("<!-- layout -->", 1)[1].split("```", 2)[1]
    layout = "\n".join(re.split(r"\s{2,}", line.strip())[0] for line in block.splitlines())  # the file column
    modules_column = "\n".join(row.split("|")[2] for row in section.splitlines() if row.startswith("| ") and "`" in row)
    for name in layered:
        assert f"`{name}`" in modules_column or f"`{name}/`" in modules_column, f"design §9 does not name {name}"
    row_of = {name: re.search(rf"`{re.escape(name)}/?`", modules_column).start() for name in layered}
    for upper, lower in itertools.pairwise(_layers()):
        assert max(row_of[n] for n in upper) < min(row_of[n] for n in lower), f"design §9 lists {lower} above {upper}"
        assert re.search(rf"(?<![\w/]){re.escape(name)}(\.py|/)", layout), f"the README's layout does not name {name}"
    where = {name: re.search(rf"(?<![\w/]){re.escape(name)}(\.py|/)", layout).start() for name in layered}
    for upper, lower in itertools.pairwise(_layers()):
        assert max(where[n] for n in upper) < min(where[n] for n in lower), f"the README lists {lower} above {upper}"


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_the_tree_has_no_lint_findings(command):
    """``ruff check`` and ``ruff format --check`` with ``[tool.ruff]``'s settings report nothing
    on the package, the tests and the benchmarks (``.ci/run`` runs them too, before the suite)."""
    run = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "hf_lmc", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.parametrize(
    "code",
    [
        "import hf_lmc.cli",
        "from hf_lmc.cli import build_parser; build_parser().parse_args(['merge', 'a', 'b', '-o', 'out'])",
        "from hf_lmc.cli import main; main(['--help'])",
        "from hf_lmc.cli import main; main(['merge', '--help'])",
        "import hf_lmc; hf_lmc.__version__",
    ],
)
def test_the_command_line_starts_without_torch_or_transformers(code):
    """``hf-lmc --help`` builds every parser (flags generated from the option models) without
    loading torch or transformers."""
    check = f"""
import sys
try:
    {code}
except SystemExit:
    pass
heavy = sorted(m for m in ('torch', 'transformers', 'accelerate', 'datasets', 'peft') if m in sys.modules)
print('heavy modules:', heavy)
"""
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "heavy modules: []"


def test_public_names_resolve_lazily():
    """``from hf_lmc import DualPath`` still works: the name resolves on first use."""
    import hf_lmc

    assert hf_lmc.DualPath.__name__ == "DualPath"
    # the names user scripts were written with remain aliases of what they name now
    assert (hf_lmc.DualMatcher, hf_lmc.LearnedMatcher, hf_lmc.SimplexMatcher) == (
        hf_lmc.DualPath,
        hf_lmc.LearnedPath,
        hf_lmc.SimplexPath,
    )
    assert hf_lmc.MergeSpec is hf_lmc.MergeRequest
    assert set(hf_lmc.__all__) <= set(dir(hf_lmc))
    assert sorted(hf_lmc.__all__) == sorted([*hf_lmc._PUBLIC, "__version__"])  # the written-out list is the table's
    with pytest.raises(AttributeError):
        hf_lmc.NoSuchName  # noqa: B018


def test_the_readme_methods_table_is_the_registry():
    """The README's methods table is generated from :mod:`hf_lmc.methods`
    (``python -m hf_lmc.methods README.md``); a new or changed method must reach it."""
    from hf_lmc.methods import with_table

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert with_table(readme) == readme
