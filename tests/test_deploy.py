"""deploy/: manifests lint, scripts parse, the image recipe installs, and scheduled runs are idempotent."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import make_trace, sbatch_exports, write_trace
from tracefuse_dask import merge_traces
from tracefuse_dask.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def _containers(doc: dict) -> list[dict]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list):
                found.extend(node["containers"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    return found


@pytest.mark.parametrize("name, kind", [("daskcluster.yaml", "DaskCluster"), ("daskjob.yaml", "DaskJob"),
                                        ("cronjob.yaml", "CronJob")])
def test_kubernetes_manifests_parse_and_carry_the_required_fields(name, kind):
    (doc,) = yaml.safe_load_all((DEPLOY / "k8s" / name).read_text())
    assert doc["kind"] == kind and doc["apiVersion"] and doc["metadata"]["name"]
    containers = _containers(doc)
    assert containers
    for c in containers:
        assert c["image"] and c["name"] and (c.get("command") or c.get("args"))
    commands = [" ".join(cmd) for c in containers for cmd in _tracefuse_commands(c)] or \
        [" ".join(c["command"]) for c in containers]
    if kind != "DaskCluster":
        assert any(cmd.startswith("tracefuse merge s3://") and " -o s3://" in cmd for cmd in commands)
        assert any("--skip-if-unchanged" in cmd and "--summary-json" in cmd for cmd in commands)
    if kind == "CronJob":
        assert doc["spec"]["concurrencyPolicy"] == "Forbid"
        assert any("secretRef" in str(c.get("envFrom")) for c in containers)
    if kind in ("DaskCluster", "DaskJob"):  # the operator's clusters speak TLS only, with the Secret's files
        files = "--tls-ca-file /tls/ca.crt --tls-cert /tls/tls.crt --tls-key /tls/tls.key"
        for c in containers:
            line = " ".join(c["command"])
            assert files in line and {"name": "tls", "mountPath": "/tls", "readOnly": True} in c["volumeMounts"], line
            if c["command"][:2] == ["dask", "scheduler"]:
                assert "--protocol tls" in line
            elif c["command"][:2] == ["dask", "worker"]:
                assert c["command"][2].startswith("tls://")
            else:
                assert "--scheduler tls://" in line


def test_the_commands_of_the_manifests_parse_with_our_cli():
    from tracefuse_dask.cli import _parser

    for name in ("daskjob.yaml", "cronjob.yaml"):
        (doc,) = yaml.safe_load_all((DEPLOY / "k8s" / name).read_text())
        parsed = [_parser().parse_args(cmd[1:]) for c in _containers(doc) for cmd in _tracefuse_commands(c)]
        assert parsed[0].command == "merge" and parsed[0].skip_if_unchanged
        if name == "cronjob.yaml":  # tonight's traces analysed, then diffed against last night's report
            assert [a.command for a in parsed] == ["merge", "analyze", "diff"]
            assert parsed[2].base.endswith("/tracefuse/report") and parsed[2].new == parsed[1].output
            assert parsed[2].fail_above == "5%"


def _tracefuse_commands(container: dict) -> list[list[str]]:
    """The tracefuse command lines of a container: its command, or the lines of its ``sh -c`` script, with the
    script's night folders given values."""
    if container["command"][0] == "tracefuse":
        return [container["command"]]
    if container["command"] != ["sh", "-c"]:
        return []
    script = container["args"][0].replace("$T", "s3://traces/nightly/2026-11-25").replace(
        "$P", "s3://traces/nightly/2026-11-24")
    return [shlex.split(line) for line in script.splitlines() if line.strip().startswith("tracefuse ")]


def test_sbatch_script_is_valid_bash_and_starts_the_cluster_the_tests_use():
    script = DEPLOY / "slurm" / "tracefuse.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "dask scheduler --scheduler-file" in text and "dask worker --scheduler-file" in text
    assert "tracefuse merge" in text and "--scheduler-file" in text


@pytest.mark.parametrize("failing, ran, code, tls", [
    (None, ["merge", "analyze", "diff"], 0, False),
    ("merge", ["merge"], 1, False),  # the first failing step stops the job, with its code, and the scheduler file goes
    ("diff", ["merge", "analyze", "diff"], 3, False),
    (None, ["merge", "analyze", "diff"], 0, True),
])
def test_sbatch_script_runs_its_steps_in_order_and_stops_at_the_first_failure(tmp_path, failing, ran, code, tls):
    """The script with stand-ins for srun, dask and tracefuse that log what they are asked; with TLS_DIR, every
    one of them gets its TLS files, and the scheduler speaks TLS only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(  # the scheduler writes its file; workers only read it
        '#!/bin/sh\necho "srun $*" >> "$CMDS"\n'
        'case "$*" in *"dask scheduler"*) for a; do [ "$p" = --scheduler-file ] && touch "$a"; p=$a; done;; '
        'esac\n')
    (bin_dir / "tracefuse").write_text(
        '#!/bin/sh\necho "$1" >> "$LOG"\necho "tracefuse $*" >> "$CMDS"\n[ "$1" = "$FAIL" ] && exit "$CODE"\nexit 0\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log"),
           "FAIL": failing or "", "CODE": str(code), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
           "PREVIOUS": str(tmp_path / "old.report"), "CMDS": str(tmp_path / "cmds"),
           **({"TLS_DIR": "/home/me/tls"} if tls else {})}
    done = subprocess.run(["bash", str(DEPLOY / "slurm" / "tracefuse.sbatch"), "in", str(tmp_path / "m.json.gz")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == code, done.stderr
    assert (tmp_path / "log").read_text().split() == ran
    assert not list(tmp_path.glob("tracefuse-scheduler-*.json"))
    files = "--tls-ca-file /home/me/tls/ca.pem --tls-cert /home/me/tls/cert.pem --tls-key /home/me/tls/key.pem"
    deadline = time.monotonic() + 10
    while len(commands := (tmp_path / "cmds").read_text().splitlines()) < 2 + len(ran):
        assert time.monotonic() < deadline, commands  # the scheduler's and workers' sruns run in the background
        time.sleep(0.05)
    assert len(commands) == 2 + len(ran)  # the scheduler, the workers, and each tracefuse step
    for line in commands:
        assert (files in line) == tls and ("--protocol tls" in line) == (tls and "dask scheduler" in line), line
    if tls:  # the stand-in took them as the real CLI would
        from tracefuse_dask.cli import _parser

        for line in (c for c in commands if c.startswith("tracefuse ")):
            args = _parser().parse_args(line.split()[1:])
            assert (args.tls_ca_file, args.tls_cert, args.tls_key) == tuple(f"/home/me/tls/{n}.pem"
                                                                              for n in ("ca", "cert", "key"))


@pytest.mark.integration
def test_the_deploy_files_workers_keep_glibc_malloc_trimming_and_a_heap_pad(scheduler_file):
    from distributed import Client

    key = "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON"
    value = "{'MALLOC_TRIM_THRESHOLD_': None, 'MALLOC_TOP_PAD_': 268435456, 'MALLOC_ARENA_MAX': 1}"
    assert sbatch_exports()[key] == value
    (docker,) = re.findall(rf"^ENV {key}=(.*)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert shlex.split(docker) == [value]
    slurm = (DEPLOY / "slurm" / "slurm_cluster.py").read_text()
    assert f'environ = "{value}"' in slurm and f'"export {key}=\\"{{environ}}\\""' in slurm
    with Client(scheduler_file=scheduler_file, timeout=30) as c:  # `dask worker`s with the sbatch's environment
        malloc = c.run(lambda: [os.environ.get(k) for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                                                                 "MALLOC_ARENA_MAX")])
        assert list(malloc.values()) == [[None, "268435456", "1"]] * 2


def test_compose_file_parses_and_with_docker_compose_validates():
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert {"s3", "scheduler", "worker", "merge", "seed"} <= set(doc["services"])
    assert doc["services"]["worker"]["deploy"]["replicas"] == 2
    docker = shutil.which("docker")
    if docker and not subprocess.run([docker, "compose", "version"], capture_output=True).returncode:
        compose = [docker, "compose"]
    elif shutil.which("docker-compose"):
        compose = [shutil.which("docker-compose")]
    else:
        pytest.skip("neither docker compose nor docker-compose on this machine")
    subprocess.run([*compose, "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"], check=True)


@pytest.mark.integration
def test_dockerfile_install_steps_work_in_a_fresh_venv(tmp_path):
    text = (DEPLOY / "Dockerfile").read_text()
    steps = re.search(r"# install-steps: begin[^\n]*\n(.*?)# install-steps: end", text, re.S).group(1)
    command = steps.removeprefix("RUN ").replace("\\\n", " ").replace("/src", str(ROOT))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "-c", command.replace("python ", f"{venv / 'bin' / 'python'} ", 1)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tracefuse 0." in done.stdout
    assert (venv / "bin" / "tracefuse").exists()


@pytest.mark.integration
def test_skip_if_unchanged_flow(client, tmp_path, capsys):
    inputs = tmp_path / "in"
    ev = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]
    for r in range(3):
        write_trace(inputs / f"rank{r}.json", make_trace(r, ev, world_size=3))
    out = tmp_path / "merged.json"
    argv = ["merge", str(inputs), "-o", str(out), "--skip-if-unchanged", "--summary-json",
            "--scheduler", client.scheduler.address, "--storage-options",
            json.dumps({"s3": {"secret": "very-secret-xyz"}})]

    def run() -> dict:
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    assert run()["status"] == "ok"
    manifest = json.loads((tmp_path / "merged.json.manifest.json").read_text())
    assert [i["size"] for i in manifest["inputs"]] and manifest["version"] and "options" in manifest
    assert "very-secret-xyz" not in (tmp_path / "merged.json.manifest.json").read_text()
    before = out.stat().st_mtime_ns
    unchanged = run()
    assert unchanged["status"] == "unchanged" and out.stat().st_mtime_ns == before
    time.sleep(0.01)
    os.utime(inputs / "rank1.json")  # touched: rebuild
    assert run()["status"] == "ok" and out.stat().st_mtime_ns != before
    assert run()["status"] == "unchanged"
    write_trace(inputs / "rank3.json", make_trace(3, ev, world_size=3))  # added: rebuild
    assert run()["status"] == "ok"
    (inputs / "rank3.json").unlink()  # removed: rebuild
    assert run()["status"] == "ok"
    assert run()["status"] == "unchanged"
    argv.append("--include-pyfunc")  # other options: rebuild
    assert run()["status"] == "ok"


@pytest.mark.integration
def test_skip_if_unchanged_rebuilds_a_deleted_output(client, tmp_path):
    write_trace(tmp_path / "in" / "rank0.json", make_trace(0, [{"ph": "X", "name": "a", "pid": 1, "tid": 1,
                                                                 "ts": 1.0, "dur": 1.0}]))
    out = tmp_path / "m.json"
    assert merge_traces(str(tmp_path / "in"), str(out), client=client, skip_if_unchanged=True).status == "ok"
    out.unlink()
    assert merge_traces(str(tmp_path / "in"), str(out), client=client, skip_if_unchanged=True).status == "ok"
    assert out.exists()


@pytest.mark.integration
def test_dask_scheduler_address_from_the_environment(scheduler_file, tmp_path, monkeypatch):
    address = json.loads(Path(scheduler_file).read_text())["address"]
    write_trace(tmp_path / "in" / "rank0.json", make_trace(0, [{"ph": "X", "name": "a", "pid": 1, "tid": 1,
                                                                 "ts": 1.0, "dur": 1.0}]))
    import dask

    with dask.config.set({"scheduler-address": address}):  # what DASK_SCHEDULER_ADDRESS sets
        assert main(["merge", str(tmp_path / "in"), "-o", str(tmp_path / "m.json"), "-q"]) == 0
    assert (tmp_path / "m.json").exists()
