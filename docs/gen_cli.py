"""Write docs/reference/cli.md, the command-line reference, from the parser itself: every command's ``--help`` as
``tracefuse`` prints it. ``python docs/gen_cli.py`` after changing an option; tests/test_docs.py fails while the
page and the parser differ."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from tracefuse_dask.cli_options import build_parser

PAGE = Path(__file__).parent / "reference" / "cli.md"


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps its help to the terminal: the page is the same on every machine
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    parts = [("# Command line\n\nEvery command's `--help`, as `tracefuse` prints it (this page is generated from the "
             "parser by `docs/gen_cli.py`, and a test fails when the two differ). What the options do in practice "
             "is in the user guide ([Merge a job](../guide/merge.md#all-the-options), [Analyse a job]"
             "(../guide/analyze.md#options), [Compare two runs](../guide/diff.md)); what the exit codes mean, in "
             "[Exit codes and errors](exit-codes.md).\n"),
             f"```text\n$ tracefuse --help\n{parser.format_help()}```\n"]
    for name, command in commands.choices.items():
        parts.append(f"## `tracefuse {name}`\n\n```text\n$ tracefuse {name} --help\n{command.format_help()}```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    PAGE.write_text(render())
