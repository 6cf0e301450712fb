"""``python -m gptkiln.evaluate ...``: the harness's own command line with the ``gptkiln`` model
registered (`tasks.main`)."""

from gptkiln.evaluate.tasks import main

main()
