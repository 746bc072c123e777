"""The ``knn`` stage: weighted kNN of the test features against the train bank."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.atomic import write_json
from pipeline.config import KnnParams
from pipeline.data.remote import ShardURL
from pipeline.data.shards import read_manifest
from pipeline.evaluate.features import load_features, pick_device
from pipeline.evaluate.heldout import split_train_val
from pipeline.evaluate.knn import DEFAULT_K, DEFAULT_T, knn_classify, select_on_heldout

log = logging.getLogger(__name__)

# metrics/knn.json (pipeline.atomic.headline); eval/metrics/knn.json holds every number
HEADLINE = ("top1", "val_top1", "wall_time_s")


def knn_eval(*, features_dir: Path, manifest_dir: Path | ShardURL, knn: KnnParams,
             details_path: Path, seed: int = 0) -> dict[str, float]:
    """Weighted kNN of test features against the train bank (InstDisc protocol).

    Rows labelled -1 are ignored (logged); other labels must lie in ``0..C-1``, C = the number
    of class names in the manifest of ``manifest_dir``.

    With ``knn.select == "val"``, ``k`` and ``T`` are not taken from the params but chosen on
    a validation split of TRAIN exactly as for the tuned raw-pixel kNN of :func:`baselines`
    (``KNN_SELECT_VAL_FRACTION`` of train, seeded by ``seed``, the grid of
    :func:`~pipeline.evaluate.knn.select_k_T`), so MoCo and pixels get the same protocol; the
    test score then uses the whole train bank with the chosen values. The test set never
    chooses anything.

    With ``knn.val_fraction > 0`` it also scores a validation split of TRAIN (the split of
    :func:`~pipeline.evaluate.linear.split_train_val` with ``seed``, the linear probe's split):
    the held-out train rows are the queries and the rest of train is the bank. This is the
    number to select recipes on; the test score always uses the whole train bank.

    Returns:
        ``top1``, ``top5`` (%), ``val_top1`` (% , only with a validation split), the protocol
        values ``k``, ``T`` (the chosen ones with ``select: val``, then also ``select_val`` = 1
        and ``select_val_top1``, the best validation top-1 of the grid, %), sizes (all rows of
        the feature files) and wall time (s). Always also ``protocol_top1``/``protocol_top5``:
        the MoCo/InstDisc protocol (k=200, T=0.1 on the globally pooled backbone features,
        ``{train,test}_global.pt``), comparable with published numbers.

    Raises:
        ValueError: a label outside ``0..C-1`` other than -1 (named).
    """
    t0 = time.time()
    train, test = load_features(features_dir / "train.pt"), load_features(features_dir / "test.pt")
    names = list(read_manifest(manifest_dir).class_names)
    device = pick_device()
    k, T, out = knn.k, knn.T, {}
    if knn.select == "val":
        sel, n_val = select_on_heldout(train.features, train.labels, seed=seed, device=device,
                                       chunk_size=knn.chunk_size)
        k, T = sel.k, sel.T
        out.update(select_val=1, select_val_top1=sel.val_top1)
        log.info("kNN: k=%d T=%g chosen on %d held-out train images (val top-1 %.2f%%)",
                 k, T, n_val, sel.val_top1)
    kw = dict(k=k, T=T, num_classes=len(names), chunk_size=knn.chunk_size, device=device)
    res = knn_classify(train.features, train.labels, test.features, test.labels, **kw)
    write_json(details_path, res.details(names))
    out.update({"top1": res.top1, "top5": res.top5, "k": k, "T": T,
                "num_train": len(train), "num_test": len(test)})
    if knn.val_fraction > 0:
        tr, va = split_train_val(len(train), knn.val_fraction, seed)
        val = knn_classify(train.features[tr], train.labels[tr], train.features[va],
                           train.labels[va], **kw)
        out.update(val_top1=val.top1, num_val=len(va))
        log.info("kNN validation (%d train rows held out of the bank): top-1 %.2f%%",
                 len(va), val.top1)
    g_train, g_test = (load_features(features_dir / f"{s}_global.pt") for s in ("train", "test"))
    proto = knn_classify(g_train.features, g_train.labels, g_test.features, g_test.labels,
                         k=DEFAULT_K, T=DEFAULT_T, num_classes=len(names),
                         chunk_size=knn.chunk_size, device=device)
    out.update(protocol_top1=proto.top1, protocol_top5=proto.top5)
    log.info("kNN, MoCo protocol (k=%d, T=%g, global pool): top-1 %.2f%%", DEFAULT_K,
             DEFAULT_T, proto.top1)
    out["wall_time_s"] = time.time() - t0
    return out
