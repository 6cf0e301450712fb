"""How many threads a decode step runs on: every thread asked for, until the machine shows that
fewer would be faster.

A decode step at batch 1 is a few hundred short parallel loops, each ending at a barrier where
every thread waits for the last. When another process keeps one of the cores busy (a training
run beside a `generate`, a laptop's browser), the thread that shares that core is descheduled
for a scheduler slice at a time and every barrier waits for it: on the 2-core EPYC, GPT-2 124M's
100 greedy tokens took 52 s at 2 threads beside a one-thread training run and 5.5 s at 1
thread (CPU-bound 1.8 s alone). llama.cpp's thread pool has the same cliff.

`DecodeThreads` watches each decode step's wall time and the process's CPU time. A step of
``n`` threads on a machine that gives them their cores uses about ``n`` CPU seconds a second
(the waiting threads spin); a step that uses far less was waiting for a thread the machine did
not run. That alone (no timing race, nothing run twice) starts a trial: a few steps at half the
threads, kept where their median step is at least `FASTER` quicker. Back at fewer threads, a
step at more is tried now and then (after 32 steps, then 64, ... up to 1024 while it loses),
and a trial that starts clearly slower ends at its first step.

What it may change is only speed: the decode-step loops give each output to one thread (each
sum in one order whatever the count: `tests/test_cpu_machine.py` holds the logits equal bit for bit
at 1 and 2 threads), and every forward that is not a decode step (a prefill, whose torch
products sum in an order that depends on the count) runs at the full count again.
``GPTKILN_ADAPT_THREADS=0`` keeps the full count throughout (a benchmark's fixed threads).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

ENV = "GPTKILN_ADAPT_THREADS"

WINDOW = 3
"""Decode steps of one count and one batch size looked at together (their median)."""

BUSY = 0.7
"""A window whose CPU time is below this share of threads × wall time was waiting for threads
the machine did not run (a step of n threads alone uses 0.9-1.0 of n: the waiting threads spin
between the loops)."""

FASTER = 0.9
"""A trial's count is kept where its median step takes at most this share of the current's."""

FIRST_RETRY, LAST_RETRY = 32, 1024
"""Steps at fewer threads before more are tried again: the first wait, doubled after each trial
that loses, up to the last."""


class DecodeThreads:
    """The thread count of a plan's decode steps (`count`), moved by what each step took
    (`record`). ``full``: the count asked for (None: torch's, read at the first step);
    ``clock``/``cpu_clock``: wall and process CPU seconds (injectable, for tests); ``apply``:
    sets the count of the process's loops (torch's ``set_num_threads``, which the library's
    loops are given)."""

    def __init__(
        self,
        full: int | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        apply: Callable[[int], None] | None = None,
        get: Callable[[], int] | None = None,
        adapt: bool | None = None,
    ):
        import torch

        self.clock, self.cpu_clock = clock, cpu_clock
        self._apply = apply or torch.set_num_threads
        self._get = get or torch.get_num_threads
        self.full = full
        self.adapt = os.environ.get(ENV) != "0" if adapt is None else adapt
        self.count = full
        self.changes: list[tuple[int, int]] = []
        """(decode step, count) at every change kept, in order: what a caller may report."""
        self._steps = 0
        self._window: list[tuple[float, float]] = []  # (wall, cpu) of the current window's steps
        self._rows: int | None = None  # the batch size of the current window
        self._trial: tuple[int, int, float] | None = None  # (count tried, count before, its median)
        self._at = {"down": 0, "up": 0}  # the decode step from which a trial each way may start
        self._wait = {"down": FIRST_RETRY, "up": FIRST_RETRY}  # how long after one that loses
        self._started: tuple[float, float] | None = None

    def begin_step(self, rows: int) -> None:
        """Before a decode step of ``rows`` rows: the process's loops set to this step's count."""
        if self.full is None:
            self.full = self.count = self._get()
        if rows != self._rows:  # another batch size: another step time, a new window
            self._rows, self._window = rows, []
        self._set(self.count)
        self._started = (self.clock(), self.cpu_clock())

    def end_step(self) -> None:
        """After the step `begin_step` started: its times recorded, the count maybe moved."""
        if self._started is None:
            return
        wall0, cpu0 = self._started
        self._started = None
        self.record(self.clock() - wall0, self.cpu_clock() - cpu0)

    def other_forward(self) -> None:
        """Before a forward that is not a decode step (a prefill): the full count."""
        if self.full is not None:
            self._set(self.full)

    def release(self) -> None:
        """The plan lets go: the process's loops back at the full count."""
        self.other_forward()

    def record(self, wall: float, cpu: float) -> None:
        """One decode step at `count` took ``wall`` seconds and ``cpu`` CPU seconds."""
        self._steps += 1
        if not self.adapt or self.full is None or self.full < 2 or self._steps == 1:
            return  # the first step warms caches and wakes threads: not a measure
        self._window.append((wall, cpu))
        if self._trial is not None:
            if wall > 2 * self._trial[2]:  # clearly slower from its first step: over
                self._end_trial(kept=False)
                return
        if len(self._window) < WINDOW:
            return
        walls = [w for w, _ in self._window]
        median = statistics.median(walls)
        if self._trial is not None:
            self._end_trial(kept=median <= FASTER * self._trial[2])
            return
        busy = sum(c for _, c in self._window) / max(sum(walls), 1e-9) / self.count
        self._window = []
        if self.count > 1 and busy < BUSY and self._steps >= self._at["down"]:
            self._start_trial(max(1, self.count // 2), median)  # threads the machine did not run
        elif self.count < self.full and self._steps >= self._at["up"]:
            self._start_trial(min(self.full, 2 * self.count), median)

    def _start_trial(self, count: int, median: float) -> None:
        self._trial = (count, self.count, median)
        self.count, self._window = count, []

    def _end_trial(self, kept: bool) -> None:
        tried, before, _ = self._trial
        way, back = ("up", "down") if tried > before else ("down", "up")
        self._trial, self._window = None, []
        if kept:  # the way back may be tried: at once after more threads, later after fewer
            self.count = tried
            self.changes.append((self._steps, tried))
            self._wait[back] = FIRST_RETRY
            self._at[back] = self._steps + (FIRST_RETRY if back == "up" else 0)
        else:  # this way again only after a wait, twice as long each time it loses
            self.count = before
            self._at[way] = self._steps + self._wait[way]
            self._wait[way] = min(2 * self._wait[way], LAST_RETRY)

    def _set(self, count: int) -> None:
        if self._get() != count:
            self._apply(count)
