"""``gptkiln train --nproc N``: torchrun's elastic agent in this process, and one report.

Launched by hand (``torchrun --nproc-per-node N -m gptkiln train ...``) every rank prints its
own errors and torchrun ends with its failure summary and a traceback of its own. Launched with
``--nproc``, the same agent runs here instead, and what the user sees is:

- rank 0's output, live, as in a one-process run (the other ranks print nothing that is not a
  failure of their own: training logs come from rank 0 alone);
- a bad-input error once, not once per rank: each rank leaves its error line in a folder this
  process gives it (`ERRORS_ENV`), rank 0 also prints it, and the others' lines are printed
  here only if they differ from rank 0's;
- for a rank that crashed or was killed, one line that names it; its traceback, if any, is
  already above;
- exit code 2 when every failed rank failed on bad input, 130 for Ctrl-C, 1 otherwise (a rank
  that lost its peers says so in one line, with exit code 1).

Each worker gets ``OMP_NUM_THREADS`` = cores / N unless it is set (torchrun's own default is 1
thread per process, whatever the machine).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

ERRORS_ENV = "GPTKILN_LAUNCH_ERRORS"


def report_error(line: str) -> bool:
    """Leave a worker's error line for the launcher; True when it will print it (ranks above
    0 under `launch`), so this process should not."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder:
        return False
    rank = int(os.environ.get("RANK", "0"))
    try:
        (Path(folder) / f"rank{rank}.txt").write_text(line + "\n", encoding="utf-8")
    except OSError:
        return False
    return rank != 0


def quiet_on_interrupt() -> bool:
    """Ctrl-C reaches every rank; under `launch` only the launcher says so."""
    return ERRORS_ENV in os.environ


def launch(nproc: int, args: list[str], command: str = "train") -> int:
    """Run ``python -m gptkiln ARGS`` as ``nproc`` processes on this machine (torchrun
    --standalone); the exit code for this process."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the agent's own "failed (exitcode: 2)" log line: the report below replaces it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # ... and its "Received 2 death signal, shutting down workers" on Ctrl-C
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    argv = ["--standalone", f"--nproc-per-node={nproc}", "-m", "gptkiln", *args]
    with tempfile.TemporaryDirectory(prefix="gptkiln-launch-") as folder:
        os.environ[ERRORS_ENV] = folder
        try:
            run(parse_args(argv))
        except ChildFailedError as e:
            return _report(e.failures, _lines(Path(folder)), command)
        except SignalException as e:  # the agent has already stopped the workers
            if e.sigval == signal.SIGINT:  # said with rank 0's words (where its checkpoint is)
                raise KeyboardInterrupt(_lines(Path(folder)).get(0, "")) from None
            print(f"gptkiln {command}: stopped by {e.sigval.name}", file=sys.stderr)
            return 128 + int(e.sigval)
        finally:
            del os.environ[ERRORS_ENV]
    return 0


def _lines(folder: Path) -> dict[int, str]:
    """The error line each rank left, by rank."""
    lines = {}
    for path in folder.glob("rank*.txt"):
        lines[int(path.stem.removeprefix("rank"))] = path.read_text(encoding="utf-8").strip()
    return lines


def _report(failures: dict, lines: dict[int, str], command: str) -> int:
    """Print what the user has not seen yet; the exit code for the whole job."""
    # When one rank fails, the agent ends the others with SIGTERM: that is not news.
    failed = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    shown = {lines[0]} if 0 in lines else set()  # rank 0 printed its own line
    for rank, failure in sorted(failed.items()):
        code = failure.exitcode
        if rank in lines:  # its one line (bad input: 2; a run stopped from outside: 1)
            if lines[rank] not in shown:
                print(lines[rank], file=sys.stderr)
                shown.add(lines[rank])
        elif code < 0:
            why = " (out of memory, or killed by hand)" if code == -signal.SIGKILL else ""
            print(
                f"gptkiln {command}: error: rank {rank} (pid {failure.pid}) was killed by "
                f"{failure.signal_name()}{why}",
                file=sys.stderr,
            )
        elif code != 130:
            print(
                f"gptkiln {command}: error: rank {rank} (pid {failure.pid}) exited with code "
                f"{code}; its output is above",
                file=sys.stderr,
            )
    codes = {f.exitcode for f in failed.values()}
    if codes == {2}:
        return 2
    if codes == {130}:
        print(f"gptkiln {command}: interrupted", file=sys.stderr)
        return 130
    return 1
