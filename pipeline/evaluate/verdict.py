"""One verdict per pretraining run, from the label-free monitor rows alone.

The verdict answers three questions in order, each from the number the project's studies found
answering it (in ``results/``; :data:`pipeline.report.labelfree_findings.VERDICT_STUDY` names the
file the report cites):

1. **Collapsed?** (:func:`collapse_reason`): the effective rank of the features (RankMe on the
   monitor's images) below :func:`collapse_threshold`: :data:`COLLAPSE_MIN_RANKME` (a constant
   or rank-1 output), or :data:`COLLAPSE_SHARE` of the most it can be, ``min(N, D)`` (a
   dimensional collapse). Checked at every monitor point (a warning while training) and at the
   end.
2. **No better than its random init?** (:func:`no_better_than_init`): the end's
   :data:`ABSOLUTE` number not better than the random init's (epoch 0, the monitor's first row)
   by more than :data:`INIT_MARGIN` of the init's value, nor by more than its noise
   (:func:`noise`: :data:`NOISE_Z` standard errors of the difference).
3. **Still improving, plateaued since epoch E, or got worse after epoch E?** (:func:`trend`):
   the :data:`TREND` number along the monitor epochs, with a tolerance of
   :data:`PLATEAU_FRACTION` of the run's whole gain over its random init, and at least the
   noise of a difference between two points.

The noise: view top-1 is a share of the monitor's N images found by their other view, so its
standard error is that of a binomial proportion, ``100 sqrt(q (1 - q) / N)`` at ``q = value /
100`` (held within ``[1/N, 1 - 1/N]``); N counts images, not the 2N views, whose two directions
per image are not independent. At the default N (2,048) and the values of a trained run the
tolerance is the gain's share; at a few hundred images and a gain of a few views, the noise
decides.

A verdict is stored as numbers (:meth:`Verdict.metrics`: ``verdict_code`` and
``verdict_epoch`` in ``eval/metrics/pretrain.json``, whose leaves are numeric) and rendered as
text by :func:`describe` from those two numbers alone, so every place that shows it (the
console, ``models/encoder.json``, the MLflow run and model-version tag ``verdict``, the report)
shows the same words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.errors import InputError

IMPROVING, PLATEAU, WORSE, NO_BETTER, COLLAPSED = 0, 1, 2, 3, 4  # verdict codes
NO_EPOCH = -1  # ``verdict_epoch`` of a verdict that names no epoch
TAG = "verdict"  # the MLflow run and model-version tag

COLLAPSE_MIN_RANKME = 2.0  # RankMe below this: collapsed whatever min(N, D)
COLLAPSE_SHARE = 0.03  # or below this share of min(N, D)
# View top-1, not RankMe (results/labelfree-verdict-2026-12-07.md): RankMe ended below its random
# init's in a run whose kNN monitor ended above it (moco.m 0.9, 3 epochs: RankMe 42.1 vs 54.9,
# kNN 71.0 vs 69.55), view top-1 above it (9.18 vs 4.96 %)
ABSOLUTE = "view_top1"  # the number of "no better than random init" (higher = better)
INIT_MARGIN = 0.0  # share of the init's value the end must exceed it by
TREND = "view_top1"  # the number of the within-run verdict
TREND_HIGHER_IS_BETTER = True
PLATEAU_FRACTION = 0.1  # tolerance: this share of the run's gain (best - init) of TREND
NOISE_Z = 2.0  # standard errors a difference must exceed to count (about 95 %, two-sided)
NAMES = {"rankme": "RankMe", "view_top1": "view top-1", "uniformity": "uniformity",
         "alignment": "alignment"}  # how the verdict's sentences name ABSOLUTE and TREND


def describe(code: int, epoch: int = NO_EPOCH) -> str:
    """The verdict's words from its two numbers (``eval/metrics/pretrain.json``).

    Raises:
        InputError: an unknown code, or a plateau/worse code without an epoch.
    """
    if code in (PLATEAU, WORSE) and epoch < 0:
        raise InputError(f"verdict_code {code} needs a verdict_epoch >= 0, got {epoch}")
    words = {IMPROVING: "still improving", PLATEAU: f"plateaued since epoch {epoch}",
             WORSE: f"got worse after epoch {epoch}", NO_BETTER: "no better than random init",
             COLLAPSED: "collapsed"}
    if code not in words:
        raise InputError(f"verdict_code must be one of {sorted(words)}, got {code}")
    return words[code]


@dataclass(frozen=True)
class Verdict:
    """A run's verdict: its code, the epoch it names (or :data:`NO_EPOCH`), and why.

    Attributes:
        code: :data:`IMPROVING`, :data:`PLATEAU`, :data:`WORSE`, :data:`NO_BETTER` or
            :data:`COLLAPSED`.
        epoch: E of "plateaued since epoch E" / "got worse after epoch E", else NO_EPOCH.
        why: the numbers behind it, one clause (for the log line).
    """

    code: int
    epoch: int = NO_EPOCH
    why: str = ""

    @property
    def text(self) -> str:
        """The words (:func:`describe`)."""
        return describe(self.code, self.epoch)

    def metrics(self) -> dict[str, int]:
        """``{"verdict_code", "verdict_epoch"}``: the numeric form for a metrics file."""
        return {"verdict_code": self.code, "verdict_epoch": self.epoch}


def collapse_threshold(max_rank: int) -> float:
    """The RankMe below which an encoder counts as collapsed, for ``max_rank = min(N, D)``."""
    return max(COLLAPSE_MIN_RANKME, COLLAPSE_SHARE * max_rank)


def collapse_reason(row: Mapping[str, float], max_rank: int) -> str | None:
    """Why the monitor row's encoder counts as collapsed, or None when it does not.

    Args:
        row: a label-free monitor row (``rankme`` at least).
        max_rank: ``min(N, D)``: the monitor's images N, the feature dimension D.
    """
    rank, limit = row.get("rankme"), collapse_threshold(max_rank)
    if rank is not None and rank < limit:
        return (f"RankMe {rank:.2f} < {limit:.3g} (of at most {max_rank}): the features use "
                "almost no directions")
    return None


def standard_error(percent: float, n_images: int) -> float:
    """The standard error (percentage points) of a share ``percent`` of ``n_images``.

    A binomial proportion's, with the share held within ``[1/N, 1 - 1/N]``.

    Raises:
        InputError: ``n_images`` < 1.
    """
    if n_images < 1:
        raise InputError(f"standard_error: needs >= 1 image, got {n_images}")
    q = min(max(percent / 100, 1 / n_images), 1 - 1 / n_images) if n_images > 1 else 0.5
    return 100 * (q * (1 - q) / n_images) ** 0.5


def noise(a: float, b: float, n_images: int) -> float:
    """How far apart two view top-1 values (%) on the same ``n_images`` must be to count.

    :data:`NOISE_Z` standard errors of their difference (:func:`standard_error`).
    """
    return NOISE_Z * (standard_error(a, n_images) ** 2
                      + standard_error(b, n_images) ** 2) ** 0.5


def no_better_than_init(init: float, end: float, *, higher_is_better: bool = True,
                        margin: float = INIT_MARGIN, noise_floor: float = 0.0) -> bool:
    """Whether ``end`` fails to beat ``init`` by more than ``margin * |init|`` and ``noise_floor``.

    ``noise_floor`` is in the values' units (:func:`noise`).
    """
    gain = (end - init) if higher_is_better else (init - end)
    return gain <= max(margin * abs(init), noise_floor)


def trend(epochs: Sequence[int], values: Sequence[float], *, higher_is_better: bool = True,
          fraction: float = PLATEAU_FRACTION, noise_floor: float = 0.0) -> tuple[int, int]:
    """Still improving, plateaued since epoch E, or got worse after epoch E.

    With ``v`` the values oriented so that higher is better, ``gain = max(v) - v[0]`` (the
    best point's gain over the first, the random init) and ``tol = max(fraction * gain,
    noise_floor)``:

    * got worse after epoch E: the last value is more than ``tol`` below the best, E = the
      first epoch holding the best value;
    * plateaued since epoch E: otherwise, E = the first epoch from which every value lies
      within ``tol`` of the best, when E is before the last epoch;
    * still improving: E is the last epoch (only it reached the best band).

    Args:
        epochs: the monitor epochs, increasing (epoch 0 = the random init).
        values: the number at each.
        higher_is_better: the number's direction.
        fraction: the tolerance as a share of the gain.
        noise_floor: the least tolerance, in the values' units (:func:`noise`).

    Returns:
        ``(code, epoch)``: ``(IMPROVING, NO_EPOCH)``, ``(PLATEAU, E)`` or ``(WORSE, E)``.

    Raises:
        InputError: fewer than two points, lengths differ, or epochs not increasing.
    """
    if len(epochs) != len(values) or len(epochs) < 2:
        raise InputError(f"trend: needs >= 2 (epoch, value) points of equal count, got "
                         f"{len(epochs)} epochs and {len(values)} values")
    if any(b <= a for a, b in zip(epochs, epochs[1:])):
        raise InputError(f"trend: epochs must increase, got {list(epochs)}")
    v = [x if higher_is_better else -x for x in values]
    best = max(v)
    tol = max(fraction * max(best - v[0], 0.0), noise_floor)
    if v[-1] < best - tol:
        return WORSE, int(epochs[v.index(best)])
    start = len(v) - 1
    while start > 0 and v[start - 1] >= best - tol:
        start -= 1
    if start == len(v) - 1:
        return IMPROVING, NO_EPOCH
    return PLATEAU, int(epochs[start])


def verdict(rows: Sequence[Mapping[str, float]], max_rank: int,
            n_images: int) -> Verdict | None:
    """The run's verdict from its label-free monitor rows (epoch 0 first = the random init).

    Args:
        rows: ``{"epoch", "rankme", "view_top1", ...}`` per monitor point, in epoch order
            (``plots/labelfree.tsv``).
        max_rank: ``min(N, D)`` of the monitor (:func:`collapse_reason`).
        n_images: the monitor's images N (``pretrain.labelfree_images`` or fewer): the noise
            of view top-1 (:func:`noise`).

    Returns:
        The verdict, or None when the rows cannot support one (fewer than two points, or no
        random-init row at epoch 0).
    """
    if len(rows) < 2 or rows[0].get("epoch") != 0:
        return None
    end, init = rows[-1], rows[0]
    reason = collapse_reason(end, max_rank)
    if reason is not None:
        return Verdict(COLLAPSED, NO_EPOCH, reason)
    floor = noise(init[ABSOLUTE], end[ABSOLUTE], n_images)
    if no_better_than_init(init[ABSOLUTE], end[ABSOLUTE], noise_floor=floor):
        return Verdict(NO_BETTER, NO_EPOCH,
                       f"{NAMES[ABSOLUTE]} {end[ABSOLUTE]:.3g} % at the end, "
                       f"{init[ABSOLUTE]:.3g} % at random init: a gain within the noise "
                       f"({floor:.2g} points at {n_images} images)")
    epochs = [int(r["epoch"]) for r in rows]
    values = [r[TREND] for r in rows]
    best = max(values) if TREND_HIGHER_IS_BETTER else min(values)
    code, epoch = trend(epochs, values, higher_is_better=TREND_HIGHER_IS_BETTER,
                        noise_floor=noise(best, best, n_images))
    points = ", ".join(f"epoch {e} {v:.3g} %" for e, v in zip(epochs, values))
    return Verdict(code, epoch, f"{NAMES[TREND]} {points}")
