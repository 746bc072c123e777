"""The report's near-duplicates and outliers section, on the tiny run of reporthelpers."""

import json

import numpy as np
from PIL import Image
from reporthelpers import DATA_INSIGHTS, IN_PLACE_SHARD, PRETRAIN_SHARD, image, make_run

from pipeline.report.document import FigureRef, Paragraph, Table
from pipeline.report.inputs import read_outputs
from pipeline.report.insights import (
    IDENTICAL,
    TITLE,
    insights_section,
    load_images,
    pixel_difference,
)


def _section(root, tmp_path, shown=12):
    fig_dir = tmp_path / "figs"
    fig_dir.mkdir(parents=True, exist_ok=True)
    return insights_section(read_outputs(root, "data/shards"), shown, fig_dir), fig_dir


def test_insights_section__summary_pairs_table_and_figures(tmp_path):
    root = make_run(tmp_path / "run")
    sec, fig_dir = _section(root, tmp_path)
    assert sec.title == TITLE == "What the embeddings say about the data"
    assert sec.blocks[0] == Paragraph(
        "31 pretraining images (30 built, 1 read in place from data.pretrain_shards), embedded "
        "with the exported encoder (global pool of the last stage, eval transform), each "
        "compared with its 5 most cosine-similar others. 3 pairs reach cosine >= 0.98 "
        "(insights.duplicate_cosine), involving 6 images. No labels are used.")
    table = next(b for b in sec.blocks if isinstance(b, Table))
    # image(i): background 3i, an 8 x 8 square 255 - 3i: every one of the 28 x 28 pixels of
    # image(0) and image(7) differ, by 21 (= 3 x 7); of image(12) and image(21), by 27
    assert table.headers == ["#", "cosine", "key", "key", "pixels", "shard"]
    assert table.rows == [
        ["1", "1.0000", "pre00000", "pre00007",
         "784 of 784 pixels differ, by up to 21 grey levels", PRETRAIN_SHARD],
        ["2", "0.9912", "pre00003", "000000123",
         "not available (image not read from a local shard)",
         f"{PRETRAIN_SHARD} / {IN_PLACE_SHARD}"],
        ["3", "0.9875", "pre00012", "pre00021",
         "784 of 784 pixels differ, by up to 27 grey levels", PRETRAIN_SHARD],
    ]
    caption = next(b for b in sec.blocks if isinstance(b, FigureRef)).caption
    assert ("0 of them with identical pixels, 2 differing in some pixels, 1 not compared"
            in caption)
    assert "the same pixels" not in caption  # cosine 1.0000 here, yet every pixel differs
    refs = [b.name for b in sec.blocks if isinstance(b, FigureRef)]
    assert refs == ["duplicates.png", "outliers.png"]
    for name in refs:
        with Image.open(fig_dir / name) as im:
            assert im.format == "PNG" and im.width > 300
    assert "median" in sec.blocks[-2].caption and "0.750" in sec.blocks[-2].caption
    assert sec.blocks[-1].text.startswith("Every count, and up to 3 pairs and 3 outliers")


def test_load_images__from_the_recorded_shard_urls_skipped(tmp_path):
    root = make_run(tmp_path / "run")
    items = [p[s] for p in DATA_INSIGHTS["pairs"] for s in "ab"]
    got = load_images(root, items)
    # five images in the local shard, the sixth on a URL (not read by the report)
    assert sorted(k for _, k in got) == ["pre00000", "pre00003", "pre00007", "pre00012",
                                         "pre00021"]
    assert all(shard == PRETRAIN_SHARD for shard, _ in got)
    for i in (0, 7, 21):  # the pixels written for key pre000ii: image(i)
        assert np.array_equal(np.asarray(got[(PRETRAIN_SHARD, f"pre{i:05d}")]),
                              np.asarray(image(i)))


def test_insights_section__shown_caps_pairs_and_zero_skips(tmp_path):
    root = make_run(tmp_path / "run")
    sec, _ = _section(root, tmp_path, shown=1)
    table = next(b for b in sec.blocks if isinstance(b, Table))
    assert [r[2:4] for r in table.rows] == [["pre00000", "pre00007"]]
    sec, fig_dir = _section(root, tmp_path / "zero", shown=0)
    assert Paragraph("Thumbnails: skipped (report.insight_images = 0).") in sec.blocks
    assert list(fig_dir.iterdir()) == []


def test_insights_section__no_pairs_and_missing_file(tmp_path):
    root = make_run(tmp_path / "run")
    path = root / "eval/data_insights.json"
    path.write_text(json.dumps({**DATA_INSIGHTS, "duplicate_pairs": 0, "pairs": []}))
    sec, fig_dir = _section(root, tmp_path)
    assert Paragraph("Near-duplicates: no pair reaches cosine >= 0.98.") in sec.blocks
    assert sorted(p.name for p in fig_dir.iterdir()) == ["outliers.png"]
    path.unlink()
    sec, _ = _section(root, tmp_path / "none")
    assert sec.blocks == [Paragraph(
        "Near-duplicates and outliers: not available (eval/data_insights.json).")]


def test_pixel_difference__counts_pixels_and_levels():
    a = np.zeros((4, 4), dtype=np.uint8)
    b = a.copy()
    b[0, 0], b[1, 2], b[3, 3] = 5, 10, 2  # 3 of 16 pixels, the largest step 10
    grey = Image.fromarray(a, mode="L")
    assert pixel_difference(grey, Image.fromarray(b, mode="L")) == (
        "3 of 16 pixels differ, by up to 10 grey levels", 3)
    assert pixel_difference(grey, grey.copy()) == (IDENTICAL, 0)
    # a grey image and its RGB copy hold the same pixels
    assert pixel_difference(grey, grey.convert("RGB")) == (IDENTICAL, 0)
    rgb = np.zeros((2, 3, 3), dtype=np.uint8)
    other = rgb.copy()
    other[0, 1] = (0, 7, 3)  # one pixel, two channels: counted once, by its largest step
    other[1, 2, 2] = 200
    assert pixel_difference(Image.fromarray(rgb), Image.fromarray(other)) == (
        "2 of 6 pixels differ, by up to 200 levels", 2)
    assert pixel_difference(grey, Image.new("L", (5, 4))) == ("sizes differ (4x4, 5x4)", None)
    assert pixel_difference(None, grey)[1] is None
