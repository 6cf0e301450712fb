"""``python -m gptkiln`` (and ``torchrun -m gptkiln``) runs the CLI."""

import sys

from gptkiln.cli import main

sys.exit(main())
