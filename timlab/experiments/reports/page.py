"""Pieces of the self-contained HTML pages that report, analyze and probe write.

Plots are matplotlib ``Figure`` objects on the Agg canvas, never pyplot, so drawing one does not
touch the global backend of the caller's process; ``png_uri`` embeds a figure as a base64
``data:`` URI. ``STYLE`` is the pages' inline style sheet; ``table`` and ``img`` are the HTML
they are built from. Nothing is fetched when a page is opened.
"""

from __future__ import annotations

import base64
import html
import io
import re

import numpy as np
import pandas as pd

STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1100px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #444; padding-bottom: .2em; }
h2 { margin-top: 2em; border-bottom: 1px solid #bbb; }
table { border-collapse: collapse; font-size: 13px; margin: .5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f0f0f0; } td.l, th.l { text-align: left; }
img { max-width: 100%; display: block; margin: .5em 0 1.5em; }
p.note { color: #555; font-size: 14px; }
div.wide { overflow-x: auto; }
table.fit { table-layout: fixed; width: 100%; font-size: 12px; }
table.fit th, table.fit td { overflow-wrap: anywhere; padding: 2px 4px; }
.rule { background: #f7f7f0; border-left: 4px solid #c9a400; padding: .5em 1em; }
"""


LEGEND_OUTSIDE = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
"""Legend keyword arguments that put it right of the axes, off the data (``png_uri`` saves tight)."""


def new_figure(w: float = 9.0, h: float = 3.6):
    """A matplotlib Figure of w x h inches on its own Agg canvas (pyplot untouched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h))
    FigureCanvasAgg(fig)
    return fig


_SUPERSCRIPTS = str.maketrans("0123456789-\u2212", "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b\u207b")


def plain_math(label: str) -> str:
    """A log axis' mathtext tick label as plain text: ``$\\mathdefault{10^{-2}}$`` -> ``10⁻²``,
    ``$\\mathdefault{2\\times10^{1}}$`` -> ``2×10¹``; any other text is returned unchanged."""
    m = re.fullmatch(r"\$\\mathdefault\{(.*)\}\$", label)
    if m is None:
        return label
    body = m.group(1).replace("\\times", "\u00d7").replace("\\,", "")
    body = re.sub(r"\^\{([^}]*)\}", lambda e: e.group(1).translate(_SUPERSCRIPTS)
                  if re.fullmatch(r"[-\u22120-9]+", e.group(1)) else "^" + e.group(1), body)
    return body.replace("{", "").replace("}", "")


def _plain_ticks(fig) -> None:
    """Wrap each axis' tick formatters that write mathtext (log and symlog axes do) so that they
    write plain text: ``png_uri`` draws every text as written, so ``$\\mathdefault{10^{-2}}$``
    would otherwise show as those characters."""
    from matplotlib.ticker import Formatter, LogFormatterMathtext

    class PlainTicks(Formatter):
        def __init__(self, inner):
            self.inner = inner

        def set_axis(self, axis):
            super().set_axis(axis)
            self.inner.set_axis(axis)

        def set_locs(self, locs):
            self.inner.set_locs(locs)

        def get_offset(self):
            return plain_math(self.inner.get_offset())

        def __call__(self, x, pos=None):
            return plain_math(self.inner(x, pos))

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for get, put in ((axis.get_major_formatter, axis.set_major_formatter),
                             (axis.get_minor_formatter, axis.set_minor_formatter)):
                if isinstance(get(), LogFormatterMathtext):
                    put(PlainTicks(get()))


def png_uri(fig) -> str:
    """The figure as a PNG ``data:`` URI (90 dpi, tight layout). Every text is drawn as written:
    a ``$`` in a run's label or condition name is not matplotlib mathtext (``$\\foo$`` would
    abort the drawing), and log axes label their ticks in plain text (``10⁻²``)."""
    import warnings

    from matplotlib.text import Text

    _plain_ticks(fig)
    for text in fig.findobj(Text):
        text.set_parse_math(False)
    buf = io.BytesIO()
    with warnings.catch_warnings():  # a legend right of the axes is kept by bbox_inches="tight" below
        warnings.filterwarnings("ignore", "Tight layout not applied")
        fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def cell(v) -> str:
    """A table cell's text: yes/no, 3 significant digits, an en dash for NaN/Inf."""
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        return "&ndash;" if not np.isfinite(v) else (f"{int(v)}" if float(v).is_integer() and abs(v) >= 1 else f"{v:.3g}")
    return html.escape(str(v))


def breakable(text: str) -> str:
    """Escaped cell text with a line-break opportunity (``<wbr>``) after each run of ``_``, and after
    ``= , +`` and a ``.`` before a letter, so that a narrow cell breaks a run name between its parts
    (``hold_``/``3e-3_``/``tis_``/``s0__``/``f38214``), not mid-word or mid-number."""
    return re.sub(r"(_+|[=,+]|\.(?=[A-Za-z]))(?=[A-Za-z0-9])", r"\1<wbr>", text)


def table(df: pd.DataFrame, left: tuple[str, ...] = (), *, fit: bool = False) -> str:
    """An HTML table of ``df`` (columns named in ``left`` left-aligned), scrolling when wide; with
    ``fit`` as wide as the page, its cells wrapping (long run names, many columns: the text of a
    ``left`` column between its parts, ``breakable``)."""
    name = (lambda c: str(c).replace("_", " ")) if fit else str
    text = lambda c, v: breakable(cell(v)) if fit and c in left else cell(v)  # noqa: E731
    head = "".join(f'<th class="{"l" if c in left else ""}">{html.escape(name(c))}</th>' for c in df.columns)
    body = "".join(
        "<tr>" + "".join(f'<td class="{"l" if c in left else ""}">{text(c, v)}</td>' for c, v in zip(df.columns, row))
        + "</tr>" for row in df.itertuples(index=False))
    cls = ' class="fit"' if fit else ""
    return f'<div class="wide"><table{cls}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def img(uri: str | None, alt: str) -> str:
    """An embedded image, or a note that no run has data for it (``uri`` None)."""
    if uri is None:
        return '<p class="note"><em>No run has data for this plot.</em></p>'
    return f'<img src="{uri}" alt="{html.escape(alt)}">'


__all__ = ["STYLE", "LEGEND_OUTSIDE", "new_figure", "png_uri", "plain_math", "cell", "table", "img"]
