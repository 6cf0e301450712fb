"""The training loop's time: seconds trained over all of a run's resumes against its budget
(``--max-time``), and the tokens per second it reports.

Both take durations the loop measured (it reads `gptkiln.train.loop.now` before and after each
step), so they hold no clock of their own.
"""

from __future__ import annotations

from gptkiln import distributed as dist_utils


class TrainingClock:
    """Seconds spent in the training loop, over all of a run's resumes (saved with each
    checkpoint), against the run's time budget.

    Args:
        max_time: the budget in minutes (``cfg.max_time``); None: the run ends by its steps.
        world: this process's rank; with a budget, every rank takes the slowest rank's clock.
    """

    def __init__(self, max_time: float | None, world: dist_utils.World) -> None:
        self.budget_s = None if max_time is None else max_time * 60
        self.world = world
        self.seconds = 0.0  # what trainer_state.pt calls train_seconds
        self.step_seconds = 0.0  # the last step's, to foresee where the next one ends

    def out_of_time(self) -> bool:
        return self.budget_s is not None and self.seconds >= self.budget_s

    def time_used(self) -> float:
        """The budget spent by the end of the step about to run, as the last step took, 0 to
        1 and past (0.0 without a budget): the schedule's ``time_used``. Foreseen, so that the
        step that ends past the budget, the run's last, has the schedule's end (``min_lr``)."""
        if self.budget_s is None:
            return 0.0
        return (self.seconds + self.step_seconds) / self.budget_s

    def record(self, seconds: float, step_seconds: float | None = None) -> None:
        """Record ``seconds`` of training so far (evaluations, samples and checkpoints
        included), and how long the last step took. With a time budget, every rank takes the
        slowest rank's clock, so all agree on the learning rate and on the last step."""
        if self.budget_s is not None:
            seconds = dist_utils.all_reduce_max(seconds, self.world)
            if step_seconds is not None:
                step_seconds = dist_utils.all_reduce_max(step_seconds, self.world)
        self.seconds = seconds
        if step_seconds is not None:
            self.step_seconds = step_seconds


class Speedometer:
    """Tokens per second: the first timed step's, then a moving average (0.9 of the old, 0.1 of
    the new step's); None until a step is timed.

    Args:
        compiling: the next step compiles the model (``--compile``): its time is no measure of
            speed, so it is left out.
    """

    def __init__(self, compiling: bool) -> None:
        self.compiling = compiling
        self.tokens_per_s: float | None = None

    def add(self, tokens: int, seconds: float) -> bool:
        """Count a step that read ``tokens`` in ``seconds``; whether it was the compiling step
        (left out)."""
        if self.compiling:
            self.compiling = False
            return True
        if self.tokens_per_s is None:
            self.tokens_per_s = tokens / seconds
        else:
            self.tokens_per_s = 0.9 * self.tokens_per_s + 0.1 * tokens / seconds
        return False
