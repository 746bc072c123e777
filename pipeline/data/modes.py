"""Every PIL image mode to 8-bit ``L`` or ``RGB``: scaled, never clipped, or refused.

Shards store 8-bit ``L`` (1 channel) or ``RGB`` (3 channels) PNGs. ImageFolder images arrive in
whatever mode PIL opens them in; this module decides which of the two a folder becomes and
converts each image to it. PIL's own ``convert("L")`` clips high bit-depth modes (a 16-bit
pixel of 32768 becomes 255), so those are scaled here with numpy instead.

========================  ====================================================================
PIL mode (from files)     8-bit value ``v8`` (per channel)
========================  ====================================================================
``1``                     0 -> 0, 1 -> 255
``L``, ``RGB``            unchanged
``I;16``, ``I;16B``,      ``v >> 8`` (the high byte): 0..65535 -> 0..255, 32768 -> 128.
``I;16L``, ``I;16N``      It inverts the usual 8 -> 16 bit expansion ``v * 257`` exactly, and
                          is what PIL itself does for 16-bit RGB and grey+alpha PNGs, so a
                          16-bit grey and a 16-bit RGB file of the same grey agree.
``I`` (32-bit int)        as 16-bit: a fixed range 0..65535 (PIL has long represented 16-bit
                          grey as ``I``); a value outside 0..65535 is refused, not clipped.
``F`` (32-bit float)      a fixed range 0..1 (the float-image convention of torchvision's
                          ``to_tensor`` and scikit-image): ``floor(v * 255 + 0.5)``; NaN, inf
                          or a value outside 0..1 is refused, not clipped.
``P``, ``PA``             the palette colours (grey or RGB), then as below
``CMYK``                  PIL's conversion, no colour management:
                          ``R = (255 - C) * (255 - K) / 255`` (same for G/M, B/Y)
``YCbCr``                 PIL's ITU-R BT.601 (JPEG) conversion
``RGBX``                  the X byte is dropped
========================  ====================================================================

Orientation (before any of the above, and before any resize or crop): ImageFolder turns each
image upright as its EXIF ``Orientation`` tag says, with PIL's ``ImageOps.exif_transpose``, so
a phone photo tagged 6 is read rotated 90 degrees clockwise from its raw pixel layout, as
every viewer shows it (tags 5-8 swap width and height). Every manifest an ImageFolder builds
records this under ``build.exif_orientation``.

Fixed ranges, not each image's observed min..max: a min-max stretch would give the same pixel
value different brightness in different images, and make a flat image undefined.

Transparency (an alpha channel ``LA``/``RGBA``/``PA``, or a ``transparency`` key or palette
entry) is composited onto **white** (:data:`BACKGROUND`): fully transparent pixels carry
undefined colour (often black), and transparent images (icons, cut-out product photos,
scanned documents) are drawn to be seen on a white page. Compositing rounds like PIL's
``alpha_composite``: 50 % black (alpha 128) over white gives 127.

Channels (:func:`folder_mode`): a folder whose images are all grey becomes ``L``; one colour
image anywhere makes the whole folder ``RGB``, and its grey images are then stored with three
equal channels (no information lost, none invented). Grey modes: ``1``, ``L``, ``LA``, ``La``,
the ``I;16`` family, ``I``, ``F``, 16-bit grey+alpha PNGs (PIL opens them as ``RGBA`` but
decodes raw mode ``LA;16B``), and ``P``/``PA`` whose *used* palette entries all have R = G = B.
Colour: ``RGB``, ``RGBA``, ``RGBa``, ``RGBX``, ``CMYK``, ``YCbCr``, other palettes. A colour
image is turned into ``L`` only when a caller asks for it (ITU-R 601-2 luma, PIL's rule);
ImageFolder never does. WebP has no grey mode (PIL decodes every WebP as ``RGB``/``RGBA``), so
a WebP file counts as colour. Any other mode (e.g. a ``LAB`` TIFF) is refused.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from pipeline.errors import InputError

BACKGROUND = 255  # white; see the module docstring
I16_MODES = ("I;16", "I;16B", "I;16L", "I;16N")
GREY_MODES = ("1", "L", "LA", "La", *I16_MODES, "I", "F")
COLOUR_MODES = ("RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")
PALETTE_MODES = ("P", "PA")
SUPPORTED_MODES = (*GREY_MODES, *COLOUR_MODES, *PALETTE_MODES)
_ALPHA_MODES = ("LA", "La", "RGBA", "RGBa", "PA")
I_RANGE = (0, 65535)  # accepted values of mode I
F_RANGE = (0.0, 1.0)  # accepted values of mode F


class ModeError(InputError):
    """An image mode or pixel value that cannot be converted (the caller adds the file name).

    Every reader of images uses this module (the sources, the index, the loader), so it sits
    below them; the sources count such an image as unreadable, naming its file.
    """


def image_kind(image: Image.Image) -> str:
    """Whether an image is grey or colour, by the rule in the module docstring.

    Args:
        image: an opened PIL image; palette images are decoded (their used entries decide),
            all others are judged by their header alone.

    Returns:
        ``"L"`` (grey) or ``"RGB"`` (colour).

    Raises:
        ModeError: a mode outside :data:`SUPPORTED_MODES` (message names the mode).
    """
    mode = image.mode
    _check_supported(mode)
    if mode in GREY_MODES:
        return "L"
    if mode in PALETTE_MODES:
        return "L" if _palette_is_grey(image) else "RGB"
    if mode == "RGBA" and _decoded_as_grey_alpha(image):
        return "L"
    return "RGB"


def _check_supported(mode: str) -> None:
    if mode not in SUPPORTED_MODES:
        raise ModeError(f"unsupported image mode {mode!r}")


def folder_mode(kinds: set[str]) -> str:
    """``"L"`` when every image is grey, else ``"RGB"`` (``kinds``: :func:`image_kind` values)."""
    return "L" if kinds <= {"L"} else "RGB"


def to_mode(image: Image.Image, mode: str) -> Image.Image:
    """Convert a decoded image of any supported mode to 8-bit ``mode``.

    Args:
        image: a loaded PIL image.
        mode: ``"L"`` or ``"RGB"``.

    Returns:
        A new image in ``mode`` (the input is not modified), transparency composited on white.

    Raises:
        ModeError: an unsupported mode, or ``I``/``F`` values outside their fixed range.
        ValueError: ``mode`` is not ``"L"`` or ``"RGB"``.
    """
    if mode not in ("L", "RGB"):
        raise InputError(f"mode must be 'L' or 'RGB', got {mode!r}")
    _check_supported(image.mode)
    image = _to_8bit(image)
    if image.mode == "La":  # premultiplied alpha (in-memory only): PIL converts it only to LA
        image = image.convert("LA")
    if image.mode in PALETTE_MODES:  # palette -> its colours, transparency kept as alpha
        image = image.convert("RGBA" if image.mode == "PA" or "transparency" in image.info
                              else "RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (BACKGROUND,) * 3 + (255,))
        image = Image.alpha_composite(white, rgba)
    return image if image.mode == mode else image.convert(mode)


def _to_8bit(image: Image.Image) -> Image.Image:
    """High bit-depth grey (``I;16*``, ``I``, ``F``) -> ``L`` (``LA`` with a transparency key)."""
    if image.mode not in (*I16_MODES, "I", "F"):
        return image
    values = np.asarray(image)
    if image.mode in I16_MODES:
        v8 = (values.astype(np.uint16) >> 8).astype(np.uint8)
    elif image.mode == "I":
        lo, hi = int(values.min()), int(values.max())
        if lo < I_RANGE[0] or hi > I_RANGE[1]:
            raise ModeError(f"mode I (32-bit int) values span {lo}..{hi}, outside the accepted "
                            f"{I_RANGE[0]}..{I_RANGE[1]} (16-bit); convert it to 8 or 16 bit")
        v8 = (values >> 8).astype(np.uint8)
    else:
        lo, hi = float(np.min(values)), float(np.max(values))
        if not (np.isfinite(lo) and np.isfinite(hi) and F_RANGE[0] <= lo and hi <= F_RANGE[1]):
            raise ModeError(f"mode F (float) values span {lo:g}..{hi:g}, outside the accepted "
                            f"{F_RANGE[0]:g}..{F_RANGE[1]:g}; convert it to 8 or 16 bit")
        v8 = np.floor(values.astype(np.float64) * 255 + 0.5).astype(np.uint8)
    grey = Image.fromarray(v8)
    key = image.info.get("transparency")
    if key is None or image.mode == "F":
        return grey
    alpha = np.where(values == key, 0, 255).astype(np.uint8)  # tRNS: one fully transparent value
    return Image.merge("LA", (grey, Image.fromarray(alpha)))


def _palette_is_grey(image: Image.Image) -> bool:
    """True when every palette entry the pixels use has R = G = B (decodes the image)."""
    indices = np.asarray(image)
    if image.mode == "PA":
        indices = indices[..., 0]
    palette = np.asarray(image.getpalette("RGB") or [], dtype=np.int64).reshape(-1, 3)
    used = np.unique(indices)
    used = palette[used[used < len(palette)]]
    return bool(np.all(used == used[:, :1]))


def _decoded_as_grey_alpha(image: Image.Image) -> bool:
    """A 16-bit grey+alpha PNG: PIL reports ``RGBA`` but decodes raw mode ``LA;16B``."""
    tile = getattr(image, "tile", None) or []
    if not tile:
        return False
    args = tile[0].args
    rawmode = args if isinstance(args, str) else (args[0] if args else "")
    return isinstance(rawmode, str) and rawmode.startswith("LA")
