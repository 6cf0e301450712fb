"""The arithmetic a run trains in: ``--precision auto`` resolved once, at the start of a run, to
``"fp32"`` or ``"bf16"`` (autocast; the weights and AdamW stay fp32), and kept on resume.

``auto``: bf16 on CUDA; on a CPU with AMX or AVX512-BF16, bf16 when a short measurement of this
model's own training step (forward and backward, eager) says it is faster by `MARGIN` at least,
fp32 otherwise; fp32 on every other device. Measured, not assumed: AMX makes a 124M step ~1.7x
faster, while on small models the casts cost more than the bf16 matmuls save, and the same model
can fall either side on two chips. The measurement runs eager, for a ``--compile`` run too
(compiling both to time them would take longer than most runs), so it may miss a gain that only
compiled code shows: pass ``--precision bf16`` there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gptkiln import distributed as dist_utils
from gptkiln.devices import cpu_bf16_features

MARGIN = 1.10
"""How much faster a bf16 step must measure for ``auto`` to choose it: below that, the gain is
within the measurement's noise and not worth bf16's coarser rounding."""

Loss = Callable[[Callable, torch.Tensor, torch.Tensor], torch.Tensor]
"""A task's ``training_loss(forward, x, y)``."""

MEASURE_ROW = 32
"""Positions per measured row (fewer when the context is shorter)."""

MEASURE_ROWS = (1, 4)
"""The two sizes measured, in rows: a step's time is a cost per step (autocast casts every
weight in each forward, and its gradient back) plus a cost per token (the matmuls), so two
sizes predict the step of the run's own micro-batch, too long to time itself (a 124M step of
8 x 1024 tokens takes half a minute on two cores), where a single small one would overstate the
casts."""

MEASURE_SECONDS = 1.0
"""The measurement's budget after one warm-up step of each kind (at least one round runs)."""


@dataclass(frozen=True)
class PrecisionChoice:
    """What a run trains in (``"fp32"`` or ``"bf16"``) and why, as the run's first line says."""

    precision: str
    reason: str

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    def line(self) -> str:
        return f"precision: {self.precision} ({self.reason})"


def static_precision(device: str) -> str:
    """``auto`` without a measurement: bf16 on CUDA, fp32 elsewhere (what a checkpoint written
    before the choice was recorded trained with)."""
    return "bf16" if device.split(":")[0] == "cuda" else "fp32"


def choose_precision(
    requested: str,
    device: str,
    measure: Callable[[], tuple[float, float]],
    features: Callable[[], list[str]] | None = None,
) -> PrecisionChoice:
    """Resolve ``--precision`` for a fresh run.

    Args:
        requested: ``"auto"``, ``"fp32"`` or ``"bf16"`` (the last two are taken as given).
        device: the run's torch device.
        measure: seconds of one training step (fp32, bf16 autocast); called only for ``auto``
            on a CPU with bf16 instructions.
        features: this CPU's bf16 instructions (None: `cpu_bf16_features`).
    """
    if requested != "auto":
        return PrecisionChoice(requested, "as asked (--precision, or the run's recipe)")
    kind = device.split(":")[0]
    if kind == "cuda":
        return PrecisionChoice("bf16", "auto: bf16 autocast on CUDA")
    if kind != "cpu":
        return PrecisionChoice("fp32", f"auto: fp32 on {kind}")
    found = (features or cpu_bf16_features)()
    if not found:
        return PrecisionChoice("fp32", "auto: this CPU has neither AMX nor AVX512-BF16")
    fp32_s, bf16_s = measure()
    speedup = fp32_s / bf16_s
    measured = (
        f"auto: this CPU has {' and '.join(found)}; a training step of this model measured "
        f"{fp32_s * 1e3:.1f} ms in fp32, {bf16_s * 1e3:.1f} ms in bf16 autocast ({speedup:.2f}x)"
    )
    if speedup >= MARGIN:
        return PrecisionChoice("bf16", measured)
    return PrecisionChoice("fp32", f"{measured}; bf16 needs {MARGIN:.2f}x")


def precision_for_run(
    requested: str,
    device: str,
    model: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    world: dist_utils.World,
    loss: Loss | None = None,
) -> PrecisionChoice:
    """`choose_precision` for a fresh run, measuring ``model`` on its first micro-batch
    (``batch``: ``(B, T)`` inputs, or a packed task's ``(B, 2, T)``) with the loss the run
    trains on (``loss``: a task's ``training_loss``; None: the model's own); with several
    processes, bf16 only when every one measured it faster, so that all train alike."""
    x, y = (t.to(device) for t in batch)
    tokens = x.shape[0] * x.shape[-1]
    choice = choose_precision(
        requested, device, lambda: measure_step_seconds(model, x, y, tokens, loss=loss)
    )
    if requested == "auto" and dist_utils.any_rank(not choice.bf16, world) and choice.bf16:
        return PrecisionChoice("fp32", "auto: another process measured bf16 no faster")
    return choice


def resumed_precision(requested: str, saved: str | None, device: str) -> PrecisionChoice:
    """The precision a resumed run trains in: ``auto`` keeps the one its checkpoint recorded
    (measuring again could choose the other, and the run would no longer be the one it would
    have been uninterrupted); ``fp32`` or ``bf16`` are taken as asked."""
    if requested != "auto":
        return PrecisionChoice(requested, "as asked (--precision, or the run's recipe)")
    if saved is None:  # written before choices were recorded: auto was the static rule then
        return PrecisionChoice(static_precision(device), "auto, as this run started (no record)")
    return PrecisionChoice(saved, "kept from the run's start")


def measure_step_seconds(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    tokens: int,
    budget_s: float = MEASURE_SECONDS,
    max_rounds: int = 3,
    loss: Loss | None = None,
) -> tuple[float, float]:
    """Seconds of a forward and backward of ``model`` over a micro-batch of ``tokens`` input
    tokens, (fp32, bf16 autocast), predicted from timed steps of `MEASURE_ROWS` rows of ``x``'s
    first row (cut to `MEASURE_ROW` positions when the targets are per position), or of twice as
    many rows with a task's own ``loss``, which may pair them (DPO's chosen and rejected halves).

    Each of the four (precision, size) steps runs once to warm up (the first calls build
    oneDNN's kernels), then in alternating rounds until ``budget_s`` or ``max_rounds``; the
    fastest of each counts. The run is left as it was: the random generators (dropout draws)
    are restored and the gradients dropped, so a run that measured trains bit for bit like one
    that did not.

    Args:
        model: the model as it trains (not yet wrapped for several processes).
        x: a training batch's inputs, ``(B, T)`` (``(B, 2, T)`` packed), on the model's device.
        y: its targets, ``(B, T)``, or ``(B,)`` for a classifier.
        tokens: input tokens of the run's micro-batch (``batch_size * T``).
        loss: the run's ``training_loss(forward, x, y)``; None: the model's own.
    """
    pairs = 1 if loss is None else 2
    sizes = [_rows(x, y, rows * pairs) for rows in MEASURE_ROWS]
    device_type = x.device.type

    def step(bf16: bool, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            value = model(*batch)[1] if loss is None else loss(model, *batch)
        value.backward()
        return time.perf_counter() - t0

    runs = [(bf16, size) for size in range(len(sizes)) for bf16 in (False, True)]
    best = dict.fromkeys(runs, float("inf"))
    with torch.random.fork_rng(devices=[]):
        for bf16, size in runs:  # warm-up
            step(bf16, sizes[size])
        start = time.perf_counter()
        for _ in range(max_rounds):
            for bf16, size in runs:
                best[bf16, size] = min(best[bf16, size], step(bf16, sizes[size]))
            if time.perf_counter() - start > budget_s:
                break
    for p in model.parameters():
        p.grad = None
    small, large = (s[0].shape[0] * s[0].shape[-1] for s in sizes)

    def predicted(bf16: bool) -> float:
        t_small, t_large = best[bf16, 0], best[bf16, 1]
        per_token = max(t_large - t_small, 0.0) / (large - small)  # noise may make it < 0
        return t_small + per_token * (tokens - small)

    return predicted(False), predicted(True)


def _rows(x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` copies of the batch's first row (its first `MEASURE_ROW` positions when the
    targets are per position; a classifier's row is kept whole, its label with it)."""
    x, y = x[:1], y[:1]
    if y.dim() > 1:
        x, y = x[..., :MEASURE_ROW], y[..., :MEASURE_ROW]
    return x.repeat(rows, *([1] * (x.dim() - 1))), y.repeat(rows, *([1] * (y.dim() - 1)))
