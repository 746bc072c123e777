"""Write the run report: read the outputs, build the sections, render, check, move into place.

:func:`build_report` is the one function the ``report`` stage calls. It writes::

    out_dir/report.html    self-contained: figures embedded as base64 data URIs
    out_dir/report.md      the same tables, figures linked as figures/<name>.png
    out_dir/figures/*.png

The whole directory is rendered next to ``out_dir``, its HTML checked
(:func:`pipeline.report.check.check_html`), and only then moved into place, so a failed,
interrupted or broken report never replaces the previous one. The only wall-clock date in the
body is when it was written (:func:`pipeline.report.provenance.report_time`): with
``SOURCE_DATE_EPOCH`` set, the same inputs on the same machine give the same bytes.

Modules of the package, in the order they run::

    inputs.py      read the pipeline's outputs into RunOutputs (dataclasses)
    sections.py    build the Document (sections of tables, paragraphs, figures); results.py,
                   quality.py, insights.py, provenance.py build some of the sections
    figures.py     draw each figure (matplotlib), called by sections.py
    references.py  published numbers to compare a run with
    render.py      Document -> HTML and Markdown (Jinja2 templates in templates/)
    check.py       every image of the HTML can be displayed offline
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Params
from pipeline.report.check import check_html
from pipeline.report.inputs import collect_final_metrics, read_outputs
from pipeline.report.render import render_html, render_markdown
from pipeline.report.sections import build_document


@dataclass(frozen=True)
class Report:
    """A written report.

    Attributes:
        html: ``out_dir/report.html``.
        markdown: ``out_dir/report.md``.
        final_metrics: the union of every stage's final metrics, ``<stage>.<metric>`` ->
            value (:func:`pipeline.report.inputs.collect_final_metrics`), for MLflow.
    """

    html: Path
    markdown: Path
    final_metrics: dict[str, float]


def build_report(
    *, params: Params, root: Path, out_dir: Path, git_commit: str | None = None,
    git_dirty: str | None = None,
) -> Report:
    """Read the pipeline outputs below ``root`` and write the report to ``out_dir``.

    Args:
        params: the validated run params (settings table, t-SNE / retrieval sizes, seed,
            ``data.shards_dir``, published-reference lookup).
        root: the repo root every input path is relative to.
        out_dir: the report directory; replaced as a whole (rendered beside it, then renamed).
        git_commit: shown in the header and the provenance when given.
        git_dirty: ``"true"`` / ``"false"``: whether tracked files differ from ``git_commit``
            (:func:`pipeline.tracking.git_state`).

    Returns:
        The :class:`Report`.

    Raises:
        RuntimeError: an image of the rendered HTML cannot be displayed (the previous
            ``out_dir`` is then left as it was).
    """
    root, out_dir = Path(root), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a report is meant to be read
        _write(params, root, tmp, git_commit, git_dirty)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Report(out_dir / "report.html", out_dir / "report.md", collect_final_metrics(root))


def _write(params: Params, root: Path, out: Path, git_commit: str | None,
           git_dirty: str | None) -> None:
    """Render the report into the empty directory ``out`` and check its HTML."""
    fig_dir = out / "figures"
    fig_dir.mkdir()
    outputs = read_outputs(root, params.data.shards_dir)
    doc = build_document(params, outputs, fig_dir, git_commit, git_dirty=git_dirty)
    html = out / "report.html"
    html.write_text(render_html(doc, fig_dir), encoding="utf-8")
    (out / "report.md").write_text(render_markdown(doc), encoding="utf-8")
    problems = check_html(html)
    if problems:
        raise RuntimeError(f"report: {html.name} has broken images: {'; '.join(problems)}")


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory ``src`` to ``dst``, replacing an existing ``dst``.

    Two renames inside one parent directory: ``dst`` is briefly absent, never half-written.
    """
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.old."))
        os.rename(dst, old / dst.name)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
