"""Every command's ``--help``, byte for byte as recorded in tests/golden/help/ (COLUMNS=100).

The help is what a person reads first, so a change to it should be one someone meant: a flag
moved between modules, a shared flag's wording or a reordering shows up here, naming the command.
File names are the command path with spaces as underscores (``gptkiln_train.txt``). After an
intended change, rewrite the files with ``python tests/test_cli_golden.py --update`` and review
the diff. (argparse's layout is Python's: the files were made with Python 3.11.)
"""

import argparse
import difflib
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden" / "help"


def helps() -> dict[str, str]:
    """{command path: its help} for the top-level parser and every subparser, as a terminal of
    100 columns prints them. Set COLUMNS before calling: argparse reads it per formatter."""
    from gptkiln.cli import build_parser

    found = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        found[path] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")

    walk(build_parser(), "gptkiln")
    return found


def golden_file(path: str) -> Path:
    return GOLDEN / (path.replace(" ", "_") + ".txt")


COMMANDS = sorted(p.stem.replace("_", " ") for p in GOLDEN.glob("*.txt"))


@pytest.fixture
def columns_100(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("FORCE_COLOR", raising=False)  # Python 3.14's argparse colours on request
    monkeypatch.setenv("NO_COLOR", "1")


def test_every_command_has_a_golden_help_and_every_golden_help_a_command(columns_100):
    made = set(helps())
    assert made - set(COMMANDS) == set(), "a new command: record its help (--update)"
    assert set(COMMANDS) - made == set(), "a command's help is recorded but it is gone"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_exactly_as_recorded(command, columns_100):
    expected = golden_file(command).read_text(encoding="utf-8")
    actual = helps().get(command)
    assert actual is not None, f"{command}: no such command any more"
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                actual.splitlines(keepends=True),
                fromfile=str(golden_file(command)),
                tofile=f"{command} --help now",
            )
        )
        pytest.fail(f"'{command} --help' differs from its golden file:\n{diff}")


def test_building_every_help_imports_no_torch():
    """`gptkiln --help` answers at once: the parser and its helps come from modules that import
    neither torch, numpy nor tiktoken (each command imports its library when it runs)."""
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_cli_golden import helps\n"
        "assert len(helps()) > 10\n"
        "print(sorted(m for m in ('torch', 'numpy', 'tiktoken') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


if __name__ == "__main__":  # python tests/test_cli_golden.py --update
    import os

    if sys.argv[1:] != ["--update"]:
        raise SystemExit("usage: python tests/test_cli_golden.py --update")
    os.environ["COLUMNS"] = "100"
    os.environ["NO_COLOR"] = "1"
    for command, text in helps().items():
        golden_file(command).write_text(text, encoding="utf-8")
        print(f"wrote {golden_file(command)}")
