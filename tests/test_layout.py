"""The package's layers, as ``[tool.importlinter]`` in pyproject.toml writes them and docs/architecture.md draws
them: the merge and the analysis apart; in the analysis, the phases (``per_rank``, ``cross_rank``, ``diff``,
``report``) apart from each other, importing nothing of the analysis but ``schema``, and never the cluster or the
storage, which only ``run``, ``tasks`` and ``folder`` touch."""
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
    assert "5 kept, 0 broken" in proc.stdout


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
    assert "3 kept, 2 broken" in proc.stdout
    assert "- tracefuse_dask.analysis.per_rank.sequences -> tracefuse_dask.analysis.cross_rank.what_if" in proc.stdout
    assert "tracefuse_dask.analysis.diff.compare -> tracefuse_dask.storage.files" in proc.stdout
