"""Write page.html, the offline page of `dvc plots show` / `dvc plots diff`, from npm.

DVC's own page (dvc_render.html.PAGE_HTML) loads vega, vega-lite and vega-embed from a CDN
(dvc_render.vega.VegaRenderer.SCRIPTS): on a machine without network it stays blank. This page
is the same page with the three libraries inside it, at the versions DVC's renderer names, so
the written index.html works anywhere it is opened (any `-o` folder, a copy sent by mail). It has
no ``{scripts}`` placeholder, so DVC adds none of its CDN tags. A plot whose file has no rows is
left out (:data:`SKIP_EMPTY`).

Run from the repository root (needs npm and its registry): ``python vendor/vega/build.py``.
It writes, beside itself, page.html, LICENSE-<package> (each package's own LICENSE file) and
sources.json (package, version, the npm tarball's integrity, the file and its sha256), which
tests/test_dvc_plots.py checks page.html against.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the versions dvc_render.vega.VegaRenderer.SCRIPTS loads (dvc-render 1.0.x, DVC 3.67), and the
# file the CDN serves for each (the package's "jsdelivr" entry)
PACKAGES = [("vega", "5.20.2", "build/vega.min.js"),
            ("vega-lite", "5.2.0", "build/vega-lite.min.js"),
            ("vega-embed", "6.18.2", "build/vega-embed.min.js")]
HEAD = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
"""
# DVC writes `vegaEmbed('#id', {})` for a declared plot whose file has no rows (the validation
# curve without a validation split): leave such a plot out instead of an empty cell
SKIP_EMPTY = """    <script>
        (function (embed) {
            window.vegaEmbed = function (el, spec, opt) {
                if (spec && Object.keys(spec).length) return embed(el, spec, opt);
                document.querySelector(el).style.display = "none";
                return Promise.resolve();
            };
        })(window.vegaEmbed);
    </script>
"""
TAIL = """    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def fetch(package: str, version: str, member: str, tmp: Path) -> tuple[str, str, str]:
    """(integrity of the npm tarball, the file's text, its LICENSE's text)."""
    out = subprocess.run(["npm", "pack", f"{package}@{version}", "--json"], cwd=tmp,
                         capture_output=True, text=True, check=True)
    (info,) = json.loads(out.stdout)
    with tarfile.open(tmp / info["filename"]) as tar:
        def read(name: str) -> str:
            f = tar.extractfile(f"package/{name}")
            assert f is not None, f"{package}@{version}: no {name}"
            return f.read().decode()
        return info["integrity"], read(member), read("LICENSE")


def main() -> None:
    parts, sources = [HEAD], []
    with tempfile.TemporaryDirectory() as tmp:
        for package, version, member in PACKAGES:
            integrity, code, licence = fetch(package, version, member, Path(tmp))
            assert "</script" not in code.lower() and "{plot_divs}" not in code
            (HERE / f"LICENSE-{package}").write_text(licence)
            parts.append(f"    <!-- {package} {version}, {member} of its npm package; licence: "
                         f"LICENSE-{package} -->\n    <script>{code}</script>\n")
            sources.append({"package": package, "version": version, "file": member,
                            "npm_integrity": integrity,
                            "sha256": hashlib.sha256(code.encode()).hexdigest()})
    parts += [SKIP_EMPTY, TAIL]
    (HERE / "page.html").write_text("".join(parts))
    (HERE / "sources.json").write_text(json.dumps(sources, indent=2) + "\n")


if __name__ == "__main__":
    main()
