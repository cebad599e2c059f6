"""The package's shape, kept by tools rather than memory: imports only point down the layers
that ``pyproject.toml`` declares (import-linter), and the command line starts without torch."""

import subprocess
import sys
from pathlib import Path

import pytest

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
    """``from hf_lmc import DualMatcher`` still works: the name resolves on first use."""
    import hf_lmc

    assert hf_lmc.DualMatcher.__name__ == "DualMatcher"
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
