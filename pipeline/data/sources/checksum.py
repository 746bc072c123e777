"""Raw-file verification: accepted digests (:class:`Checksum`) and :func:`verify_file`.

A file passes if ANY accepted digest matches. Two kinds exist because Debian re-compresses
upstream ``.gz`` files when it packages them (``dataset-fashion-mnist``): the md5 of the file as
published (torchvision's tables) then differs, while the sha256 of the decompressed content
(``sha256_gunzipped``) survives any re-gzip. The decompressed digest is computed only when the
md5 does not match.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.sources.base import SourceError


class ChecksumError(SourceError):
    """A raw file whose digest matches none of the accepted ones."""


@dataclass(frozen=True)
class Checksum:
    """Accepted digests of one raw file; the file passes if ANY given digest matches.

    Attributes:
        md5: md5 of the file as stored (torchvision's published digests).
        sha256_gunzipped: sha256 of the gzip-decompressed content (survives re-compression, e.g.
            by Debian's packaging).
    """

    md5: str | None = None
    sha256_gunzipped: str | None = None


def verify_file(path: str | Path, expected: Checksum) -> None:
    """Check a raw file against its accepted digests.

    Args:
        path: the file.
        expected: accepted digests (at least one must be set).

    Raises:
        SourceError: the file does not exist.
        ChecksumError: no accepted digest matches (message names the file and its digests).
    """
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path}: file not found")
    data = path.read_bytes()
    md5 = hashlib.md5(data).hexdigest()
    if expected.md5 is not None and md5 == expected.md5:
        return
    found = f"md5 {md5}"
    if expected.sha256_gunzipped is not None:
        try:
            sha = hashlib.sha256(gzip.decompress(data)).hexdigest()
        except (OSError, EOFError) as e:
            raise ChecksumError(f"{path}: not a valid gzip file ({e})") from None
        if sha == expected.sha256_gunzipped:
            return
        found += f", sha256 of decompressed content {sha}"
    raise ChecksumError(f"{path}: checksum mismatch ({found}; expected {expected}); the file is "
                        "corrupt or not the published one")


def checked(directory: Path, name: str, table: Mapping[str, Checksum]) -> Path:
    """Verify ``directory/name`` against ``table[name]`` and return its path.

    Raises:
        ChecksumError: ``name`` has no entry in ``table``, or its digest does not match.
        SourceError: the file does not exist.
    """
    if name not in table:
        raise ChecksumError(f"{directory / name}: no checksum known for this file")
    verify_file(directory / name, table[name])
    return directory / name
