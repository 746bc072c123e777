"""DVC stage ``report``: HTML + Markdown report; its MLflow run holds all params and metrics.

It runs last, so it ends ``dvc repro`` with a few lines: the kNN and linear top-1 beside their
baselines, where the report is and the MLflow runs table (:mod:`pipeline.tracking.headline`).
"""

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
    from pipeline.tracking.headline import headline_metrics, summary_lines
    from pipeline.tracking.ui import runs_table_hint

    root = Path.cwd()
    with stage_run("report", p, upstream=UPSTREAM) as mlrun:
        git = git_state(root)
        report = build_report(params=p, root=root, out_dir=root / "reports",
                              git_commit=git["git.commit"], git_dirty=git["git.dirty"])
        mlrun.log_metrics(report.final_metrics)
        mlrun.log_artifact(root / "reports", "report")
    for line in summary_lines(headline_metrics(root=root), report=report.html.relative_to(root),
                              runs_url=runs_table_hint(mlrun.experiment_id)):
        print(line, flush=True)


if __name__ == "__main__":
    stage_entry("report", run)
