"""Check that every image of an HTML report can be displayed without the network."""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class _ImgCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.srcs.append(dict(attrs).get("src"))


def _check_data_uri(src: str) -> str | None:
    """None when a ``data:`` URI decodes to a non-empty payload (a PNG when it says so)."""
    header, sep, payload = src[len("data:") :].partition(",")
    if not sep:
        return "data URI without ','"
    if header.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            return f"data URI is not valid base64 ({e})"
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if not data:
        return "data URI is empty"
    if header.startswith("image/png") and not data.startswith(PNG_SIGNATURE):
        return "data URI says image/png but is not a PNG"
    return None


def _check_src(src: str | None, html_path: Path) -> str | None:
    """What is wrong with one ``<img src>``, or None when it can be shown."""
    if not src:
        return "no src"
    if src.startswith("data:"):
        return _check_data_uri(src)
    if urllib.parse.urlsplit(src).scheme:
        return f"remote or non-file URL {src[:80]!r} (not self-contained)"
    rel = urllib.parse.unquote(urllib.parse.urlsplit(src).path)
    if not (html_path.parent / rel).is_file():
        return f"file {rel!r} does not exist next to {html_path.name}"
    return None


def check_html(path: Path) -> list[str]:
    """Problems with the images of an HTML file (empty list = every image can be shown).

    Each ``<img src>`` must be a ``data:`` URI that decodes (to a PNG when it is labelled
    ``image/png``) or a local file that exists relative to the HTML file. Remote URLs count as
    problems: the report must be self-contained.

    Args:
        path: the HTML file.

    Returns:
        One message per problem, naming the image by its position (``img #1`` ...).
    """
    path = Path(path)
    if not path.is_file():
        return [f"{path}: file does not exist"]
    parser = _ImgCollector()
    parser.feed(path.read_text(encoding="utf-8"))
    problems = []
    for i, src in enumerate(parser.srcs, start=1):
        err = _check_src(src, path)
        if err:
            problems.append(f"img #{i}: {err}")
    return problems
