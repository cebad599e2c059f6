"""The package's shape, kept by tools rather than memory: imports only point down the layers
that ``pyproject.toml`` declares (import-linter), and the command line starts without torch."""

import ast
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
    """The import-linter layers of ``pyproject.toml``, top to bottom, each as its entries' dotted
    names without the package prefix (a module, or a folder standing for all it holds)."""
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    return [[name.strip().removeprefix("hf_lmc.") for name in re.split(r"[|:]", layer)] for layer in layers]


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a folder's ``__init__`` under the folder's name)."""
    found = {}
    for path in (ROOT / "hf_lmc").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports, wherever the import stands (inside functions too),
    but for those only a type checker reads (``if TYPE_CHECKING:``)."""
    modules = _modules()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            node.body = []
    found = set()

    def known(name: str) -> str:
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {known(alias.name) for alias in node.names if alias.name.startswith("hf_lmc")}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import ({node.module}); the package imports absolutely"
            if node.module and node.module.startswith("hf_lmc"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else known(node.module))
    return found


def test_no_import_cycle_counting_every_import():
    """The import graph of the package, with the imports inside functions counted as those at the
    top (import-linter's contracts above read the module level), has no cycle; and no module but
    ``__main__`` imports the package's face (``hf_lmc/__init__.py``), whose names are for users."""
    graph = {name: _imports(path) - {name} for name, path in _modules().items()}
    for name, targets in graph.items():
        assert "hf_lmc" not in targets or name in ("hf_lmc",), f"{name} imports the package's face"
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                cycle = [*trail[trail.index(target) :], target] if target in trail else [name, target]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, [*trail, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_every_module_is_in_a_layer_and_on_both_maps():
    """The layers cover the whole package (a module outside them is checked by nothing), design §9's
    table names every layer entry in the layers' order, and the README's layout names every folder
    and top-level module (both are maps people read)."""
    modules = _modules()
    entries = [name for layer in _layers() for name in layer]
    folders = {name for name, path in modules.items() if path.name == "__init__.py"}
    for name in modules:
        if name in ("hf_lmc", "hf_lmc.__main__") or (name in folders and not _imports(modules[name])):
            continue  # the face, the entry point, and folders that only hold their modules
        short = name.removeprefix("hf_lmc.")
        assert any(short == e or short.startswith(e + ".") for e in entries), f"{short} is in no layer"
    for entry in entries:
        assert any(name.removeprefix("hf_lmc.") == entry for name in modules), f"no such module: {entry}"
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = design[design.index("## 9. Layers") :].split("\n## ", 1)[0]
    modules_column = "\n".join(row.split("|")[2] for row in section.splitlines() if row.startswith("| ") and "`" in row)
    row_of = {}
    for entry in entries:
        shown = re.search(rf"`{re.escape(entry.replace('.', '/'))}/?`", modules_column)
        assert shown, f"design §9 does not name {entry}"
        row_of[entry] = shown.start()
    for upper, lower in itertools.pairwise(_layers()):
        assert max(row_of[n] for n in upper) < min(row_of[n] for n in lower), f"design §9 lists {lower} above {upper}"
    block = (ROOT / "README.md").read_text(encoding="utf-8").split("<!-- layout -->", 1)[1].split("```", 2)[1]
    top = {path.relative_to(ROOT / "hf_lmc").parts[0] for path in modules.values()} - {"__init__.py", "__main__.py"}
    for name in top:
        assert re.search(rf"^  {re.escape(name.removesuffix('.py'))}(\.py|/)", block, re.MULTILINE), (
            f"the README's layout lacks {name}"
        )


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
    """``from hf_lmc import DualMatcher`` works as the mission writes it: the class itself, resolved
    on first use, with no second name beside it."""
    import hf_lmc

    assert hf_lmc.DualMatcher.__name__ == "DualMatcher"
    assert (hf_lmc.LearnedMatcher.__name__, hf_lmc.SimplexMatcher.__name__) == ("LearnedMatcher", "SimplexMatcher")
    for earlier in ("DualPath", "LearnedPath", "SimplexPath"):
        assert not hasattr(hf_lmc, earlier)
    assert not hasattr(hf_lmc, "MergeSpec")  # no compatibility alias in a package with no released users
    assert set(hf_lmc.__all__) <= set(dir(hf_lmc))
    assert sorted(hf_lmc.__all__) == sorted([*hf_lmc._PUBLIC, "__version__"])  # the written-out list is the table's
    with pytest.raises(AttributeError):
        hf_lmc.NoSuchName  # noqa: B018


def test_the_readme_methods_table_is_the_registry():
    """The README's methods table is generated from :mod:`hf_lmc.config.methods`
    (``python -m hf_lmc.config.methods README.md``); a new or changed method must reach it."""
    from hf_lmc.config.methods import with_table

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert with_table(readme) == readme
