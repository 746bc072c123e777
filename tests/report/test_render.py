from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path

import pytest
from reporthelpers import image, png

from pipeline.report.check import check_html
from pipeline.report.render import environment, render_html, render_markdown
from pipeline.report.sections import NOT_AVAILABLE, Document, FigureRef, Paragraph, Section, Table

HOSTILE = '<script>alert("x")</script> & \'q\''
CAPTION = 'plot" onload="alert(1)'


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _doc():
    return Document(
        title=f"MoCo report: {HOSTILE}",
        subtitle="subtitle",
        sections=[
            Section(
                "Hostile <b>section</b>",
                [
                    Paragraph(f"paragraph {HOSTILE}"),
                    Paragraph(f"curves: {NOT_AVAILABLE} (plots/x.tsv)."),
                    Table(["name|x", "value"],
                          [["a|b\nc", "12.50"], ["<i>cell</i>", NOT_AVAILABLE]]),
                    FigureRef("f.png", CAPTION),
                ],
            ),
        ],
    )


def _fig_dir(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures/f.png").write_bytes(png(image(3)))
    return tmp_path / "figures"


def test_render_html__hostile_strings_are_text(tmp_path):
    html = render_html(_doc(), _fig_dir(tmp_path))
    assert "<script" not in html and "<b>section" not in html and "<i>cell" not in html
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &amp; &#39;q&#39;" in html
    tags = _Tags()
    tags.feed(html)
    imgs = [a for t, a in tags.tags if t == "img"]
    assert len(imgs) == 1 and imgs[0]["alt"] == CAPTION and "onload" not in imgs[0]
    assert [t for t, _ in tags.tags if t in ("script", "b", "i")] == []
    (tmp_path / "r.html").write_text(html)
    assert check_html(tmp_path / "r.html") == []


def test_render_html__cell_classes_and_anchors(tmp_path):
    html = render_html(_doc(), _fig_dir(tmp_path))
    assert '<td class="num">12.50</td>' in html
    assert f'<td class="na">{NOT_AVAILABLE}</td>' in html
    assert "<td>a|b\nc</td>" in html
    assert f'<p class="na">curves: {NOT_AVAILABLE} (plots/x.tsv).</p>' in html
    assert '<section id="hostile--b-section--b">' in html
    nav = '<li><a href="#hostile--b-section--b">Hostile &lt;b&gt;section&lt;/b&gt;</a></li>'
    assert nav in html


def test_render_markdown__tables_escaped(tmp_path):
    md = render_markdown(_doc())
    lines = md.splitlines()
    assert lines[0] == "# MoCo report: &lt;script>alert(\"x\")&lt;/script> &amp; 'q'"
    assert "| name\\|x | value |" in lines and "|---|---|" in lines
    assert "| a\\|b c | 12.50 |" in lines
    assert f"| &lt;i>cell&lt;/i> | {NOT_AVAILABLE} |" in lines
    assert f"![{CAPTION}](figures/f.png)" in lines and f"*{CAPTION}*" in lines
    assert md.endswith(".png)\n\n*" + CAPTION + "*\n")


def test_render_markdown__blocks_are_separated_by_a_blank_line():
    lines = render_markdown(_doc()).splitlines()
    para = [i for i, line in enumerate(lines) if line.startswith(("paragraph", "curves:"))]
    table = lines.index("| name\\|x | value |")
    # two paragraphs, then the table: each followed by an empty line (not merged into one)
    assert len(para) == 2 and para[1] == para[0] + 2 and table == para[1] + 2
    assert lines[para[0] + 1] == lines[para[1] + 1] == ""


def test_templates__package_data_and_autoescape():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    env = environment()
    assert {"report.html.j2", "report.md.j2"} <= set(env.list_templates())
    assert env.get_template("report.html.j2").render(
        doc=Document("<t>", "", []), figures={}
    ).count("&lt;t&gt;") == 2  # <title> and <h1>
    repo = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["pipeline"]
    for t in (repo / "pipeline/report/templates").iterdir():
        rel = str(t.relative_to(repo / "pipeline"))
        assert any(fnmatch(rel, p) for p in patterns), rel  # shipped in the wheel
