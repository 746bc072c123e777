"""Label efficiency: kNN and linear-probe top-1 from a few labelled images per class.

The question a user with unlabelled images asks: how many do I need to label? For each ``n`` in
``label_efficiency.per_class`` and each of ``label_efficiency.draws`` seeded draws, ``n``
labelled train images per class are drawn (:func:`draw_per_class`; a class with fewer images
gives all it has), and both probes are fitted on them alone and scored on the whole test set:

* kNN: weighted vote of :func:`pipeline.evaluate.knn.knn_classify` with k=200, T=0.1
  (InstDisc / the MoCo CIFAR demo), k capped at the ``n * C`` bank rows;
* linear probe: :func:`pipeline.evaluate.linear.train_linear_on_features` with the ``linear``
  params (the MoCo protocol the whole-train-set probe uses).

Each point is reported as the mean, standard deviation, minimum and maximum over the draws
(:func:`curve`). The same draws serve every feature kind (MoCo, raw pixels, the random
encoder), so their difference at a point is paired.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from pipeline.config import LinearParams
from pipeline.errors import InputError
from pipeline.evaluate.features import FeatureSet
from pipeline.evaluate.knn import DEFAULT_K, DEFAULT_T, knn_classify
from pipeline.evaluate.linear import train_linear_on_features

log = logging.getLogger(__name__)

PROBES = ("knn", "linear")


def draw_per_class(labels: torch.Tensor, n: int, *, seed: int, draw: int) -> list[int]:
    """Row indices of ``n`` images per class, drawn without replacement (sorted).

    Args:
        labels: ``(N,)`` int64 labels (-1 = unlabelled, never drawn).
        n: images per class; a class with fewer labelled rows gives all of them.
        seed: the run seed (``seed``).
        draw: the draw's number (0, 1, ...): each ``(seed, n, draw)`` is its own stream.

    Returns:
        Sorted row indices into ``labels``.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise InputError(f"label efficiency: images per class must be >= 1, got {n}")
    rng = np.random.default_rng([seed, n, draw])
    y = labels.numpy()
    picked: list[int] = []
    for c in sorted(set(y.tolist()) - {-1}):
        rows = np.flatnonzero(y == c)
        picked += rng.choice(rows, size=min(n, len(rows)), replace=False).tolist()
    return sorted(picked)


def held_per_class(labels: torch.Tensor, n: int) -> dict[int, int]:
    """``{class: images}`` that :func:`draw_per_class` gives for ``n`` per class (every draw).

    A class with fewer than ``n`` labelled rows gives all it has.
    """
    counts = torch.bincount(labels[labels >= 0])
    return {c: min(n, int(k)) for c, k in enumerate(counts.tolist()) if k}


def summary(values: list[float]) -> dict[str, float]:
    """``{"mean", "std", "min", "max"}`` of top-1s over draws (population std; 0 for one)."""
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0,
            "min": round(min(values), 4), "max": round(max(values), 4)}


def probe_top1(train: FeatureSet, test: FeatureSet, *, probe: str, num_classes: int,
               linear: LinearParams, seed: int, device: torch.device) -> float:
    """Top-1 (%) of one probe fitted on ``train`` and scored on ``test``.

    Raises:
        ValueError: an unknown probe (see :data:`PROBES`).
    """
    if probe == "knn":
        return knn_classify(train.features, train.labels, test.features, test.labels,
                            k=min(DEFAULT_K, len(train)), T=DEFAULT_T,
                            num_classes=num_classes, device=device).top1
    if probe == "linear":
        return train_linear_on_features(
            train, test, num_classes=num_classes, epochs=linear.epochs,
            batch_size=linear.batch_size, lr=linear.lr, lr_schedule=linear.lr_schedule,
            milestones=linear.lr_milestones, weight_decay=linear.weight_decay,
            feature_norm=linear.feature_norm, seed=seed, device=device, test_curve=False).top1
    raise InputError(f"label efficiency: unknown probe {probe!r}; known: {', '.join(PROBES)}")


def curve(kinds: Mapping[str, Callable[[list[int]], FeatureSet]],
          tests: Mapping[str, FeatureSet], labels: torch.Tensor, *, per_class: Sequence[int],
          draws: int, seed: int, num_classes: int, linear: LinearParams,
          device: torch.device) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Top-1 of both probes per feature kind and labels per class, over seeded draws.

    Args:
        kinds: feature kind (``moco``, ``raw_pixels``, ``random_encoder``) -> a function giving
            the train features of the rows asked for (indices into ``labels``), in that order.
        tests: feature kind -> its whole test set's features.
        labels: ``(N,)`` labels of the whole train set (the draws are taken from it).
        per_class: images per class of each point (``label_efficiency.per_class``).
        draws: draws per point (``label_efficiency.draws``).
        seed: ``seed``.
        num_classes: C.
        linear: the linear probe's params.
        device: where the probes run.

    Returns:
        ``{kind: {probe: {str(n): {"mean", "std", "min", "max", "labels", "per_class_min"}}}}``:
        top-1 in percent, the labelled images the point used in all, and the fewest of one
        class (below ``n`` where a class holds fewer). A count whose images are exactly an
        earlier count's (every class already exhausted) is left out, with a warning.
    """
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {
        kind: {probe: {} for probe in PROBES} for kind in kinds}
    seen: dict[tuple[tuple[int, int], ...], int] = {}
    for n in per_class:
        held = held_per_class(labels, n)
        same = seen.setdefault(tuple(sorted(held.items())), n)
        if same != n:
            log.warning("label efficiency: %d per class left out: every class holds at most "
                        "%d labelled images, the %d-per-class point already uses them all",
                        n, max(held.values()), same)
            continue
        if min(held.values()) < n:
            log.warning("label efficiency: %d per class asked, the smallest class holds %d: "
                        "the point uses %d labelled images", n, min(held.values()),
                        sum(held.values()))
        runs: dict[tuple[str, str], list[float]] = {}
        for d in range(draws):
            rows = draw_per_class(labels, n, seed=seed, draw=d)
            for kind, train_of in kinds.items():
                train = train_of(rows)
                for probe in PROBES:
                    runs.setdefault((kind, probe), []).append(probe_top1(
                        train, tests[kind], probe=probe, num_classes=num_classes,
                        linear=linear, seed=seed + d, device=device))
        for (kind, probe), values in runs.items():
            out[kind][probe][str(n)] = {**summary(values), "labels": sum(held.values()),
                                        "per_class_min": min(held.values())}
        log.info("label efficiency, %d per class (%d draws): %s", n, draws, ", ".join(
            f"{kind} {probe} {out[kind][probe][str(n)]['mean']:.2f}"
            for kind in kinds for probe in PROBES))
    return out
