"""The merged output and the analysis tables of every shared trace set and of the example jobs, pinned by sha256.

The analysis of an event store of each job (``tracefuse index``) must give the same tables, never reading the JSON.

A change that alters any output fails here, so that it is a decision, not an accident: a refactoring must
leave every hash as it is; a change of behaviour regenerates them on purpose and says why in its commit:

    TRACEFUSE_REGENERATE_HASHES=1 python -m pytest tests/test_output_hashes.py

Each folder of ``../shared/traces`` (and of ``real/``) is one job, merged and analysed on its own, on worker
programs and, as small inputs are without a client, in threads of this process. Tables are
hashed as CSV text (``repr`` of floats, so a change in the last bit shows), not as Parquet, whose bytes carry
the writer's version.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from conftest import REAL_SETS, SHARED
from tracefuse_dask import analyze, index_traces, merge_traces
from tracefuse_dask.synth import write_example

EXPECTED_FILE = Path(__file__).parent / "data" / "output_hashes.json"
REGENERATE = os.environ.get("TRACEFUSE_REGENERATE_HASHES") == "1"
SETS = ["gloo_4ranks", "gloo_2ranks_tb_nostraggler", *(f"real/{name}" for name in REAL_SETS)]
EXAMPLES = {"example": None, "example-straggler-5": 5}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hashes(inputs: str, tmp: Path, client) -> dict[str, str]:
    """sha256 of the merged trace (``.json`` and ``.json.gz``) and of every analysis table of ``inputs``; the
    embedded cluster's when ``client`` is None."""
    got = {}
    for suffix in ("json", "json.gz"):
        out = tmp / f"merged.{suffix}"
        merge_traces(inputs, str(out), client=client, force=True)
        got[f"merge.{suffix}"] = sha256(out.read_bytes())
    for name, df in analyze(inputs, client=client).tables().items():
        got[f"analysis.{name}"] = sha256(df.to_csv(index=False, float_format="%r").encode())
    return got


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    if not SHARED.is_dir():
        pytest.skip("../shared/traces is missing")
    folders = {name: str(SHARED / name) for name in SETS}
    for name, straggler in EXAMPLES.items():
        out = tmp_path_factory.mktemp(name) / "traces"
        write_example(str(out), ranks=4, rank_bytes=500_000, straggler=straggler)
        folders[name] = str(out)
    return folders


@pytest.fixture(scope="module")
def computed(jobs, client, tmp_path_factory):
    got = {name: hashes(path, tmp_path_factory.mktemp("out"), client) for name, path in jobs.items()}
    if REGENERATE:
        EXPECTED_FILE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    return got


@pytest.fixture(scope="module")
def computed_in_process(jobs, tmp_path_factory):
    return {name: hashes(path, tmp_path_factory.mktemp("out"), None) for name, path in jobs.items()}


@pytest.fixture(scope="module")
def computed_from_store(jobs, client, tmp_path_factory):
    """The analysis tables of each job's event store (``test_store`` shows that its analysis reads no trace)."""
    got = {}
    for name, path in jobs.items():
        store = tmp_path_factory.mktemp("store") / "store"
        index_traces(path, str(store), client=client)
        got[name] = {f"analysis.{table}": sha256(df.to_csv(index=False, float_format="%r").encode())
                     for table, df in analyze(str(store), client=client).tables().items()}
    return got


@pytest.mark.integration
@pytest.mark.parametrize("where", ["computed", "computed_in_process", "computed_from_store"])
@pytest.mark.parametrize("job", [*SETS, *EXAMPLES])
def test_outputs_are_unchanged(request, where, job):
    computed = request.getfixturevalue(where)
    expected = json.loads(EXPECTED_FILE.read_text())
    assert job in expected, f"{job} has no pinned hashes: regenerate them (see this module's docstring)"
    keys = computed[job].keys() | {k for k in expected[job]
                                   if where != "computed_from_store" or k.startswith("analysis.")}
    changed = sorted(k for k in keys if computed[job].get(k) != expected[job].get(k))
    assert not changed, f"{job}: these outputs changed: {changed}"
