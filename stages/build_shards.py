"""DVC stage ``build_shards``: the dataset as deterministic WebDataset shards + manifests."""

import sys
from pathlib import Path

from pipeline.cli import stage_main
from pipeline.config import Params
from pipeline.tracking import stage_run


def run(p: Params) -> None:
    from pipeline.data.shards import build_all

    with stage_run("build_shards", p) as mlrun:
        manifests = build_all(p.data, p.seed, progress=sys.stderr.isatty())
        for split, m in manifests.items():
            mlrun.log_metrics({f"{split}_images": m["num_samples"],
                               f"{split}_shards": len(m["shards"])})
            mlrun.log_artifact(Path(p.data.shards_dir) / split / "manifest.json",
                               f"manifests/{split}")


if __name__ == "__main__":
    sys.exit(stage_main("build_shards", run))
