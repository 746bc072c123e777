"""A shard split as an MLflow dataset: what a run trained or was evaluated on.

The dataset's digest is the sha256 of the split's ``manifest.json`` (which lists every shard's
sha256), cut to the 36 characters MLflow keeps; its source is the split's folder, or its URL
(an HTTP dataset source for ``http(s)``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pipeline.data.manifest import MANIFEST_NAME, ShardError, parse_manifest
from pipeline.data.remote import RemoteError, ShardURL, read_url, shards_location

MLFLOW_DIGEST_CHARS = 36  # MLflow caps a dataset digest at 36 characters


def shard_dataset(split_dir: str | Path | ShardURL) -> Any | None:
    """The ``mlflow.data`` dataset of a shard split, or None when its manifest is unreadable.

    The manifest is read once: its bytes give the digest, and
    :func:`pipeline.data.manifest.parse_manifest` the name (an invalid one gives None).

    Args:
        split_dir: a shard directory holding ``manifest.json``, or its URL.

    Returns:
        A ``MetaDataset`` named ``<source>/<split>`` (from the manifest).
    """
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    where = shards_location(split_dir)
    if isinstance(where, ShardURL):
        from mlflow.data.http_dataset_source import HTTPDatasetSource

        try:
            raw = read_url(where / MANIFEST_NAME)
        except RemoteError:
            return None  # the stage itself reports the unreadable manifest
        source: Any = (HTTPDatasetSource(str(where)) if where.scheme in ("http", "https")
                       else LocalArtifactDatasetSource(str(where)))
    else:
        manifest = where / MANIFEST_NAME
        if not manifest.is_file():
            return None
        raw = manifest.read_bytes()
        source = LocalArtifactDatasetSource(str(where.resolve()))
    try:
        m = parse_manifest(raw, where / MANIFEST_NAME)
    except ShardError:
        return None  # the stage itself reports the invalid manifest
    digest = hashlib.sha256(raw).hexdigest()[:MLFLOW_DIGEST_CHARS]
    return MetaDataset(source=source, digest=digest, name=f"{m.source}/{m.split}")
