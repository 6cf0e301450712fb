"""``python -m gptkiln`` (and ``torchrun -m gptkiln``) runs the CLI."""

import sys

from gptkiln.cli import main

code = main()
if "gptkiln.distributed" in sys.modules:  # a torchrun worker may still be in its process group
    from gptkiln.distributed import exit_process

    exit_process(code)
sys.exit(code)
