"""Plot helpers shared by every figure ropescale writes (harness reports, inspect, training log).

matplotlib is imported on first use with the non-interactive Agg backend, so library imports and
runs without a display stay cheap.
"""

from __future__ import annotations

__all__ = ["legend", "line_style", "mark_train", "pyplot", "save_figure"]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_style(i: int, n: int) -> dict:
    """Distinct colour, marker and dash for line ``i`` of ``n``, so lines that coincide stay visible."""
    import matplotlib

    colors = matplotlib.colormaps["tab10" if n <= 10 else "tab20"].colors
    return {"color": colors[i % len(colors)], "marker": "osD^vP*X"[i % 8],
            "ls": ["-", "--", "-.", ":"][i // 2 % 4], "ms": 5}


def legend(ax, n: int) -> None:
    """A legend for ``n`` lines, kept off the data when there are many."""
    if n > 6:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=8)


def mark_train(ax, train: int | None) -> None:
    """A dashed vertical line at the training window T [tokens] (x axis in tokens)."""
    if train:
        ax.axvline(train, color="grey", ls="--", lw=1)
        ax.annotate("training window", (train, 1), xycoords=("data", "axes fraction"),
                    xytext=(4, -12), textcoords="offset points", fontsize=8, color="grey")


def save_figure(fig, path, *, layout: bool = True, rect: tuple | None = None, bbox_tight: bool = False) -> None:
    """Lay out ``fig`` (``tight_layout``, within ``rect`` when given; not with ``layout=False``: a figure
    with a colour bar), write it to ``path`` (PNG, 120 dpi; cropped to its content with ``bbox_tight``)
    and free it: how every figure ropescale writes is finished."""
    if layout:
        fig.tight_layout(**({"rect": rect} if rect is not None else {}))
    fig.savefig(path, dpi=120, **({"bbox_inches": "tight"} if bbox_tight else {}))
    pyplot().close(fig)
