"""DVC stage ``report``: HTML + Markdown report; its MLflow run holds all params and metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.cli import stage_entry  # first: light; installs the signal handlers

if TYPE_CHECKING:
    from pipeline.config import Params

UPSTREAM = ("build_shards", "pretrain", "embed", "baselines", "knn", "linear")


def run(p: Params) -> None:
    from pathlib import Path

    from pipeline.report.build import build_report
    from pipeline.tracking import git_state, stage_run

    root = Path.cwd()
    with stage_run("report", p, upstream=UPSTREAM) as mlrun:
        git = git_state(root)
        report = build_report(params=p, root=root, out_dir=root / "reports",
                              git_commit=git["git.commit"], git_dirty=git["git.dirty"])
        mlrun.log_metrics(report.final_metrics)
        mlrun.log_artifact(root / "reports", "report")


if __name__ == "__main__":
    stage_entry("report", run)
