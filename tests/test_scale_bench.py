"""benchmarks/scale.py's arithmetic and table: the exponent fit and the provenance line."""

import json

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def scale():
    return load_script("benchmarks/scale.py")


def _row(wall: float, **extra) -> dict:
    return {"wall_s": wall, "peak_rss_mib": 100.0, "peak_anon_mib": 50.0,
            "bytes_written": 2**20, **extra}


def test_fit_exponents__recovers_a_power_law(scale):
    # wall = 0.002 * N^1.5 and 3 * N^0.5: slopes 1.5 and 0.5 exactly, over sizes 4x apart
    sizes = {str(n): {"stages": {"quad": _row(0.002 * n**1.5), "root": _row(3 * n**0.5)}}
             for n in (15_000, 60_000, 240_000)}
    sizes["60000"]["stages"]["once"] = _row(5.0)  # measured at one size only: no slope
    assert scale.fit_exponents(sizes) == {"quad": 1.5, "root": 0.5}


def test_report__table_estimates_and_provenance(scale, tmp_path):
    # two sizes; 960,000 = 4 x 240,000 and its stage took 4x: b = 1, and 1M is 960k x 25/24
    cpu = "AMD EPYC x2 (avx512_bf16)"
    sizes = {"240000": {"stages": {"knn": _row(100.0, code="b4a6b5a", cpu=cpu,
                                               ended="2026-12-07 09:10")}},
             "960000": {"stages": {"knn": _row(400.0, code="4a5f8c1", cpu=cpu,
                                               ended="2026-12-07 19:20"),
                                   "report": _row(80.0)}}}  # a row run before provenance
    results = tmp_path / "scale.json"
    results.write_text(json.dumps({"sizes": sizes}))
    doc = tmp_path / "scaling.md"
    doc.write_text("before\n<!-- scale:begin -->\nold\n<!-- scale:end -->\nafter\n")
    scale.report(results, doc, tmp_path / "fig.png")
    text = doc.read_text()
    assert text.startswith("before\n<!-- scale:begin -->\n| stage | 240,000 | 960,000 |")
    assert text.endswith("<!-- scale:end -->\nafter\n") and "old" not in text
    knn = next(line for line in text.splitlines() if line.startswith("| `knn`"))
    cells = [c.strip() for c in knn.strip("|").split("|")]
    assert cells[1:3] == ["100.0 s / 100 (50) MiB / 1 MB", "400.0 s / 100 (50) MiB / 1 MB"]
    assert cells[3:5] == ["1.00", "1.00"]
    assert cells[5] == "6.9 min"  # 400 s x 1e6 / 960,000 = 416.7 s: the last segment extended
    assert ("Measured at (code, CPU, UTC end): 240,000: b4a6b5a on AMD EPYC x2 (avx512_bf16), "
            "2026-12-07 09:10-09:10; 960,000: 4a5f8c1 on AMD EPYC x2 (avx512_bf16), "
            "2026-12-07 19:20-19:20, ? on ?.") in text
    assert (tmp_path / "fig.png").stat().st_size > 0
