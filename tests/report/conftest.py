"""Fixtures of the report tests: one complete tiny run, reported once per session."""

import pytest
from reporthelpers import PARAMS, make_run

from pipeline.config import from_dict
from pipeline.report.build import build_report


@pytest.fixture(scope="session")
def full_report(tmp_path_factory):
    """(run root, Report) of the tiny run of reporthelpers, reported into <root>/reports."""
    root = make_run(tmp_path_factory.mktemp("run"))
    report = build_report(
        params=from_dict(PARAMS), root=root, out_dir=root / "reports", git_commit="abc1234"
    )
    return root, report
