"""Every PIL mode to 8-bit L or RGB: files in each mode read through ImageFolder, expected values
worked out by hand (4x4 images: a fill value plus a few special pixels)."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from srchelpers import png_bytes

from pipeline.data.modes import ModeError, folder_mode, image_kind, to_mode
from pipeline.data.sources import SourceError, open_source

W = H = 4


def expected(fill, special: dict[tuple[int, int], object] | None = None) -> np.ndarray:
    """4x4 (L) or 4x4x3 (RGB) uint8 array: ``fill`` everywhere, ``special[(x, y)]`` there."""
    a = np.empty((H, W) if np.isscalar(fill) else (H, W, 3), dtype=np.uint8)
    a[...] = fill
    for (x, y), v in (special or {}).items():
        a[y, x] = v
    return a


def image(mode: str, fill, special: dict[tuple[int, int], object] | None = None,
          palette: list[int] | None = None) -> Image.Image:
    im = Image.new(mode, (W, H), fill)
    if palette is not None:
        im.putpalette(palette + [0] * (768 - len(palette)))
    for xy, v in (special or {}).items():
        im.putpixel(xy, v)
    return im


def encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def u16_image(mode: str, values: np.ndarray) -> Image.Image:
    """A 16-bit image of the given byte order from (H, W) values (PIL cannot fromarray these)."""
    dtype = {"I;16B": ">u2", "I;16L": "<u2", "I;16N": "=u2", "I;16": "<u2"}[mode]
    return Image.frombytes(mode, (W, H), values.astype(dtype).tobytes())


def png16_rows(pixels: np.ndarray) -> list[bytes]:
    """(H, W) or (H, W, C) 16-bit values -> big-endian PNG scanlines."""
    return [row.astype(">u2").tobytes() for row in pixels.reshape(H, W, -1)]


# 16-bit fixtures: 32768 -> 128, 65535 -> 255, 257 -> 1 (257 >> 8), 255 -> 0 (255 >> 8)
U16 = expected(0).astype(np.uint16)
U16[...] = 32768
U16[0, 0], U16[0, 1], U16[0, 2] = 65535, 257, 255
U16_8BIT = expected(128, {(0, 0): 255, (1, 0): 1, (2, 0): 0})


def u16_with_transparent_key() -> bytes:
    px = np.full((H, W), 32768, dtype=np.uint16)
    px[0, 0] = 1000
    return png_bytes(W, H, 16, 0, png16_rows(px), trns=struct.pack(">H", 1000))


def la16() -> bytes:
    px = np.zeros((H, W, 2), dtype=np.uint16)
    px[...] = (32768, 65535)
    px[0, 0] = (32768, 0)  # fully transparent -> white
    return png_bytes(W, H, 16, 4, png16_rows(px))


def rgb16() -> bytes:
    px = np.zeros((H, W, 3), dtype=np.uint16)
    px[...] = (32768, 65535, 257)
    px[0, 0] = (0, 0, 0)
    return png_bytes(W, H, 16, 2, png16_rows(px))


def int32_tiff(values: dict[tuple[int, int], int], fill: int = 32768) -> bytes:
    a = np.full((H, W), fill, dtype=np.int32)
    for (x, y), v in values.items():
        a[y, x] = v
    return encoded(Image.fromarray(a), "TIFF")


def float_tiff(values: dict[tuple[int, int], float], fill: float = 0.5) -> bytes:
    a = np.full((H, W), fill, dtype=np.float32)
    for (x, y), v in values.items():
        a[y, x] = v
    return encoded(Image.fromarray(a), "TIFF")


@dataclass
class Case:
    """A file in one PIL mode, the mode PIL opens it in, its kind and its 8-bit pixels."""

    id: str
    make: Callable[[], bytes]
    ext: str
    pil_mode: str
    kind: str  # "L" (grey) or "RGB" (colour)
    want: np.ndarray
    atol: int = 0


GREY_PAL = [0, 0, 0, 7, 7, 7, 200, 200, 200, 250, 0, 0]  # entry 3 is red but no pixel uses it

CASES = [
    # 1-bit: 0 -> 0, 1 -> 255
    Case("1", lambda: encoded(image("1", 1, {(0, 0): 0}), "PNG"), "png", "1", "L",
         expected(255, {(0, 0): 0})),
    Case("L", lambda: encoded(image("L", 77), "PNG"), "png", "L", "L", expected(77)),
    # tRNS key 5: every 5 is fully transparent -> white; 9 stays
    Case("L-transparency-key",
         lambda: encoded(image("L", 5, {(0, 0): 9}), "PNG", transparency=5), "png", "L", "L",
         expected(255, {(0, 0): 9})),
    # alpha 0 -> white 255; black at alpha 128 over white: 255 * (255 - 128) / 255 = 127
    Case("LA", lambda: encoded(image("LA", (40, 255), {(0, 0): (40, 0), (1, 0): (0, 128)}), "PNG"),
         "png", "LA", "L", expected(40, {(0, 0): 255, (1, 0): 127})),
    # grey palette (the unused red entry does not count): index 2 -> 200, index 1 -> 7
    Case("P-grey", lambda: encoded(image("P", 2, {(0, 0): 1}, GREY_PAL), "PNG"), "png", "P", "L",
         expected(200, {(0, 0): 7})),
    Case("P-colour", lambda: encoded(image("P", 1, None, [0, 0, 0, 200, 100, 50]), "BMP"), "bmp",
         "P", "RGB", expected((200, 100, 50))),
    # transparency = index 0: that pixel -> white
    Case("P-transparent-index",
         lambda: encoded(image("P", 1, {(0, 0): 0}, [0, 0, 0, 10, 20, 30]), "PNG", transparency=0),
         "png", "P", "RGB", expected((10, 20, 30), {(0, 0): (255, 255, 255)})),
    # per-entry alpha (tRNS bytes): entry 1 = black at alpha 128 -> 127; grey palette -> L
    Case("P-alpha-table",
         lambda: encoded(image("P", 0, {(0, 0): 1}, [60, 60, 60, 0, 0, 0]), "PNG",
                         transparency=bytes([255, 128])),
         "png", "P", "L", expected(60, {(0, 0): 127})),
    # palette + alpha band (TIFF): grey entry 9 opaque; alpha 0 -> white
    Case("PA", lambda: encoded(image("PA", (1, 255), {(0, 0): (1, 0)}, [0, 0, 0, 9, 9, 9]), "TIFF"),
         "tif", "PA", "L", expected(9, {(0, 0): 255})),
    Case("RGB", lambda: encoded(image("RGB", (5, 6, 7)), "PNG"), "png", "RGB", "RGB",
         expected((5, 6, 7))),
    Case("RGB-transparency-key",
         lambda: encoded(image("RGB", (1, 2, 3), {(0, 0): (4, 5, 6)}), "PNG",
                         transparency=(1, 2, 3)),
         "png", "RGB", "RGB", expected((255, 255, 255), {(0, 0): (4, 5, 6)})),
    Case("RGBA",
         lambda: encoded(image("RGBA", (10, 20, 30, 255),
                               {(0, 0): (10, 20, 30, 0), (1, 0): (0, 0, 0, 128)}), "PNG"),
         "png", "RGBA", "RGB", expected((10, 20, 30), {(0, 0): (255,) * 3, (1, 0): (127,) * 3})),
    # CMYK -> RGB = (255 - C) * (255 - K) / 255: (64, 0, 0, 128) -> 191 * 127 / 255 = 95.1 -> 95,
    # 255 * 127 / 255 = 127; magenta ink (0, 255, 0, 0) -> (255, 0, 255)
    Case("CMYK", lambda: encoded(image("CMYK", (64, 0, 0, 128), {(0, 0): (0, 255, 0, 0)}), "TIFF"),
         "tif", "CMYK", "RGB", expected((95, 127, 127), {(0, 0): (255, 0, 255)})),
    # BT.601: R = Y + 1.402 (Cr - 128), G = Y - 0.344 (Cb - 128) - 0.714 (Cr - 128),
    # B = Y + 1.772 (Cb - 128). (100, 128, 160) -> (144.9, 77.2, 100); neutral -> (100,) * 3
    Case("YCbCr", lambda: encoded(image("YCbCr", (100, 128, 128), {(0, 0): (100, 128, 160)}),
                                  "TIFF"),
         "tif", "YCbCr", "RGB", expected((100, 100, 100), {(0, 0): (145, 77, 100)}), atol=1),
    Case("I;16-png", lambda: encoded(u16_image("I;16", U16), "PNG"), "png", "I;16", "L", U16_8BIT),
    Case("I;16-tiff", lambda: encoded(u16_image("I;16", U16), "TIFF"), "tif", "I;16", "L",
         U16_8BIT),
    Case("I;16B-tiff", lambda: encoded(u16_image("I;16B", U16), "TIFF"), "tif", "I;16B", "L",
         U16_8BIT),
    # 16-bit grey with tRNS value 1000: that pixel -> white, 32768 -> 128
    Case("I;16-transparency-key", u16_with_transparent_key, "png", "I;16", "L",
         expected(128, {(0, 0): 255})),
    # PIL opens 16-bit grey+alpha as RGBA (high bytes); it is still grey: 1 channel
    Case("LA-16bit", la16, "png", "RGBA", "L", expected(128, {(0, 0): 255})),
    Case("RGB-16bit", rgb16, "png", "RGB", "RGB", expected((128, 255, 1), {(0, 0): (0, 0, 0)})),
    # I: fixed range 0..65535 -> v >> 8: 65535 -> 255, 256 -> 1, 0 -> 0
    Case("I", lambda: int32_tiff({(0, 0): 65535, (1, 0): 256, (2, 0): 0}), "tif", "I", "L",
         expected(128, {(0, 0): 255, (1, 0): 1, (2, 0): 0})),
    # F: fixed range 0..1 -> floor(v * 255 + 0.5): 0.5 -> 128 (127.5 up), 0.25 -> 64 (63.75),
    # 0.2 -> 51, 1 -> 255, 0 -> 0
    Case("F", lambda: float_tiff({(0, 0): 1.0, (1, 0): 0.25, (2, 0): 0.0, (3, 0): 0.2}), "tif",
         "F", "L", expected(128, {(0, 0): 255, (1, 0): 64, (2, 0): 0, (3, 0): 51})),
]


def write_folder(root: Path, files: dict[str, bytes]) -> Path:
    """``root/{train,test}/<class>/<name>`` for each ``"<class>/<name>": bytes`` entry."""
    for rel, data in files.items():
        for split in ("train", "test"):
            path = root / split / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return root


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_imagefolder_mode__file_to_8bit(case: Case, tmp_path: Path):
    write_folder(tmp_path, {f"a/img.{case.ext}": case.make()})
    with Image.open(tmp_path / "train" / "a" / f"img.{case.ext}") as im:
        assert im.mode == case.pil_mode  # the file really is in the mode under test
    src = open_source("imagefolder", tmp_path)
    channels = 1 if case.kind == "L" else 3
    assert (src.mode, src.native_shape) == (case.kind, (channels, H, W))
    (sample,) = list(src.iter("train"))
    assert sample.image.mode == case.kind
    got = np.asarray(sample.image)
    assert got.shape == case.want.shape
    np.testing.assert_allclose(got.astype(int), case.want.astype(int), atol=case.atol, rtol=0)


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "L"],
                         ids=[c.id for c in CASES if c.kind == "L"])
def test_to_mode__grey_into_colour_folder_replicated(case: Case):
    with Image.open(io.BytesIO(case.make())) as im:
        im.load()
        rgb = np.asarray(to_mode(im, "RGB"))
    np.testing.assert_array_equal(rgb, np.repeat(case.want[..., None], 3, axis=2))


# --- modes PIL can make only in memory (no file format in the folder's list stores them) ------

IN_MEMORY = [
    ("I;16L", lambda: u16_image("I;16L", U16), "L", U16_8BIT),
    ("I;16N", lambda: u16_image("I;16N", U16), "L", U16_8BIT),
    # premultiplied grey+alpha: alpha 0 -> white, opaque 20 stays
    ("La", lambda: image("La", (20, 255), {(0, 0): (0, 0)}), "L", expected(20, {(0, 0): 255})),
    ("RGBa", lambda: image("RGBa", (10, 20, 30, 255), {(0, 0): (0, 0, 0, 0)}), "RGB",
     expected((10, 20, 30), {(0, 0): (255, 255, 255)})),
    ("RGBX", lambda: image("RGBX", (10, 20, 30, 77)), "RGB", expected((10, 20, 30))),
]


@pytest.mark.parametrize(("make", "kind", "want"), [c[1:] for c in IN_MEMORY],
                         ids=[c[0] for c in IN_MEMORY])
def test_to_mode__in_memory_modes(make, kind: str, want: np.ndarray):
    im = make()
    assert image_kind(im) == kind
    np.testing.assert_array_equal(np.asarray(to_mode(im, kind)), want)


# --- refusals: one line, naming the file -----------------------------------------------------


@pytest.mark.parametrize(("make", "match"), [
    (lambda: int32_tiff({(1, 1): 70000}), r"mode I .*32768\.\.70000.*0\.\.65535"),
    (lambda: int32_tiff({(1, 1): -1}), r"mode I .*-1\.\.32768"),
    (lambda: float_tiff({(1, 1): 1.5}), r"mode F .*0\.5\.\.1\.5.*0\.\.1"),
    (lambda: float_tiff({(1, 1): -0.25}), r"mode F .*-0\.25\.\.0\.5"),
    (lambda: float_tiff({(1, 1): float("nan")}), r"mode F .*nan"),
], ids=["I-above-65535", "I-negative", "F-above-1", "F-negative", "F-nan"])
def test_imagefolder_mode__out_of_range_refused_naming_file(make, match: str, tmp_path: Path):
    write_folder(tmp_path, {"a/ok.png": encoded(image("L", 1), "PNG"), "a/bad.tif": make()})
    src = open_source("imagefolder", tmp_path)  # the header is fine; values are read later
    with pytest.raises(SourceError, match=r"1 unreadable image\(s\): \S*/train/a/bad\.tif") as e:
        list(src.iter("train"))
    assert "\n" not in str(e.value)
    assert e.match(match)


def test_imagefolder_mode__unsupported_mode_refused_at_open(tmp_path: Path):
    write_folder(tmp_path, {"a/ok.png": encoded(image("L", 1), "PNG"),
                            "a/lab.tif": encoded(image("LAB", (50, 0, 0)), "TIFF")})
    with pytest.raises(SourceError) as e:
        open_source("imagefolder", tmp_path)
    msg = str(e.value)
    assert "\n" not in msg
    assert "2 image(s) in an unsupported mode" in msg  # train/ and test/ copies
    assert "train/a/lab.tif (unsupported image mode 'LAB')" in msg and "I;16B" in msg


# --- the channel count of a folder -----------------------------------------------------------


def test_imagefolder_mode__all_grey_kinds_make_one_channel(tmp_path: Path):
    grey = {c.id: c for c in CASES if c.kind == "L"}
    files = {f"c{i}/img.{c.ext}": c.make() for i, c in enumerate(grey.values())}
    src = open_source("imagefolder", write_folder(tmp_path, files))
    assert src.mode == "L" and src.native_shape == (1, H, W)
    got = {s.label: np.asarray(s.image) for s in src.iter("train")}
    for i, c in enumerate(grey.values()):
        np.testing.assert_array_equal(got[src.class_names.index(f"c{i}")], c.want, err_msg=c.id)


def test_imagefolder_mode__one_colour_image_makes_the_folder_rgb(tmp_path: Path):
    i16 = next(c for c in CASES if c.id == "I;16-png")
    files = {"grey/a.png": i16.make(), "colour/b.png": encoded(image("RGB", (5, 6, 7)), "PNG")}
    src = open_source("imagefolder", write_folder(tmp_path, files))
    assert src.mode == "RGB" and src.native_shape == (3, H, W)
    by_class = {src.class_names[s.label]: np.asarray(s.image) for s in src.iter("train")}
    np.testing.assert_array_equal(by_class["grey"], np.repeat(U16_8BIT[..., None], 3, axis=2))
    np.testing.assert_array_equal(by_class["colour"], expected((5, 6, 7)))


def test_folder_mode__rule():
    assert folder_mode({"L"}) == "L"
    assert folder_mode({"L", "RGB"}) == folder_mode({"RGB"}) == "RGB"


def test_to_mode__colour_to_grey_uses_luma():
    # ITU-R 601-2 luma (PIL): 0.299 R + 0.587 G + 0.114 B; (200, 100, 50) -> 124.2 -> 124
    assert to_mode(image("RGB", (200, 100, 50)), "L").getpixel((0, 0)) == 124


def test_to_mode__unknown_target_and_mode():
    with pytest.raises(ValueError, match="'L' or 'RGB'"):
        to_mode(image("L", 0), "RGBA")
    with pytest.raises(ModeError, match="'HSV'"):
        to_mode(image("HSV", (0, 0, 0)), "RGB")
