"""Loss curves, as the book's ``plot_losses``: train and validation loss against steps, with a
second x-axis of tokens seen."""

from __future__ import annotations

import os
from collections.abc import Sequence


def plot_losses(rows: Sequence[dict], path: str | os.PathLike) -> None:
    """Draw rows of metrics (step, tokens, train_loss, val_loss) to a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["train_loss"] for r in rows], label="Training loss")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), linestyle="-.", label="Validation loss")
    ax.set_xlabel("Steps")
    ax.set_ylabel("Loss")
    ax.legend(loc="upper right")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    tokens = ax.twiny()  # same curve against tokens seen, on the top axis
    tokens.plot([r["tokens"] for r in rows], [r["train_loss"] for r in rows], alpha=0)
    tokens.set_xlabel("Tokens seen")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
