"""What this project's studies found each label-free number answering, as the report says it.

The numbers themselves are computed in :mod:`pipeline.evaluate.labelfree`, the run's verdict in
:mod:`pipeline.evaluate.verdict`; this module holds only what the studies in ``results/`` found
(read by the report, checked against the result files by ``tests/evaluate/test_labelfree.py``),
so that a new study changes the report and never the training's code.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.evaluate.verdict import (
    ABSOLUTE,
    COLLAPSE_MIN_RANKME,
    COLLAPSE_SHARE,
    COLLAPSED,
    IMPROVING,
    NAMES,
    NO_BETTER,
    NO_EPOCH,
    NOISE_Z,
    PLATEAU,
    PLATEAU_FRACTION,
    TREND,
    WORSE,
    describe,
)

VERDICT_STUDY = "results/labelfree-verdict-2026-12-07.md"  # how the verdict's rule was chosen

# What each number answers on this project's own data, measured against the kNN monitor.
# Across runs: the Spearman rho with kNN top-1 over the encoders of the cross-run study of
# 3-epoch runs (benchmarks/labelfree_correlation.py; STUDY_FILE). Within a run: the mean over
# the full-length runs of the Spearman rho with the kNN monitor along their epochs, random init
# included (benchmarks/labelfree_study.py verdicts; VERDICTS_FILE). tests/evaluate/
# test_labelfree.py checks both against the files. ROLE says what the report shows each number
# as; the run verdict (pipeline/evaluate/verdict.py) uses the numbers the study supports.
STUDY_FILE = "results/labelfree-correlation-2026-12-06.json"
STUDY: dict[str, tuple[float, int]] = {"rankme": (0.6807, 20), "alignment": (0.2505, 20),
                                        "uniformity": (-0.7469, 20)}
VERDICTS_FILE = "results/labelfree-verdict-2026-12-07.json"
WITHIN_RUN: dict[str, tuple[float, int]] = {"rankme": (0.8997, 3), "alignment": (-0.0346, 3),
                                            "uniformity": (-0.5009, 3),
                                            "view_top1": (0.8991, 3)}
ROLE = {
    "rankme": "the verdict's collapse check; not 'better than random init' (it ended below "
              "its init in two runs that improved)",
    "alignment": "a diagnostic only (rises with training; 0 for a collapsed encoder)",
    "uniformity": "ranked 3-epoch runs of one recipe; not progress within a run",
    "view_top1": "the verdict's number: better than random init, progress within a run",
}


def study_rho(name: str) -> tuple[float | None, int]:
    """``(Spearman rho with kNN top-1, encoders)`` across runs (:data:`STUDY`; None: not run)."""
    rho, n = STUDY.get(name, (None, 0))
    return rho, n


def within_run_rho(name: str) -> tuple[float | None, int]:
    """``(mean Spearman rho with the kNN monitor along a run's epochs, runs)`` (None: none).

    From :data:`WITHIN_RUN`.
    """
    rho, n = WITHIN_RUN.get(name, (None, 0))
    return rho, n


def report_sentence(metrics: Mapping[str, float]) -> str | None:
    """The report's first line on quality without labels, from ``eval/metrics/pretrain.json``.

    Returns:
        The verdict, what it rests on and what to do; None when the metrics hold no verdict
        (no label-free monitor, or an older run).
    """
    code = metrics.get("verdict_code")
    if code is None:
        return None
    epoch = metrics.get("verdict_epoch")
    code, epoch = int(code), NO_EPOCH if epoch is None else int(epoch)
    why = {
        COLLAPSED: "the features use almost no directions (RankMe at the end below "
                   f"max({COLLAPSE_MIN_RANKME:g}, {COLLAPSE_SHARE:g} x min(images, dimension)))"
                   ": the encoder maps images to nearly one point or line. Do not use it; "
                   "check the data and the augmentations, or lower pretrain.lr.",
        NO_BETTER: f"its {NAMES[ABSOLUTE]} at the end is not above its random init's by more "
                   f"than the noise of the monitor's sample ({NOISE_Z:g} standard errors): the "
                   "training did not make the images easier to tell apart. Check the recipe "
                   "before training longer.",
        IMPROVING: f"its {NAMES[TREND]} rose by more than {PLATEAU_FRACTION:.0%} of its whole "
                   "gain (and more than the noise of the monitor's sample) at the last monitor "
                   "point: more epochs may still help.",
        PLATEAU: f"its {NAMES[TREND]} has stayed within {PLATEAU_FRACTION:.0%} of its whole gain "
                 f"since epoch {epoch}: its progress has slowed. That does not show that more "
                 "epochs would not help: in this project's runs view top-1 levelled off 1-2 "
                 "epochs after the kNN monitor (7 epochs: kNN since epoch 3, view top-1 since "
                 "5; 25 epochs: 14 and 15), and the 25-epoch preset still ended 4.1 kNN-monitor "
                 "points above the 7-epoch default.",
        WORSE: f"its {NAMES[TREND]} fell by more than {PLATEAU_FRACTION:.0%} of its whole gain "
               f"after epoch {epoch}: a run of {epoch} epochs may be better.",
    }
    return (f"Verdict without labels: {describe(code, epoch)}. From the label-free monitor "
            f"alone, {why[code]} How the rule was chosen: {VERDICT_STUDY}.")
