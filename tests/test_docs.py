"""The documentation (README.md and the site in docs/, mkdocs.yml) cannot rot:

- every command (```` ```console ```` blocks, ``$ `` lines) and every Python example (```` ```pycon ```` blocks,
  doctest's ``>>>``) of the user guide runs as written, page by page in a fresh folder, on the example job the page
  generates itself (or on the traces under ``tests/data/`` that it names, copied into that folder as a clone has
  them), and prints what the page shows (doctest's rules: ``...`` stands for anything, and runs of blanks compare
  equal). A page that names ``s3://`` or ``gs://`` gets a SeaweedFS and a fake-gcs-server with a
  bucket ``traces``, found through the variables a user of such a server sets (``AWS_ENDPOINT_URL``,
  ``STORAGE_EMULATOR_HOST``). A command ending in ``&`` runs in the background until the page ends. A command
  shown in a ```` ```bash ```` block (it needs a cluster or a bucket of your own) must still parse;
- every table and column that an analysis writes is described in reference/outputs.md, and every key of its
  summary.json;
- the README answers the four questions of a new user in one click, and nothing refers to files outside the
  repository;
- the command-line reference is the parser's help, and the site builds with ``mkdocs build --strict`` (broken
  links and anchors fail it).
"""
from __future__ import annotations

import doctest
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import stop_process

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDE = sorted((DOCS / "guide").glob("*.md"))
BLOCK = re.compile(r"^```(console|pycon)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
CHECKER = doctest.OutputChecker()
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def console_steps(body: str) -> list[tuple[str, str]]:
    """The ``$ `` commands of a console block (a line ending in ``\\`` goes on on the next), each with the output
    shown under it."""
    steps: list[tuple[str, str]] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        assert lines[i].startswith("$ "), f"output with no command before it: {lines[i]!r}"
        command = lines[i][2:]
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + lines[i].strip()
        i += 1
        shown = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i])
            i += 1
        steps.append((command, "\n".join(shown).strip("\n") + "\n" if any(shown) else ""))
    return steps


def _servers_env(text: str, request: pytest.FixtureRequest) -> dict[str, str]:
    env = {}
    if "s3://" in text:
        from conftest import S3_KEY, S3_SECRET

        s3 = request.getfixturevalue("s3")
        if not s3.fs().exists("traces"):
            s3.bucket("traces")
        env |= {"AWS_ENDPOINT_URL": s3.url, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    if "gs://" in text:
        gcs = request.getfixturevalue("gcs")
        if not gcs.fs().exists("traces"):
            gcs.bucket("traces")
        env |= {"STORAGE_EMULATOR_HOST": gcs.url}
    return env


@pytest.mark.integration
@pytest.mark.parametrize("page", GUIDE, ids=[p.stem for p in GUIDE])
def test_the_user_guide_runs_as_written(page, tmp_path, monkeypatch, request):
    text = page.read_text()
    blocks = BLOCK.findall(text)
    assert blocks, f"{page.name} has no example to run"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1", "COLUMNS": "120", **_servers_env(text, request)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    for data in sorted(set(re.findall(r"tests/data/(\w+)", text))):
        shutil.copytree(ROOT / "tests" / "data" / data, tmp_path / "tests" / "data" / data)
    background: list[subprocess.Popen] = []
    globs: dict = {"__name__": "__docs__"}
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    try:
        for kind, body in blocks:
            if kind == "pycon":
                test = doctest.DocTestParser().get_doctest(body, globs, page.name, str(page), 0)
                runner.run(test, clear_globs=False)
                assert not runner.failures, f"{page.name}: a Python example printed something else (above)"
                continue
            for command, shown in console_steps(body):
                if command.endswith("&"):
                    background.append(subprocess.Popen(["bash", "-c", command[:-1]], env=env, cwd=tmp_path,
                                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                       start_new_session=True))
                    continue
                done = subprocess.run(["bash", "-c", command], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
                assert done.returncode == 0, f"{page.name}: `{command}` exited {done.returncode}:\n{done.stdout}"
                assert CHECKER.check_output(shown, done.stdout, FLAGS), \
                    f"{page.name}: `{command}` printed\n{done.stdout}\nwhere the page shows\n{shown}"
    finally:
        for proc in background:
            stop_process(proc)


def shown_commands(text: str) -> list[list[str]]:
    """The ``tracefuse`` commands of a page's ```` ```bash ```` blocks (examples that need what a test cannot start:
    a cluster, a cloud bucket), each as its arguments; ``VAR=value`` before a command is left out."""
    import shlex

    commands = []
    for body in re.findall(r"^```bash\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.wordchars += ":,@%+^{}[]"  # URLs and JSON are words; only the shell's operators split
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token in {"&&", "||", "|", ";", "&"}:
                    while words and re.match(r"^\w+=", words[0]):
                        words.pop(0)
                    if words[:1] == ["tracefuse"]:
                        commands.append(words[1:])
                    words = []
                else:
                    words.append(token)
    return commands


@pytest.mark.parametrize("doc", [ROOT / "README.md", *GUIDE], ids=["README", *(p.stem for p in GUIDE)])
def test_every_command_shown_but_not_run_parses(doc):
    """A command the user guide or the README shows without running it (it needs a cluster or a bucket) still
    parses with today's command line: no option renamed or gone under it."""
    from tracefuse_dask.cli_options import build_parser

    for args in shown_commands(doc.read_text()):
        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{doc.name}: `tracefuse {' '.join(args)}` does not parse (above)")


def _rows(text: str) -> set[str]:
    """The first cell of each table row, ``| `name` | ...``."""
    return set(re.findall(r"^\| `([^`]+)` \|", text, re.MULTILINE))


@pytest.mark.integration
def test_every_table_column_and_summary_field_an_analysis_writes_is_described(tmp_path):
    """The example job, with every option that adds a table, analysed by the command line: each table file, each
    of its columns and each key of summary.json has its row in docs/reference/outputs.md."""
    import json

    import pyarrow.parquet as pq

    from tracefuse_dask.cli import main

    assert main(["example", str(tmp_path / "traces"), "--straggler", "5"]) == 0
    assert main(["analyze", str(tmp_path / "traces"), "-o", str(tmp_path / "report"), "-q",
                 "--kernel-sequences", "aten::linear"]) == 0
    sections = _sections(DOCS / "reference" / "outputs.md")
    described = {heading: _rows(body) for heading, body in
                 re.findall(r"^### `([^`]+)`\n(.*?)(?=^### |\Z)", sections["analysis-tables"],
                            re.MULTILINE | re.DOTALL)}
    written = sorted((tmp_path / "report").glob("*.parquet"))
    assert len(written) > 20
    for table in written:
        assert table.stem in described, f"the {table.stem} table is not described in docs/reference/outputs.md"
        missing = set(pq.read_schema(table).names) - described[table.stem]
        assert not missing, f"columns of {table.stem} not described in docs/reference/outputs.md: {sorted(missing)}"
    undescribed = set(json.loads((tmp_path / "report" / "summary.json").read_text())) - _rows(sections["summaryjson"])
    assert not undescribed, f"summary.json fields not described: {sorted(undescribed)}"


QUESTIONS = {  # a new user's question: (the README's link target, what the page must say in that section)
    "how do I merge a bucket": ("docs/guide/merge.md#merge-a-bucket", "tracefuse merge 's3://"),
    "what does exposed_comm_us mean": ("docs/reference/outputs.md#breakdown", "| `exposed_comm_us` |"),
    "how is the critical path computed": ("docs/explanations/critical-path.md#how-the-critical-path-is-computed",
                                          "critical path"),
    "which exit code means a regression": ("docs/reference/exit-codes.md#exit-code-3-a-regression", "3"),
}


def _sections(page: Path) -> dict[str, str]:
    """``{anchor: the text under that heading, up to the next heading of its level or above}``, with the anchors
    MkDocs gives headings (Python-Markdown's ``toc`` slugs)."""
    from markdown.extensions.toc import slugify

    text = page.read_text()
    # a "# comment" in a code block is no heading: blank the blocks where headings are looked for
    blanked = re.sub(r"^```.*?^```", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.MULTILINE | re.DOTALL)
    headings = list(re.finditer(r"^(#+) (.*)$", blanked, re.MULTILINE))
    found = {}
    for i, h in enumerate(headings):
        level = len(h.group(1))
        end = next((later.start() for later in headings[i + 1:] if len(later.group(1)) <= level), len(text))
        found[slugify(re.sub(r"[`*]", "", h.group(2)), "-")] = text[h.end():end]
    return found


def test_every_link_of_the_readme_resolves():
    """GitHub shows the README with its links as they are: each page it links exists, and so does each anchor."""
    readme = (ROOT / "README.md").read_text()
    links = [link for link in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in link]
    assert len(links) > 20
    for link in links:
        path, _, anchor = link.partition("#")
        assert (ROOT / path).is_file(), f"the README links {link}: no such file"
        if anchor and path.endswith(".md"):
            assert anchor in _sections(ROOT / path), f"the README links {link}: {path} has no such heading"


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_readme_answers_a_new_user_s_question_in_one_click(question):
    target, answer = QUESTIONS[question]
    assert f"]({target})" in (ROOT / "README.md").read_text(), f"the README has no link to {target} ({question})"
    path, anchor = target.split("#")
    section = _sections(ROOT / path).get(anchor, "")
    assert answer in section, f"{target} does not say {answer!r} (or has no such heading)"


def test_no_document_refers_to_files_outside_the_repository():
    documents = [ROOT / "README.md", ROOT / "deploy" / "README.md", *DOCS.rglob("*.md")]
    for doc in documents:
        assert "../shared" not in doc.read_text(), f"{doc.relative_to(ROOT)} refers to ../shared"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_command_line_reference_is_the_parser_s_help():
    """docs/reference/cli.md is what docs/gen_cli.py writes from the parser: regenerate it after changing an option
    (``python docs/gen_cli.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    assert gen_cli.PAGE.read_text() == gen_cli.render(), "docs/reference/cli.md is stale: python docs/gen_cli.py"


def test_the_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: every page in the nav, every link and anchor resolved, the API reference
    collected from the docstrings, the command-line reference generated from the parser."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"})
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert all(name in api for name in ("merge_and_save", "merge_traces", "analyze", "index_traces", "query"))
