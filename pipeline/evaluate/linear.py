"""Linear probe on a frozen backbone (MoCo protocol, He et al. 2020, ``main_lincls.py``).

A linear classifier is trained on frozen features with SGD (momentum 0.9, weight decay 0) at
lr 30 per 256 images, scaled to the batch (``lr_eff = lr * batch_size / 256``), for 100 epochs
with the lr multiplied by 0.1 at epochs 60 and 80 (MoCo v1 / v2 linear classification). The
classifier is initialised N(0, 0.01) with zero bias, as in MoCo. The reported top-1 / top-5 are
those of the FINAL epoch's classifier on the test set; a test score is never used to choose
anything. An optional validation split is held out of the TRAIN set.

Two modes share one training loop:

* :func:`train_linear_on_features` — fast: precomputed features of un-augmented images
  (``features/{train,test}.pt``), no augmentation.
* :func:`train_linear_augment` — the protocol proper: the caller's augmented batches
  (RandomResizedCrop + flip) go through the frozen backbone at every step; afterwards every
  backbone parameter and buffer is checked to be bit-identical to a snapshot taken before.

Feature normalisation before the classifier (``feature_norm``): ``"l2"`` (default) divides each
feature vector by its L2 norm; ``"none"`` feeds raw features as MoCo does. Why L2: MoCo's lr 30
is tuned to the small magnitudes of its own avgpool features (MoCo §4.1), so with raw features
the right lr depends on the backbone's feature scale. Unit-norm inputs make lr 30 well-behaved
whatever that scale, need no statistics (identical in both modes, nothing to estimate under
augmentation), and keep the probe linear in direction. Measured on Fashion-MNIST, 10 epochs,
lr 30, batch 256: raw pixels (mean norm 12) — none 83.5 % (final loss 19.6), l2 84.7 % (loss
0.39), per-dimension standardisation (MAE's BatchNorm without affine, computed on the train set)
81.9 % (loss 45); random-ReLU features of norm 0.37 — none 83.6 %, l2 84.8 %, standardised 83.8 %.
Standardisation puts ``|x|^2 ~ D`` into the step size, too large for SGD at lr 30, so it is not
offered.

Unlabelled rows (label -1) are ignored in both modes, with a logged count: they are never
trained on, validated or scored. Any other label outside ``0..num_classes-1`` is refused with
the value named (the rule of every evaluation entry point, :mod:`pipeline.evaluate.metrics`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from pipeline.config import FeatureNorm
from pipeline.errors import InputError, NonFiniteError
from pipeline.evaluate.features import FeatureSet
from pipeline.evaluate.heldout import split_train_val
from pipeline.evaluate.metrics import (
    UNLABELLED,
    ClassificationMetrics,
    classification_metrics,
    contiguous_labels,
    labelled_mask,
)
from pipeline.evaluate.normalize import l2_normalize, l2_normalize_rows
from pipeline.schedules import lr_schedule as lr_schedule_

log = logging.getLogger(__name__)

INIT_STD = 0.01  # classifier weight init N(0, 0.01), bias 0, as in MoCo's main_lincls.py

# (features (B, D) or images (B, C, H, W), labels (B,)), extra items (e.g. keys) ignored
Batch = Sequence[Any]


class ProbeDivergedError(NonFiniteError, FloatingPointError):
    """The linear probe's loss became NaN or Inf (the message names the epoch and linear.lr)."""


@dataclass
class LinearResult(ClassificationMetrics):
    """Linear-probe accuracy of the final-epoch classifier on the test set.

    The :class:`ClassificationMetrics` fields (top1, top5 in percent, per-class accuracy,
    confusion matrix, predictions) describe the FINAL epoch, never the best one.

    Attributes:
        history: one dict per epoch: ``epoch`` (1-based), ``lr`` (effective, this epoch),
            ``loss`` (mean train cross-entropy), ``train_top1`` (%, on the training batches as
            they were trained on), ``val_top1`` (%, only with a validation split) and
            ``test_top1`` (%, every epoch in features mode for curves; last epoch only in
            augment mode).
        val_top1: final-epoch validation top-1 in percent, None without a validation split.
        val_keys: keys of the training samples held out for validation (features mode).
        lr_effective: the initial effective lr, ``lr * batch_size / 256``.
        feature_norm: the normalisation applied before the classifier.
        classifier_state: the trained ``nn.Linear(D, C)`` state dict (CPU tensors); apply it
            after the same ``feature_norm``.
    """

    history: list[dict[str, float]] = field(default_factory=list)
    val_top1: float | None = None
    val_keys: list[str] = field(default_factory=list)
    lr_effective: float = 0.0
    feature_norm: str = "l2"
    classifier_state: dict[str, Tensor] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Numeric leaves for a metrics JSON (top1, top5, per class, val_top1 if any)."""
        out = super().metrics()
        if self.val_top1 is not None:
            out["val_top1"] = self.val_top1
        return out


def _normalize(x: Tensor, feature_norm: str) -> Tensor:
    return l2_normalize(x) if feature_norm == "l2" else x


def _rows(x: Tensor, feature_norm: str, device: torch.device) -> Tensor:
    """A whole (N, D) feature matrix as :func:`_normalize` would give it, in fp32 on ``device``.

    Normalised in row blocks (:func:`l2_normalize_rows`): one (N, D) result, no (N, D)
    temporaries; ``"none"`` keeps ``x`` itself when it already is fp32 on ``device``.
    """
    if feature_norm == "l2":
        return l2_normalize_rows(x, device)
    return x.to(device, torch.float32)


def _make_classifier(num_features: int, num_classes: int, seed: int, device: torch.device
                     ) -> nn.Linear:
    clf = nn.Linear(num_features, num_classes)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        clf.weight.normal_(0.0, INIT_STD, generator=g)
        clf.bias.zero_()
    return clf.to(device)


@torch.no_grad()
def _scores(clf: nn.Linear, encode: Callable[[Tensor], Tensor], batches: Iterable[Batch],
            feature_norm: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """(M, C) logits and (M,) labels on CPU for every batch."""
    scores, labels = [], []
    for batch in batches:
        x, y = batch[0], batch[1]
        scores.append(clf(_normalize(encode(x.to(device)), feature_norm)).float().cpu())
        labels.append(torch.as_tensor(y, dtype=torch.long).cpu())
    if not scores:
        raise InputError("linear: an evaluation set yielded no batches")
    return torch.cat(scores), torch.cat(labels)


def _top1(scores: Tensor, labels: Tensor) -> float:
    return 100.0 * (scores.argmax(dim=1) == labels).double().mean().item()


def _fit(
    clf: nn.Linear,
    encode: Callable[[Tensor], Tensor],
    train_batches: Callable[[int], Iterable[Batch]],
    *,
    lrs: list[float],
    momentum: float,
    weight_decay: float,
    feature_norm: str,
    device: torch.device,
    val_batches: Callable[[], Iterable[Batch]] | None,
    test_batches_each_epoch: Callable[[], Iterable[Batch]] | None,
    progress: bool,
) -> list[dict[str, float]]:
    """Train ``clf`` for ``len(lrs)`` epochs; returns the per-epoch history."""
    opt = torch.optim.SGD(clf.parameters(), lr=lrs[0], momentum=momentum,
                          weight_decay=weight_decay)
    history: list[dict[str, float]] = []
    bar = tqdm(lrs, desc="linear", unit="epoch", disable=None if progress else True)
    for epoch, lr in enumerate(bar):
        for group in opt.param_groups:
            group["lr"] = lr
        clf.train()
        loss_sum, correct, seen = 0.0, 0, 0
        for step, batch in enumerate(train_batches(epoch)):
            x, y = batch[0], torch.as_tensor(batch[1], dtype=torch.long).to(device)
            with torch.no_grad():
                feats = _normalize(encode(x.to(device)), feature_norm)  # B x D, no grad
            logits = clf(feats)  # B x C
            loss = F.cross_entropy(logits, y)
            if not torch.isfinite(loss):
                raise ProbeDivergedError(
                    f"linear probe: non-finite loss {loss.item()} at epoch {epoch + 1}, step "
                    f"{step} (lr {lr}); lower linear.lr"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(y)
            correct += int((logits.argmax(dim=1) == y).sum())
            seen += len(y)
        if seen == 0:
            raise InputError(f"linear: the training batches of epoch {epoch} were empty")
        clf.eval()
        row = {"epoch": epoch + 1, "lr": lr, "loss": loss_sum / seen,
               "train_top1": 100.0 * correct / seen}
        if val_batches is not None:
            row["val_top1"] = _top1(*_scores(clf, encode, val_batches(), feature_norm, device))
        if test_batches_each_epoch is not None:
            row["test_top1"] = _top1(
                *_scores(clf, encode, test_batches_each_epoch(), feature_norm, device))
        history.append(row)
    return history


def _check_common(feature_norm: str, momentum: float, weight_decay: float) -> None:
    FeatureNorm.parse(feature_norm, "linear.feature_norm")
    if not 0.0 <= momentum < 1.0:
        raise InputError(f"linear: 'momentum' = {momentum!r}; allowed: 0 <= x < 1")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise InputError(f"linear: 'weight_decay' = {weight_decay!r}; allowed: >= 0")


def _result(clf: nn.Linear, history: list[dict[str, float]], scores: Tensor, targets: Tensor,
            classes: Tensor, lr_effective: float, feature_norm: str,
            val_keys: list[str]) -> LinearResult:
    base = classification_metrics(scores, targets, classes)
    val = history[-1].get("val_top1")
    return LinearResult(
        **vars(base), history=history, val_top1=val, val_keys=val_keys,
        lr_effective=lr_effective, feature_norm=feature_norm,
        classifier_state={k: v.detach().cpu().clone() for k, v in clf.state_dict().items()},
    )


def train_linear_on_features(
    train: FeatureSet,
    test: FeatureSet,
    *,
    epochs: int = 100,
    batch_size: int = 256,
    lr: float = 30.0,
    lr_schedule: str = "step",
    milestones: Sequence[int] = (60, 80),
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    val_fraction: float = 0.0,
    seed: int = 0,
    feature_norm: str = "l2",
    num_classes: int | None = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
    test_curve: bool = True,
) -> LinearResult:
    """Linear probe on precomputed frozen features (fast mode, no augmentation).

    Defaults are MoCo's protocol: lr 30 per 256 images, SGD momentum 0.9, wd 0, 100 epochs,
    x0.1 at epochs 60 and 80. Each epoch visits the (non-validation) training rows once in a
    random order drawn from a ``torch.Generator`` seeded with ``seed`` (the last batch may be
    smaller); the classifier init uses the same seed, so a result is a function of the inputs
    and ``seed``. Labels may be any integers >= 0; the classes are the sorted union of train and
    test label values. Rows labelled -1 (unlabelled) are dropped from both sets first, with a
    logged count; the validation split is then cut from the labelled train rows.

    Args:
        train: (N, D) training features + labels (-1 = unlabelled, ignored).
        test: (M, D) test features + labels (-1 = unlabelled, ignored); used only to score the
            final classifier (and the per-epoch ``test_top1`` curve, which selects nothing).
        epochs: training epochs (``linear.epochs``).
        batch_size: images per step (``linear.batch_size``); also scales the lr.
        lr: learning rate per 256 images (``linear.lr``); effective ``lr * batch_size / 256``.
        lr_schedule: ``"step"`` or ``"cosine"`` (``linear.lr_schedule``).
        milestones: epochs of the x0.1 steps (``linear.lr_milestones``).
        weight_decay: SGD weight decay (``linear.weight_decay``, MoCo: 0).
        momentum: SGD momentum (MoCo: 0.9).
        val_fraction: share of the TRAIN set held out for validation (``linear.val_fraction``),
            split with ``seed``; 0 = none.
        seed: seed of the split, the init and the shuffling (``seed``).
        feature_norm: ``"l2"`` (default) or ``"none"``; see the module docstring.
        num_classes: C when known (the manifest's class count): labels must then lie in
            ``0..C-1`` (or be -1). It only checks; the classes are still the values that occur.
        device: where to train; the features are moved there once.
        progress: show a tqdm bar over epochs.
        test_curve: score the test set after every epoch (``history``'s ``test_top1``,
            ``plots/linear.tsv``). Scoring draws no random numbers, so the classifier and the
            final top-1 are the same without it; without it a probe on a few hundred rows
            takes a fifth of the time (the per-epoch scoring of the whole test set dominates).

    Returns:
        :class:`LinearResult` of the final epoch, on the labelled test rows.

    Raises:
        ValueError: mismatched feature dimensions, out-of-range settings, an invalid label
            (named), or a set without labelled rows.
        ProbeDivergedError: the loss became NaN or Inf (a ``FloatingPointError``).
    """
    _check_common(feature_norm, momentum, weight_decay)
    if train.features.shape[1] != test.features.shape[1]:
        raise InputError(f"linear: train D = {train.features.shape[1]} differs from test D = "
                         f"{test.features.shape[1]}")
    train = _labelled(train, "linear: train labels", num_classes)
    test = _labelled(test, "linear: test labels", num_classes)
    if len(train) == 0 or len(test) == 0:
        raise InputError("linear: the train and test sets must not be empty (labelled rows)")
    device = torch.device(device)
    lrs = lr_schedule_(base_lr=lr, batch_size=batch_size, total_steps=epochs,
                       steps_per_epoch=1, schedule=lr_schedule, milestones=milestones)
    classes, (y_train, y_test) = contiguous_labels(train.labels, test.labels)
    tr_idx, val_idx = split_train_val(len(train), val_fraction, seed)
    # The features are fixed, so each row is normalised once here rather than in every batch
    # of every epoch (rows are independent: the same bits as per batch, in half the time of a
    # 2048-d probe); ``_fit`` and ``_scores`` then take them as they are.
    # The training rows are gathered batch by batch (``x_all[rows[perm]]``: the same rows as a
    # copy of them would give, without holding N_train x D twice).
    x_all = _rows(train.features, feature_norm, device)  # N x D
    rows, y_tr = tr_idx.to(device), y_train[tr_idx].to(device)  # (N_train,)
    x_val, y_val = x_all[val_idx.to(device)], y_train[val_idx].to(device)  # N_val x D
    x_te = _rows(test.features, feature_norm, device)  # M x D
    y_te = y_test.to(device)

    shuffle = torch.Generator().manual_seed(seed)

    def train_batches(epoch: int) -> Iterable[Batch]:
        perm = torch.randperm(len(y_tr), generator=shuffle).to(device)
        for i in range(0, len(perm), batch_size):
            yield x_all[rows[perm[i : i + batch_size]]], y_tr[perm[i : i + batch_size]]

    def chunks(x: Tensor, y: Tensor) -> Callable[[], Iterable[Batch]]:
        step = 8192  # rows per evaluation block
        return lambda: ((x[i : i + step], y[i : i + step]) for i in range(0, len(y), step))

    clf = _make_classifier(x_all.shape[1], len(classes), seed, device)
    history = _fit(
        clf, lambda x: x, train_batches, lrs=lrs, momentum=momentum, weight_decay=weight_decay,
        feature_norm="none", device=device,
        val_batches=chunks(x_val, y_val) if len(val_idx) else None,
        test_batches_each_epoch=chunks(x_te, y_te) if test_curve else None, progress=progress,
    )
    scores, targets = _scores(clf, lambda x: x, chunks(x_te, y_te)(), "none", device)
    val_keys = [train.keys[i] for i in val_idx.tolist()]
    return _result(clf, history, scores, targets, classes, lrs[0], feature_norm, val_keys)


def _labelled(fs: FeatureSet, what: str, num_classes: int | None) -> FeatureSet:
    """``fs`` without its unlabelled (-1) rows; other labels checked against num_classes."""
    keep = labelled_mask(fs.labels, what=what, num_classes=num_classes)
    return fs if bool(keep.all()) else fs.subset(keep.nonzero()[:, 0])


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer (persistent or not), by qualified name."""
    out = {f"param {n}": p for n, p in module.named_parameters(remove_duplicate=False)}
    out.update({f"buffer {n}": b for n, b in module.named_buffers(remove_duplicate=False)})
    return out


def _batch_labels(y: Tensor, split: str, num_classes: int) -> Tensor:
    """(B,) bool, the labelled rows of one batch; raises on an invalid label.

    No log line per batch: the caller counts the unlabelled rows and logs once.
    """
    if bool(((y < UNLABELLED) | (y >= num_classes)).any()):  # raises, naming the value
        labelled_mask(y, what=f"linear: {split} batch labels", num_classes=num_classes)
    return y != UNLABELLED


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8),
                       b.detach().reshape(-1).view(torch.uint8))


def _frozen_encoder(backbone: nn.Module, num_features: int) -> Callable[[Tensor], Tensor]:
    """``images (B, C, H, W) -> features (B, D)`` in fp32, checking the backbone's output width."""

    def encode(images: Tensor) -> Tensor:
        feats = backbone(images)  # B x D
        if feats.ndim != 2 or feats.shape[1] != num_features:
            raise InputError(f"linear: the backbone returned {tuple(feats.shape)}, expected "
                             f"(B, num_features = {num_features})")
        return feats.float()

    return encode


class _LabelledOnly:
    """Drops rows labelled -1 from ``(images, labels)`` batches and counts them per split.

    Labels other than -1 outside ``[0, num_classes)`` raise (named); an all-unlabelled batch is
    skipped.
    """

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.ignored = {"train": 0, "val": 0, "test": 0}

    def __call__(self, batches: Iterable[Batch], split: str) -> Iterator[Batch]:
        for batch in batches:
            x, y = batch[0], torch.as_tensor(batch[1], dtype=torch.long)
            keep = _batch_labels(y, split, self.num_classes)
            if not bool(keep.all()):
                self.ignored[split] += len(y) - int(keep.sum())
                x, y = x[keep.to(x.device)], y[keep]
            if len(y):
                yield x, y

    def log_ignored(self, epochs: int) -> None:
        if any(self.ignored.values()):
            log.warning("linear: ignored rows labelled -1 (unlabelled): %d train (all %d "
                        "epochs), %d validation (all epochs), %d test", self.ignored["train"],
                        epochs, self.ignored["val"], self.ignored["test"])


def _assert_unchanged(snapshot: dict[str, Tensor], backbone: nn.Module) -> None:
    """Raise if any backbone parameter or buffer differs bit for bit from ``snapshot``.

    Raises:
        RuntimeError: names every changed, added or removed tensor.
    """
    now = _tensors(backbone)
    changed = sorted(set(snapshot) ^ set(now))
    changed += [n for n in snapshot if n in now and not _same_bits(snapshot[n], now[n])]
    if changed:
        raise RuntimeError(
            "linear probe: the frozen backbone changed during training: " + ", ".join(changed)
        )


def train_linear_augment(
    backbone: nn.Module,
    train_batches: Callable[[int], Iterable[Batch]],
    test_batches: Iterable[Batch],
    *,
    num_features: int,
    num_classes: int,
    batch_size: int,
    epochs: int = 100,
    lr: float = 30.0,
    lr_schedule: str = "step",
    milestones: Sequence[int] = (60, 80),
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    seed: int = 0,
    val_batches: Callable[[], Iterable[Batch]] | None = None,
    feature_norm: str = "l2",
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> LinearResult:
    """Linear probe with train-time augmentation through the frozen backbone (MoCo protocol).

    The backbone runs in eval mode (BatchNorm uses, and never updates, its running statistics)
    under ``torch.no_grad``; only the ``nn.Linear(num_features, num_classes)`` classifier is
    optimised. Every submodule's train/eval flag is restored afterwards. After the final test
    pass, every backbone parameter and buffer (BN running statistics and ``num_batches_tracked``
    included, non-persistent buffers too) is compared bit for bit with a snapshot taken before
    training (the snapshot is a clone on the backbone's device: one extra copy of the weights).

    The caller builds the data: ``train_batches(epoch)`` yields freshly augmented batches
    (RandomResizedCrop + horizontal flip, shuffled with its own seed) of at most ``batch_size``
    images; ``test_batches`` (center crop) is read once at the end. A validation split, if any,
    must be cut from the TRAIN set by the caller (:func:`split_train_val`) and is evaluated after
    every epoch. Labels are class indices in ``[0, num_classes)``; rows labelled -1 (unlabelled)
    are dropped from every batch (an all-unlabelled batch is skipped) and their count is logged
    at the end, per split. Defaults as in
    :func:`train_linear_on_features` (MoCo: lr 30 per 256, wd 0, 100 epochs, steps at 60/80).

    Args:
        backbone: maps (B, C, H, W) images to (B, num_features) features; on ``device``.
        train_batches: epoch (0-based) -> iterable of ``(images (B, C, H, W), labels (B,))``.
        test_batches: iterable of ``(images, labels)``; extra tuple items (keys) are ignored.
        num_features: D, the backbone's output width.
        num_classes: C.
        batch_size: nominal images per step, used for the lr scaling ``lr * batch_size / 256``.
        epochs: training epochs.
        lr: learning rate per 256 images.
        lr_schedule: ``"step"`` or ``"cosine"``.
        milestones: epochs of the x0.1 steps.
        weight_decay: SGD weight decay.
        momentum: SGD momentum.
        seed: seed of the classifier init.
        val_batches: () -> iterable of validation ``(images, labels)``, or None.
        feature_norm: ``"l2"`` (default) or ``"none"``; see the module docstring.
        device: where images are sent and the classifier lives.
        progress: show a tqdm bar over epochs.

    Returns:
        :class:`LinearResult` of the final epoch (``classes`` = ``range(num_classes)``).

    Raises:
        ValueError: out-of-range settings, a label outside ``[0, num_classes)`` other than -1
            (named), a backbone output that is not (B, num_features), or an empty epoch / test
            set.
        ProbeDivergedError: the loss became NaN or Inf (a ``FloatingPointError``).
        RuntimeError: a backbone parameter or buffer changed during the probe (names listed).
    """
    _check_common(feature_norm, momentum, weight_decay)
    if num_features < 1 or num_classes < 1:
        raise InputError(f"linear: num_features = {num_features}, num_classes = {num_classes}; "
                         "allowed: >= 1")
    device = torch.device(device)
    lrs = lr_schedule_(base_lr=lr, batch_size=batch_size, total_steps=epochs,
                       steps_per_epoch=1, schedule=lr_schedule, milestones=milestones)
    snapshot = {n: t.detach().clone() for n, t in _tensors(backbone).items()}
    modes = [(m, m.training) for m in backbone.modules()]
    encode = _frozen_encoder(backbone, num_features)
    keep = _LabelledOnly(num_classes)
    clf = _make_classifier(num_features, num_classes, seed, device)
    try:
        backbone.eval()
        history = _fit(
            clf, encode, lambda e: keep(train_batches(e), "train"), lrs=lrs,
            momentum=momentum, weight_decay=weight_decay, feature_norm=feature_norm,
            device=device, test_batches_each_epoch=None, progress=progress,
            val_batches=(lambda: keep(val_batches(), "val")) if val_batches is not None
            else None,
        )
        scores, targets = _scores(clf, encode, keep(test_batches, "test"), feature_norm, device)
    finally:
        for mod, was_training in modes:
            mod.training = was_training
    keep.log_ignored(epochs)
    _assert_unchanged(snapshot, backbone)
    history[-1]["test_top1"] = _top1(scores, targets)
    return _result(clf, history, scores, targets, torch.arange(num_classes), lrs[0],
                   feature_norm, [])
