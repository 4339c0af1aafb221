"""The package's layers, as ``[tool.importlinter]`` in pyproject.toml writes them and docs/architecture.md draws
them: the merge and the analysis apart; in the analysis, the phases (``per_rank``, ``cross_rank``, ``diff``,
``report``) apart from each other, importing nothing of the analysis but ``schema``, and never the cluster or the
storage, which only ``run``, ``tasks`` and ``folder`` touch; the event store above the merge, which never imports it,
its schema and columns pure."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the package under ``root``, with ``root``'s pyproject.toml."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})


def test_every_layer_contract_is_kept():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 kept, 0 broken" in proc.stdout


def test_an_import_across_phases_breaks_a_contract(tmp_path):
    """The contracts can fail: a copy of the package where the per-rank map imports the cross-rank reduce, and the
    diff the storage, breaks two of them, each named with the import that breaks it."""
    shutil.copytree(ROOT / "tracefuse_dask", tmp_path / "tracefuse_dask",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "tracefuse_dask/analysis/per_rank/sequences.py", "a") as f:
        f.write("from ..cross_rank.what_if import NOISE  # noqa\n")
    with open(tmp_path / "tracefuse_dask/analysis/diff/compare.py", "a") as f:
        f.write("from ...storage.files import options_for  # noqa\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode == 1
    assert "5 kept, 2 broken" in proc.stdout
    assert "- tracefuse_dask.analysis.per_rank.sequences -> tracefuse_dask.analysis.cross_rank.what_if" in proc.stdout
    assert "tracefuse_dask.analysis.diff.compare -> tracefuse_dask.storage.files" in proc.stdout


def _lines(node: ast.AST) -> int:
    """A module's, class's or function's lines, its docstrings excluded (its own and those of what it defines)."""
    docs = sum(d.end_lineno - d.lineno + 1 for n in ast.walk(node)
               if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
               and (d := ast.get_docstring(n, clean=False) and n.body[0]))
    first = 1 if isinstance(node, ast.Module) else node.lineno
    last = max((getattr(n, "end_lineno", 0) or 0) for n in ast.walk(node))
    return last - first + 1 - docs


def test_no_module_over_600_lines_and_no_function_over_80():
    """Each module stays under 600 lines and each function under 80, docstrings excluded; every failure is
    named."""
    too_long = []
    for path in sorted((ROOT / "tracefuse_dask").rglob("*.py")):
        name = path.relative_to(ROOT / "tracefuse_dask").as_posix()
        tree = ast.parse(path.read_text())
        if (n := _lines(tree)) > 600:
            too_long.append(f"{name}: {n} lines")
        for holder in [tree, *(c for c in ast.walk(tree) if isinstance(c, ast.ClassDef))]:
            for f in holder.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{name}:{f.name}" if holder is tree else f"{name}:{holder.name}.{f.name}"
                    if (n := _lines(f)) > 80:
                        too_long.append(f"{key}: {n} lines")
    assert not too_long, "over the limit: " + "; ".join(too_long)
