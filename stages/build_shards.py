"""DVC stage ``build_shards``: the dataset as deterministic WebDataset shards + manifests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.data.build import build_all
    from pipeline.data.manifest import MANIFEST_NAME
    from pipeline.tracking import stage_run

    with stage_run("build_shards", p) as mlrun:
        manifests = build_all(p.data, p.seed)
        for split, m in manifests.items():
            mlrun.log_metrics({f"{split}_images": m.num_samples,
                               f"{split}_shards": len(m.shards)})
            mlrun.log_artifact(Path(p.data.shards_dir) / split / MANIFEST_NAME,
                               f"manifests/{split}")


if __name__ == "__main__":
    stage_entry("build_shards", run)
