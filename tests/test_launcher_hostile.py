"""Issue 31: hostile input to the launchers and scripts, beyond the recipes' own flags."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

PARSER_CALL = re.compile(r"\b(ArgumentParser|OneLineParser|add_parser)\(")

# Builds every parser of each entry point by asking for its --help (nothing runs), and records each one made
# with the file that made it; the benchmarks are scripts with work at import: they run in this child alone.
RECORD_PARSERS = r"""
import argparse, contextlib, io, json, runpy, sys
from pathlib import Path

repo, entries = Path(sys.argv[1]), json.loads(sys.argv[2])
made = []
init = argparse.ArgumentParser.__init__


def record(self, *args, **kwargs):
    init(self, *args, **kwargs)
    frame = sys._getframe(1)
    while frame.f_code.co_filename == argparse.__file__:  # add_parser: its caller is the maker
        frame = frame.f_back
    made.append((frame.f_code.co_filename, self))


argparse.ArgumentParser.__init__ = record
sys.path.insert(0, str(repo / "benchmarks"))  # their `from common import ...`
probes = {}
for entry, argv, probe in entries:
    sys.argv = [entry, *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        if entry.endswith(".py"):
            runpy.run_path(entry, run_name="__main__")
        else:
            runpy.run_module(entry, run_name="__main__")
    if probe:  # the tokens the parser just made leaves unparsed (nothing runs: parse only)
        probes[entry] = made[-1][1].parse_known_args(probe)[1]
parsers = [[str(Path(file).resolve().relative_to(repo)), parser.prog, parser.allow_abbrev]
           for file, parser in made if Path(file).resolve().is_relative_to(repo)]
print(json.dumps({"parsers": parsers, "probes": probes}))
"""


@pytest.mark.slow
def test_every_parser_refuses_abbreviated_flags():
    """Issue 31 item 13: ``benchmarks/peers.py --round 3`` ran as --rounds 3 and ``acceltrain ray --num-w 0`` as
    --num-workers 0 (argparse's prefix matching), while the recipes refuse ``--max-step``: every parser in
    acceltrain/ and benchmarks/ is built here and must refuse an abbreviation; a new file with a parser fails this
    test until it is listed below."""
    with_parsers = {
        path.relative_to(REPO).as_posix()
        for folder in ("acceltrain", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
        if PARSER_CALL.search(path.read_text())
    }
    peers = str(REPO / "benchmarks" / "peers.py")
    entries = [
        ["acceltrain.commands.cli", ["--help"], None],
        ["acceltrain.commands.cli", ["bench", "--help"], None],
        ["acceltrain.commands.cli", ["ray", "--help"], None],
        ["acceltrain.commands.cli", ["merge", "--help"], None],
        ["acceltrain.commands.cli", ["sweep", "--help"], None],
        ["acceltrain.commands.cli", ["ft-launch", "--help"], None],
        ["acceltrain.recipes.resnet_cifar", ["--help"], None],
        *(
            [str(REPO / path), ["--help"], ["--round", "3"] if str(REPO / path) == peers else None]
            for path in sorted(with_parsers)
            if path.startswith("benchmarks/")
        ),  # a script without a parser would run
    ]
    result = subprocess.run(
        [sys.executable, "-c", RECORD_PARSERS, str(REPO), json.dumps(entries)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    built = {file for file, _, _ in report["parsers"]}
    assert with_parsers <= built, f"parsers not built by this test: {sorted(with_parsers - built)}"
    assert [(file, prog) for file, prog, abbreviations in report["parsers"] if abbreviations] == []
    assert report["probes"] == {peers: ["--round", "3"]}


def test_acceltrain_ray_refuses_an_abbreviated_flag_in_one_line(capsys):
    from acceltrain.commands.cli import main

    assert main(["ray", "--num-w", "0", "recipes/resnet_cifar.py"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: unrecognized arguments: --num-w (did you mean --num-workers?) "
        "(acceltrain ray's flags go before the recipe, the recipe's after it: "
        "acceltrain ray --help)"
    )
