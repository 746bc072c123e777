"""Render a :class:`~pipeline.report.document.Document` as HTML and as Markdown (Jinja2).

The look of the report lives in two templates, package data of ``pipeline.report``:

* ``templates/report.html.j2``: the self-contained page (CSS inline, every figure embedded as
  a base64 ``data:`` URI). Rendered with autoescape, so any text from the inputs (a dataset
  path, a class name, a run id) is shown as text, never interpreted as HTML.
* ``templates/report.md.j2``: the same tables and paragraphs as Markdown, figures linked as
  ``figures/<name>.png``.

Restyling the report means editing a template; no Python changes are needed.
"""

from __future__ import annotations

import base64
from functools import cache
from pathlib import Path

import jinja2

from pipeline.report.document import NOT_AVAILABLE, Document, FigureRef

HTML_TEMPLATE = "report.html.j2"
MARKDOWN_TEMPLATE = "report.md.j2"


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _not_available(text: str) -> bool:
    return NOT_AVAILABLE in text


def md_text(text: str) -> str:
    """Markdown text in which ``&`` and ``<`` cannot start an HTML entity or tag."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;")


def md_cell(text: str) -> str:
    """:func:`md_text` for a table cell: ``|`` escaped, newlines turned into spaces."""
    return md_text(text).replace("|", r"\|").replace("\n", " ")


@cache
def environment() -> jinja2.Environment:
    """The Jinja2 environment of the report templates (autoescape for ``*.html.j2``)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("pipeline.report", "templates"),
        autoescape=jinja2.select_autoescape(  # anything but the Markdown template: escaped
            enabled_extensions=("html.j2",), disabled_extensions=("md.j2",),
            default_for_string=True, default=True,
        ),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.tests["numeric"] = _is_number
    env.tests["not_available"] = _not_available
    env.filters["md"] = md_text
    env.filters["md_cell"] = md_cell
    return env


def _data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def render_html(doc: Document, fig_dir: Path) -> str:
    """The self-contained HTML page of ``doc``.

    Args:
        doc: the report.
        fig_dir: the directory holding the PNG of every :class:`FigureRef` of ``doc``.

    Returns:
        The page; each figure inlined as a base64 ``data:image/png`` URI.

    Raises:
        FileNotFoundError: a figure of ``doc`` is not in ``fig_dir``.
    """
    names = {b.name for s in doc.sections for b in s.blocks if isinstance(b, FigureRef)}
    figures = {name: _data_uri(Path(fig_dir) / name) for name in sorted(names)}
    return environment().get_template(HTML_TEMPLATE).render(doc=doc, figures=figures)


def render_markdown(doc: Document) -> str:
    """The Markdown twin of the HTML page (figures linked relative as ``figures/<name>``)."""
    text = environment().get_template(MARKDOWN_TEMPLATE).render(doc=doc)
    return text.rstrip("\n") + "\n"
