"""The loss plot: the book's two curves against steps, and tokens seen on a second x-axis."""

import matplotlib.figure

from gptkiln.plots import plot_losses


def test_plot_has_both_curves_and_a_tokens_seen_axis(tmp_path, monkeypatch):
    saved = []
    savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    rows = [
        dict(step=s, tokens=s * 768, train_loss=4.0 - s / 100, val_loss=None if s % 20 else 4.1)
        for s in range(10, 110, 10)
    ]
    plot_losses(rows, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = saved
    steps_ax, tokens_ax = fig.axes
    assert [line.get_label() for line in steps_ax.lines] == ["Training loss", "Validation loss"]
    assert list(steps_ax.lines[1].get_xdata()) == [20, 40, 60, 80, 100]  # rows with a val loss
    assert (steps_ax.get_xlabel(), tokens_ax.get_xlabel()) == ("Steps", "Tokens seen")
    assert tokens_ax.get_xlim()[1] >= 100 * 768 > steps_ax.get_xlim()[1]
