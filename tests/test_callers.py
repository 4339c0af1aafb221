"""The Python API as users call it: a script without a main guard, stdin, -c, IPython, a notebook, a
multiprocessing child and a pytest test, each a real process on real traces, each giving the CLI's output
with the embedded cluster's worker processes (never a fall-back into the caller, never a re-run of it).

The jobs are small: the snippet asks for ``workers=2`` to get worker programs, and without it, as the CLI
here, their tasks run in threads of the caller, with the same output."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED, shared

pytestmark = pytest.mark.integration

JOB = SHARED / "gloo_4ranks"  # real CPU traces (torch + gloo) with collectives and a straggler

# What users paste: no main guard. seen_by records which processes run the per-rank tasks; caller.pid is
# appended to, so a worker that re-ran the caller would show up there (if it did not die first).
SNIPPET = """\
import glob, os
from tracefuse_dask import TraceFuse, analyze, merge_traces
files = sorted(glob.glob(os.path.join({inputs!r}, "*.json.gz")))
TraceFuse(files, max_workers=2).merge_and_save(os.path.join({out!r}, "merged.json.gz"))
analyze({inputs!r}, os.path.join({out!r}, "analysis"), workers=2)
def seen_by(event):
    path = os.path.join({out!r}, "pids", str(os.getpid()))
    if not os.path.exists(path):
        open(path, "w").close()
    return True
merge_traces({inputs!r}, os.path.join({out!r}, "filtered.json"), filter_fn=seen_by, workers=2)
with open(os.path.join({out!r}, "caller.pid"), "a") as f:
    f.write(str(os.getpid()) + chr(10))
"""


def run(args: list[str], cwd: Path, stdin: str | None = None) -> None:
    done = subprocess.run(args, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "bootstrapping" not in done.stderr, done.stderr


@pytest.fixture(scope="module")
def cli_outputs(tmp_path_factory) -> dict[str, Path]:
    """What the CLI makes of each job, merged and analysed."""
    if not JOB.is_dir():
        pytest.skip("../shared/traces is missing")
    got = {}
    for inputs in (JOB, SHARED / "real" / "hta_trace_filter"):
        out = tmp_path_factory.mktemp("cli")
        cli = [sys.executable, "-m", "tracefuse_dask"]
        run([*cli, "merge", str(inputs), "-o", str(out / "merged.json.gz"), "-q"], out)
        run([*cli, "analyze", str(inputs), "-o", str(out / "analysis"), "-q"], out)
        got[str(inputs)] = out
    return got


def snippet_for(inputs: Path, tmp_path: Path) -> tuple[Path, str]:
    out = tmp_path / "out"
    (out / "pids").mkdir(parents=True)
    return out, SNIPPET.format(inputs=str(inputs), out=str(out))


def summary_without_timing(path: Path) -> dict:
    summary = json.loads(path.read_text())
    summary.pop("seconds")
    return summary


def commit_without_summary(path: Path) -> dict:
    commit = json.loads(path.read_text())
    commit["files"].pop("summary.json")
    return commit


def check(out: Path, cli: Path, in_caller: bool = False) -> None:
    """The caller's outputs are the CLI's, its tasks ran in other processes (or ``in_caller``), and it ran once."""
    assert (out / "merged.json.gz").read_bytes() == (cli / "merged.json.gz").read_bytes()
    names = sorted(p.name for p in (cli / "analysis").iterdir())
    assert sorted(p.name for p in (out / "analysis").iterdir()) == names and "ops.parquet" in names
    for name in names:
        if name == "summary.json":
            assert summary_without_timing(out / "analysis" / name) == summary_without_timing(cli / "analysis" / name)
        elif name == "commit.json":  # it lists summary.json by its hash
            assert commit_without_summary(out / "analysis" / name) == commit_without_summary(cli / "analysis" / name)
        else:
            assert (out / "analysis" / name).read_bytes() == (cli / "analysis" / name).read_bytes(), name
    assert (out / "filtered.json").stat().st_size > 0
    callers = (out / "caller.pid").read_text().split()
    workers = {p.name for p in (out / "pids").iterdir()}
    assert len(callers) == 1 and workers
    assert (workers == {callers[0]}) if in_caller else (callers[0] not in workers)


@pytest.mark.parametrize("inputs", [JOB, SHARED / "real" / "hta_trace_filter"], ids=["gloo_4ranks", "hta_trace_filter"])
def test_a_plain_script_without_a_main_guard(inputs, cli_outputs, tmp_path):
    out, code = snippet_for(inputs, tmp_path)
    (tmp_path / "job.py").write_text(code)
    run([sys.executable, "job.py"], tmp_path)
    check(out, cli_outputs[str(inputs)])


def test_a_filter_from_a_module_beside_the_script(tmp_path):
    """Pickled by reference, it imports in the workers as it would in multiprocessing's children."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "myfilters.py").write_text(
        "import os\ndef no_python(event):\n    return event.get('cat') != 'python_function'\n")
    (tmp_path / "job" / "job.py").write_text(
        "from myfilters import no_python\nfrom tracefuse_dask import merge_traces\n"
        f"print(merge_traces({str(shared('gloo_4ranks'))!r}, 'merged.json', filter_fn=no_python, workers=2)"
        ".events_out)\n")
    run([sys.executable, "job/job.py"], tmp_path)
    assert (tmp_path / "merged.json").stat().st_size > 0


def test_small_inputs_without_workers_run_in_the_caller(cli_outputs, tmp_path):
    """No worker programs to start: the tasks run in threads of the script, which is not re-run."""
    out, code = snippet_for(JOB, tmp_path)
    (tmp_path / "job.py").write_text(code.replace(", max_workers=2", "").replace(", workers=2", ""))
    run([sys.executable, "job.py"], tmp_path)
    check(out, cli_outputs[str(JOB)], in_caller=True)


def test_code_piped_to_python_stdin(cli_outputs, tmp_path):
    out, code = snippet_for(JOB, tmp_path)
    run([sys.executable, "-"], tmp_path, stdin=code)
    check(out, cli_outputs[str(JOB)])


def test_python_dash_c(cli_outputs, tmp_path):
    out, code = snippet_for(JOB, tmp_path)
    run([sys.executable, "-c", code], tmp_path)
    check(out, cli_outputs[str(JOB)])


def test_ipython(cli_outputs, tmp_path):
    out, code = snippet_for(JOB, tmp_path)
    run([sys.executable, "-m", "IPython", "--no-banner", "--quick", "-c", code], tmp_path)
    check(out, cli_outputs[str(JOB)])


def test_a_notebook_run_by_nbconvert(cli_outputs, tmp_path):
    import nbformat

    out, code = snippet_for(JOB, tmp_path)
    imports, _, rest = code.partition("files = ")
    cells = [nbformat.v4.new_code_cell(imports), nbformat.v4.new_code_cell("files = " + rest)]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "job.ipynb")
    run([sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute", "--output", "ran.ipynb", "job.ipynb"],
        tmp_path)
    check(out, cli_outputs[str(JOB)])


def test_a_multiprocessing_pool_worker(cli_outputs, tmp_path):
    """A daemonic Pool worker, which may not have multiprocessing children of its own."""
    out, code = snippet_for(JOB, tmp_path)
    (tmp_path / "parent.py").write_text(
        "import multiprocessing\n"
        f"CODE = {code!r}\n"
        "def job():\n"
        "    exec(CODE, {'__name__': 'job'})\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.Pool(1) as pool:\n"
        "        pool.apply(job)\n")
    run([sys.executable, "parent.py"], tmp_path)
    check(out, cli_outputs[str(JOB)])


def test_a_test_run_by_pytest(cli_outputs, tmp_path):
    out, code = snippet_for(JOB, tmp_path)
    body = "".join("    " + line + "\n" for line in code.splitlines())
    (tmp_path / "test_job.py").write_text("def test_job():\n" + body)
    run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_job.py"], tmp_path)
    check(out, cli_outputs[str(JOB)])
