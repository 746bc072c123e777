"""Raw-file checksums: md5 as published, or sha256 of the gunzipped content."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import pytest

from pipeline.data.sources import Checksum, ChecksumError, SourceError, verify_file


def test_verify_file__accepts_sha256_of_decompressed_content(tmp_path: Path):
    raw = b"idx content " * 100
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(raw, compresslevel=1, mtime=0))  # re-gzipped: md5 differs
    verify_file(path, Checksum(md5="0" * 32, sha256_gunzipped=hashlib.sha256(raw).hexdigest()))
    with pytest.raises(ChecksumError, match=str(path)):
        other = hashlib.sha256(b"other").hexdigest()
        verify_file(path, Checksum(md5="0" * 32, sha256_gunzipped=other))


def test_verify_file__missing_file_named(tmp_path: Path):
    with pytest.raises(SourceError, match="nope.gz"):
        verify_file(tmp_path / "nope.gz", Checksum(md5="0" * 32))
