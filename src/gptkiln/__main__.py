"""``python -m gptkiln`` (and ``torchrun -m gptkiln``) runs the CLI."""

from gptkiln.cli import run

run()
