"""DVC stage ``report``: HTML + Markdown report; its MLflow run holds all params and metrics."""

import sys
from pathlib import Path

from pipeline.cli import stage_main
from pipeline.config import Params
from pipeline.tracking import git_state, stage_run

UPSTREAM = ("build_shards", "pretrain", "embed", "baselines", "knn", "linear")


def run(p: Params) -> None:
    from pipeline.report.build import build_report

    root = Path.cwd()
    with stage_run("report", p, upstream=UPSTREAM) as mlrun:
        report = build_report(params=p, root=root, out_dir=root / "reports",
                              git_commit=git_state(root)["git.commit"])
        mlrun.log_metrics(report.final_metrics)
        mlrun.log_artifact(root / "reports", "report")


if __name__ == "__main__":
    sys.exit(stage_main("report", run))
