"""The report's document model: a :class:`Document` of :class:`Section` s of blocks.

Three kinds of blocks: :class:`Table` (cells already formatted as text), :class:`Paragraph` and
:class:`FigureRef` (a PNG drawn into the figure folder by :mod:`pipeline.report.figures`).
Nothing here knows HTML or Markdown: :mod:`pipeline.report.render` turns a document into both.
A number missing from the inputs is shown as :data:`NOT_AVAILABLE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

NOT_AVAILABLE = "not available"


def fmt(v: float | None, spec: str = ".2f", unit: str = "") -> str:
    """``v`` formatted by ``spec`` with ``unit`` appended, or :data:`NOT_AVAILABLE` for None."""
    return NOT_AVAILABLE if v is None else f"{v:{spec}}{unit}"


@dataclass
class Table:
    """A table: ``headers`` and rows of already-formatted cells."""

    headers: list[str]
    rows: list[list[str]]
    kind: ClassVar[str] = "table"


@dataclass
class Paragraph:
    """A paragraph of plain text, optionally ending with a link (``href``, shown as itself)."""

    text: str
    href: str = ""
    kind: ClassVar[str] = "paragraph"


@dataclass
class FigureRef:
    """A figure file (name inside ``figures/``) and its caption."""

    name: str
    caption: str
    kind: ClassVar[str] = "figure"


Block = Table | Paragraph | FigureRef


@dataclass
class Section:
    """A titled section of the report."""

    title: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        """The HTML id of the section."""
        return "".join(ch if ch.isalnum() else "-" for ch in self.title.lower()).strip("-")


@dataclass
class Document:
    """The whole report: what the HTML and Markdown templates render."""

    title: str
    subtitle: str
    sections: list[Section]
