"""The pictures gptkiln draws, with matplotlib (imported when a picture is drawn):

- ``plot_metric`` (the book's ``plot_values``) and ``plot_losses``: a metric on the training and
  validation sets against steps, with a second x-axis of tokens seen;
- ``plot_attention``: attention weights as heat-maps, a panel per layer and head, with token
  labels in a font that has their glyphs (``label_fonts``);
- ``plot_matrices``: small annotated matrices, the book's chapter-3 printouts as pictures.
"""

from __future__ import annotations

import functools
import math
import os
import re
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def check_png_path(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as the PNG to write, or one line saying why it cannot be one: an extension
    other than .png (matplotlib would refuse it, or add .png to a path without one, so the file
    would not be where it was said to be), or a directory there."""
    from gptkiln.errors import GptkilnError

    path = Path(path)
    if path.is_dir():
        raise GptkilnError(
            f"{flag} {path} is a directory; give a file to write, e.g. {path / 'attention.png'}"
        )
    if path.suffix.lower() != ".png":
        raise GptkilnError(f"{flag} {path}: the picture is a PNG; give a path ending in .png")
    return path


def plot_losses(rows: Sequence[dict], path: str | os.PathLike) -> None:
    """Draw rows of metrics (step, tokens, train_loss, val_loss) to a PNG at ``path``."""
    plot_metric(rows, path, "loss")


def plot_metric(
    rows: Sequence[dict],
    path: str | os.PathLike,
    metric: str = "loss",
    beside: Sequence[str] = (),
) -> None:
    """Draw ``train_METRIC`` and ``val_METRIC`` of rows of metrics (with ``step`` and
    ``tokens``) to a PNG at ``path``; called ``plot_values`` in the book's chapter 6.

    ``beside``: other columns (a harness task's ``eval/TASK/METRIC``), drawn against steps in a
    second panel to the right, each from the rows that have it; the panel is left out when none
    of them has a value.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    name = metric.capitalize()
    curves = {
        column: [(r["step"], r[column]) for r in rows if r.get(column) is not None]
        for column in beside
    }
    curves = {column: points for column, points in curves.items() if points}
    if curves:
        fig, (ax, tasks_ax) = plt.subplots(1, 2, figsize=(11, 3.5))
    else:
        fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in rows]
    train = [r.get(f"train_{metric}") for r in rows]
    ax.plot(steps, train, label=f"Training {metric}")
    val = [(r["step"], r[f"val_{metric}"]) for r in rows if r.get(f"val_{metric}") is not None]
    if val:
        ax.plot(*zip(*val), linestyle="-.", label=f"Validation {metric}")
    ax.set_xlabel("Steps")
    ax.set_ylabel(name)
    ax.legend(loc="upper right" if metric == "loss" else "lower right")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    tokens = ax.twiny()  # same curve against tokens seen, on the top axis
    tokens.plot([r["tokens"] for r in rows], train, alpha=0)
    tokens.set_xlabel("Tokens seen")
    if curves:
        for column, points in curves.items():
            label = column.removeprefix("eval/")
            tasks_ax.plot(*zip(*points), marker="o", markersize=3, label=label)
        values = [v for points in curves.values() for _, v in points]
        if min(values) > 0 and max(values) > 100 * min(values):  # perplexities beside accuracies
            tasks_ax.set_yscale("log")
        tasks_ax.set_xlim(ax.get_xlim())  # the same steps under both panels
        tasks_ax.set_xlabel("Steps")
        tasks_ax.set_ylabel("Task metric")
        tasks_ax.set_title("lm-evaluation-harness tasks", fontsize=9)
        tasks_ax.legend(fontsize=7, loc="best")
        tasks_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    from gptkiln.checkpoint import atomic_write  # a run's file: never left half-written

    suffix = Path(path).suffix.lstrip(".") or "png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format=suffix))
    plt.close(fig)


# -- attention heat-maps ---------------------------------------------------------------------
INCH_PER_TOKEN = 0.17
"""Room per query row / key column: one 8-point tick label per token."""
MIN_PANEL_INCHES = 1.6
MAX_PANEL_INCHES = 10.0
"""A panel past 10 inches labels every n-th token instead of growing (about 58 labels)."""
MAX_GRID_INCHES = 36.0
"""A layers x heads grid wider or taller than this becomes one figure per layer."""
MAX_LABEL_CHARS = 14
FUTURE_COLOR = "#e4e4e4"  # the masked future: light grey, apart from every colour of a weight
CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Source Han Sans SC",
    "Noto Sans SC",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Noto Sans CJK JP",
    "Noto Sans CJK TC",
    "Source Han Sans",
    "Droid Sans Fallback",
    "AR PL UMing CN",
    "Microsoft YaHei",
    "SimHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "Arial Unicode MS",
)
"""Fonts with Chinese glyphs, the first found is used (Debian: fonts-noto-cjk, fonts-wqy-zenhei;
Windows and macOS ship the last ones)."""
_CJK_FILES = re.compile(
    r"NotoSans(Mono)?CJK|SourceHanSans|NotoSans(SC|TC)|wqy-?(zenhei|microhei)|"
    r"DroidSansFallback|uming|msyh|simhei|PingFang|Hiragino Sans GB|Arial Unicode",
    re.IGNORECASE,
)


def plot_attention(
    weights,
    labels: Sequence[str],
    path: str | os.PathLike,
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str = "",
    on_notice: Callable[[str], None] | None = None,
    kv_heads: int | None = None,
) -> list[Path]:
    """Draw attention weights as heat-maps, one panel per (layer, head), into PNG file(s).

    Query tokens run down each panel, key tokens across, the masked future (above the
    diagonal) in grey. All panels share one colour scale, 0 to 1. The panels make one figure at
    ``path`` while a layers x heads grid stays under `MAX_GRID_INCHES` on each side; past that,
    one figure per layer, written to ``path`` with ``-layerN`` before its suffix (and
    ``on_notice`` is told).

    Args:
        weights: (L, nh, T, T) attention weights (a tensor or an array).
        labels: T token labels (``gptkiln.inspect.token_labels``).
        layers, heads: which to draw (default: all); each panel is titled with its numbers.
        title: a line above the panels (the prompt, say).
        on_notice: told, in one line, of anything a person should know about the picture.
        kv_heads: the model's key/value heads, when fewer than its query heads (grouped-query
            attention): each panel is still one query head's map, titled with the key/value
            head it reads (``head 3 · kv 1``); the heads of a group share their keys, not
            their maps.

    Returns:
        The files written.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    families, shown, note = label_fonts([*labels, title])
    if note and on_notice:
        on_notice(note)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    with matplotlib.rc_context({"font.family": families}):
        figures = attention_figures(
            weights, [shown(s) for s in labels], layers, heads, shown(title), on_notice, kv_heads
        )
        for fig, suffix in figures:
            out = path.with_name(f"{path.stem}{suffix}{path.suffix}") if suffix else path
            fig.savefig(out, dpi=100)
            plt.close(fig)
            written.append(out)
    return written


def attention_figures(
    weights,
    labels: Sequence[str],
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str = "",
    on_notice: Callable[[str], None] | None = None,
    kv_heads: int | None = None,
) -> list[tuple[Any, str]]:
    """The figures `plot_attention` saves, as (matplotlib Figure, file-name suffix) pairs; the
    suffix is ``""`` for the single figure, ``"-layerN"`` for one of several."""
    import numpy as np

    weights = np.asarray(weights, dtype=np.float32)  # (L, nh, T, T)
    layers = list(range(weights.shape[0])) if layers is None else list(layers)
    heads = list(range(weights.shape[1])) if heads is None else list(heads)
    T = weights.shape[-1]
    group = weights.shape[1] // kv_heads if kv_heads else 1  # query heads per key/value head
    side = min(max(INCH_PER_TOKEN * T, MIN_PANEL_INCHES), MAX_PANEL_INCHES)
    panels = [[(layer, head) for head in heads] for layer in layers]  # rows of (layer, head)
    if len(layers) == 1 or len(heads) == 1:  # a single row or column: wrap it near square
        panels = _wrap([p for row in panels for p in row])
    elif max(len(layers), len(heads)) * side > MAX_GRID_INCHES:
        if on_notice:
            on_notice(
                f"{len(layers)} layers x {len(heads)} heads of {T} tokens would be "
                f"{len(heads) * side:.0f} x {len(layers) * side:.0f} inches: one figure per "
                "layer instead (or pick one with --layer, or fewer tokens with --max-tokens)"
            )
        return [
            (
                _attention_figure(weights, labels, _wrap(row), side, title, group),
                f"-layer{row[0][0]}",
            )
            for row in panels
        ]
    return [(_attention_figure(weights, labels, panels, side, title, group), "")]


def _wrap(panels: list) -> list[list]:
    """A list of panels as rows of a near-square grid."""
    ncols = math.ceil(math.sqrt(len(panels)))
    return [panels[i : i + ncols] for i in range(0, len(panels), ncols)]


def _attention_figure(weights, labels, grid, side, title, group=1):
    """One figure: a panel per (layer, head) of ``grid`` (rows of pairs), one colour bar; with
    ``group`` > 1 query heads per key/value head, each panel names the one its head reads."""
    import matplotlib.pyplot as plt

    T = len(labels)
    nrows, ncols = len(grid), max(len(row) for row in grid)
    longest = min(MAX_LABEL_CHARS, max(len(s) for s in labels))
    margin = 0.5 + 0.08 * longest  # inches for the tick labels
    fig = plt.figure(
        figsize=(ncols * side + margin + 1.2, nrows * (side + 0.3) + margin + 0.9),
        layout="constrained",
    )
    axes = fig.subplots(nrows, ncols, squeeze=False)
    every = math.ceil(T * INCH_PER_TOKEN / side)  # label every n-th token past MAX_PANEL_INCHES
    image = None
    for r in range(nrows):
        for c in range(ncols):
            ax = axes[r][c]
            if c >= len(grid[r]):
                ax.set_axis_off()
                continue
            layer, head = grid[r][c]
            name = f"layer {layer} · head {head}" + (f" · kv {head // group}" if group > 1 else "")
            image = draw_heatmap(ax, weights[layer, head], labels, name, every=every)
            below = r + 1 < nrows and c < len(grid[r + 1])  # a panel under this one
            if below:
                ax.tick_params(labelbottom=False)
            else:
                ax.set_xlabel("key (attended to)", fontsize=7)
            if c:
                ax.tick_params(labelleft=False)
            else:
                ax.set_ylabel("query", fontsize=7)
    sub = "rows: each token as a query; columns: the tokens it attends to; grey: the future"
    # wrapped to the figure's width (~0.075 inch a character at 9 points): one panel is narrow
    chars = max(24, int(fig.get_figwidth() / 0.075))
    lines = [textwrap.fill(t, chars) for t in ((title, sub) if title else (sub,))]
    fig.suptitle("\n".join(lines), fontsize=9)
    if every > 1:
        fig.supxlabel(f"(every {every}th token labelled)", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=min(1.0, 4 / (nrows * side)), label="attention weight")
    return fig


def draw_heatmap(
    ax,
    matrix,
    labels: Sequence[str],
    title: str,
    *,
    causal: bool = True,
    vmin: float = 0.0,
    vmax: float = 1.0,
    annotate: bool = False,
    every: int = 1,
):
    """One square matrix as a heat-map on ``ax``: rows (queries) down, columns (keys) across,
    a tick label per token (every ``every``-th); with ``causal``, the entries above the
    diagonal grey (masked, not weights); with ``annotate``, each value written in its cell."""
    import matplotlib.pyplot as plt
    import numpy as np

    matrix = np.asarray(matrix, dtype=np.float64)
    T = matrix.shape[0]
    shown = np.ma.masked_where(np.triu(np.ones((T, T), bool), 1), matrix) if causal else matrix
    cmap = plt.get_cmap("viridis").with_extremes(bad=FUTURE_COLOR)
    image = ax.imshow(shown, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ticks = list(range(0, T, every))
    names = [_short(labels[i]) for i in ticks]
    ax.set_xticks(ticks, names, rotation=90, fontsize=8)
    ax.set_yticks(ticks, names, fontsize=8)
    ax.tick_params(length=2, pad=1)
    ax.set_title(title, fontsize=8)
    if annotate:
        for i in range(T):
            for j in range(T):
                if causal and j > i:
                    continue
                light = (matrix[i, j] - vmin) / ((vmax - vmin) or 1) > 0.6
                ax.text(
                    j,
                    i,
                    f"{matrix[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if light else "white",
                )
    return image


def _short(label: str) -> str:
    return label if len(label) <= MAX_LABEL_CHARS else label[: MAX_LABEL_CHARS - 1] + "…"


def plot_matrices(
    panels: Sequence[tuple[str, Any, bool]],
    labels: Sequence[str],
    path: str | os.PathLike,
    *,
    title: str = "",
    ncols: int = 2,
) -> Path:
    """Small square matrices side by side, each value written in its cell (the book's
    chapter-3 printouts as pictures). ``panels``: (title, (T, T) matrix, causal) each; each
    panel has its own colour scale, from its smallest to its largest value. The folder of
    ``path`` is created if needed; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nrows = math.ceil(len(panels) / ncols)
    side = max(2.6, 0.45 * len(labels))
    fig = plt.figure(figsize=(ncols * side + 0.6, nrows * side + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (name, matrix, causal) in zip(axes, panels):
        matrix = np.asarray(matrix, dtype=np.float64)
        seen = matrix[np.tril_indices(len(matrix))] if causal else matrix
        draw_heatmap(
            ax,
            matrix,
            labels,
            name,
            causal=causal,
            vmin=min(0.0, seen.min()),
            vmax=seen.max(),
            annotate=True,
        )
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- fonts for token labels ------------------------------------------------------------------
def label_fonts(texts: Sequence[str]) -> tuple[list[str], Callable[[str], str], str | None]:
    """The font families to draw ``texts`` with, a function that makes a text safe to draw,
    and a note when some characters have no glyph.

    matplotlib's default font (DejaVu Sans) has no Chinese; when a text needs glyphs it lacks,
    the first installed font of `CJK_FAMILIES` is added after it as a fallback (found in
    matplotlib's font list, or among the system's font files when it was installed after that
    list was cached). Characters no font has are drawn as ``\\uXXXX`` escapes rather than empty
    boxes, and the note says which font to install. The safe text also escapes ``$``, which
    matplotlib would otherwise read as the start of a formula.
    """
    from matplotlib import font_manager

    base = font_manager.findfont(font_manager.FontProperties())
    families = [font_manager.get_font(base).family_name]
    covered = set(_charmap(base))
    needed = {ch for text in texts for ch in text}
    missing = {ch for ch in needed if ord(ch) not in covered and ch.isprintable()}
    if missing:
        cjk = cjk_font()
        if cjk is not None:
            families.append(cjk[0])
            covered |= set(_charmap(cjk[1]))
            missing = {ch for ch in missing if ord(ch) not in covered}
    note = None
    if missing:
        sample = "".join(sorted(missing)[:8])
        note = (
            f"no installed font has glyphs for {len(missing)} character(s) of the labels "
            f"({sample}{'…' if len(missing) > 8 else ''}); they are drawn as \\u escapes. "
            "Install a CJK font to see them (Debian/Ubuntu: apt-get install fonts-noto-cjk)"
        )

    def shown(text: str) -> str:
        text = "".join(f"\\u{ord(ch):04x}" if ch in missing else ch for ch in text)
        return text.replace("$", r"\$")

    return families, shown, note


@functools.lru_cache(maxsize=1)
def cjk_font() -> tuple[str, str] | None:
    """(family name, file) of an installed font with Chinese glyphs, in its regular weight,
    registered with matplotlib; None when there is none."""
    from matplotlib import font_manager

    for attempt in range(2):
        fonts = font_manager.fontManager.ttflist
        known = {f.name: f.fname for f in fonts if f.weight in (400, "normal", "regular")}
        for family in CJK_FAMILIES:
            if family in known:
                return family, known[family]
        if attempt == 0:  # fonts installed after matplotlib cached its list: register them
            for file in font_manager.findSystemFonts():
                if _CJK_FILES.search(Path(file).name):
                    try:
                        font_manager.fontManager.addfont(file)
                    except (OSError, RuntimeError, ValueError):  # unreadable, or not a font
                        continue
    return None


@functools.lru_cache(maxsize=8)
def _charmap(file: str) -> frozenset[int]:
    """The code points a font file has glyphs for."""
    from matplotlib import font_manager

    return frozenset(font_manager.get_font(file).get_charmap())
