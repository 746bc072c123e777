"""The params that the data can refute: checked from the sources' known sizes, then the data.

Three lines of defence, each as early as its knowledge allows:

* :func:`check_params_data` (inside :func:`pipeline.config.validate`, so ``check_params``):
  what the params and the fixed-size sources' known facts (:data:`NATIVE_SIDE`,
  :data:`PRETRAIN_IMAGES`, :data:`SOURCE_MODES`) already refute;
* :func:`check_before_build` (``index_shards``): what the indexed folders and shards refute,
  before ``build_shards`` deletes anything;
* :func:`check_against_data` (``check_data`` and ``pretrain``): the built manifests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pipeline.choices import AugPreset, DataSource
from pipeline.errors import ParamsError
from pipeline.moco.geometry import check_pool_grid, small_crop_side

if TYPE_CHECKING:
    from pipeline.config import DataParams, Params
    from pipeline.data.manifest import Manifest
    from pipeline.data.plan import PretrainPlan

# Native image side of the fixed-size sources (data.image_size 0 keeps it); imagefolder: unknown.
NATIVE_SIDE = {DataSource.fashion_mnist: 28, DataSource.cifar10: 32, DataSource.cifar100: 32,
               DataSource.stl10: 96}
# Pretraining images of the fixed-size sources (their pretrain split: train; STL-10: train +
# unlabeled), so check_params can bound moco.K before any work.
PRETRAIN_IMAGES = {DataSource.fashion_mnist: 60000, DataSource.cifar10: 50000,
                   DataSource.cifar100: 50000, DataSource.stl10: 105000}
# Image mode of the fixed-size sources (their Source classes' ``mode``; tests/data/test_checks.py
# checks the two agree), so check_params can match augment.preset to grey images.
SOURCE_MODES = {DataSource.fashion_mnist: "L", DataSource.cifar10: "RGB",
                DataSource.cifar100: "RGB", DataSource.stl10: "RGB"}
log = logging.getLogger(__name__)


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ParamsError.invalid(key, value, allowed)


def image_side(p: Params) -> int:
    """Image side in px that the params fix: ``data.image_size``, else the source's native side.

    Returns 0 when only the shards know it (``imagefolder`` at ``image_size`` 0).
    """
    return p.data.image_size or NATIVE_SIDE.get(p.data.source, 0)


def check_params_data(p: Params) -> None:
    """Refuse what the params and the fixed-size sources' facts refute (own images included).

    Raises:
        ParamsError: the first violated rule, naming the dotted key.
    """
    check_own_images(p.data)
    if SOURCE_MODES.get(p.data.source) == "L" and not p.data.unlabelled_root:
        # grey labelled images fix grey pretraining (an unlabelled tree may add colour)
        check_preset_mode(p.augment.preset, "L", f"data.source {p.data.source}")
    side = image_side(p)
    if p.augment.small_crops and side:
        _check(small_crop_side(p.augment, side) < side, "augment.small_crop_size",
               p.augment.small_crop_size, f"smaller than the training image side ({side} px)")
    bound = pretrain_images_bound(p.data)
    if bound is not None:
        capped = bool(p.data.max_pretrain_images) and bound == p.data.max_pretrain_images
        where = ("at most, data.max_pretrain_images" if capped
                 else f"data.source {p.data.source}")
        check_queue_size(p.moco.K, bound, where)
        check_budget(p, bound, where)
    if side:
        check_pool_grid(p, side)


def check_own_images(d: DataParams) -> None:
    """The unlabelled tree, the pretraining shards, whole-image shards, the webdataset source.

    Raises:
        ParamsError: the first violated rule, naming the dotted key.
    """
    if d.max_side:
        _check(d.source in (DataSource.imagefolder, DataSource.webdataset)
               or bool(d.unlabelled_root), "data.max_side", d.max_side,
               "0 unless data.source is imagefolder or webdataset or data.unlabelled_root is set "
               "(fixed-size datasets keep image_size)")
        _check(0 < d.image_size <= d.max_side, "data.image_size", d.image_size,
               f"between 1 and data.max_side ({d.max_side}) when max_side is set")
    _check("://" not in d.unlabelled_root, "data.unlabelled_root", d.unlabelled_root,
           "a local directory (images on a URL: data.pretrain_shards)")
    for source, what in ((DataSource.webdataset, "the labelled shards (a directory, glob or "
                          "URL) when data.source is webdataset"),
                         (DataSource.imagefolder, "the image directory (class sub-folders) when "
                          "data.source is imagefolder")):
        _check(d.source != source or bool(d.root), "data.root", d.root, what)
    labelled = d.pretrain_labelled and d.source != DataSource.none
    none = " (data.source none has no labelled images)" if d.source == DataSource.none else ""
    _check(labelled or bool(d.unlabelled_root) or bool(d.pretrain_shards),
           "data.pretrain_labelled", d.pretrain_labelled, "true, or pretraining images from "
           "data.unlabelled_root or data.pretrain_shards" + none)


def pretrain_images_bound(d: DataParams) -> int | None:
    """An upper bound on the pretraining images that the params alone fix, else None.

    Known when the pretraining images are the labelled part of a fixed-size source
    (:data:`PRETRAIN_IMAGES`) and nothing else, or when ``data.max_pretrain_images`` caps the
    built split and no ``pretrain_shards`` are read in place.
    """
    if d.pretrain_shards:
        return None
    labelled = d.pretrain_labelled and d.source != DataSource.none
    known = None if d.unlabelled_root else (PRETRAIN_IMAGES.get(d.source) if labelled else 0)
    if d.max_pretrain_images:
        return d.max_pretrain_images if known is None else min(known, d.max_pretrain_images)
    return known


def check_queue_size(K: int, n_images: int, where: str) -> None:  # noqa: N803 (MoCo's K)
    """Refuse a queue at least as long as the pretraining set (moco#146).

    With ``K >= N`` the queue holds keys of the very images in the current batch (from earlier
    epochs) as negatives: the loss then pushes an image away from itself.

    Args:
        K: ``moco.K``.
        n_images: the number of pretraining images, or an upper bound on it.
        where: where ``n_images`` comes from, for the message.

    Raises:
        ParamsError: ``K >= n_images``; the message names both numbers and the reason.
    """
    _check(K < n_images, "moco.K", K,
           f"< {n_images}, the number of pretraining images ({where}): a queue of K >= N keys "
           "holds keys of the very images in the batch as negatives (moco#146); lower moco.K "
           "or add images")


def check_budget(p: Params, n_images: int, where: str) -> None:
    """Refuse a labelling budget larger than the images it can be picked from.

    ``selection.exclude_outliers`` of the pretraining images are never picked by the encoder
    methods (:func:`pipeline.evaluate.selection.eligible_mask`), so the largest budget must
    fit in the rest.

    Args:
        p: the params (``selection.budget``, ``selection.exclude_outliers``).
        n_images: the number of pretraining images, or an upper bound on it.
        where: where ``n_images`` comes from, for the message.

    Raises:
        ParamsError: a budget above the pickable images; the message names both numbers.
    """
    s = p.selection
    pickable = n_images - int(round(s.exclude_outliers * n_images))
    left = (f" of which selection.exclude_outliers {s.exclude_outliers:g} leaves {pickable}"
            if pickable < n_images else "")
    _check(max(s.budget) <= pickable, "selection.budget", s.budget,
           f"budgets of at most {pickable}: {n_images} pretraining images ({where}){left}, "
           "and the images to label are picked among them")


def check_preset_mode(preset: str, mode: str, where: str) -> str | None:
    """Match ``augment.preset`` to the pretraining images' channels.

    A colour preset (``v1``, ``v2``, ``v2_small``) needs 3 channels: its saturation and hue
    jitter and random grayscale have nothing to act on in a grey image, so it is refused.
    ``v2_grey`` on colour images runs (grey images stored as RGB are a real case) but leaves
    out every colour op, so a warning says what the views will lack.

    Args:
        preset: ``augment.preset``.
        mode: the pretraining images' mode, ``L`` or ``RGB`` (the evaluation data's:
            :func:`pipeline.data.index.pretrain_manifest`).
        where: what decides the mode, for the messages.

    Returns:
        The warning line for ``v2_grey`` on ``RGB`` images, else None.

    Raises:
        ParamsError: a colour preset on ``L`` images; names ``augment.preset`` and ``where``.
    """
    colour = AugPreset(preset).needs_colour
    _check(mode != "L" or not colour, "augment.preset", str(preset),
           f"v2_grey: the pretraining images are 1-channel (mode L, {where}; the evaluation "
           "data's mode decides), and a colour preset's jitter needs 3 channels")
    if mode == "RGB" and not colour:
        return (f"augment.preset v2_grey on 3-channel pretraining images (mode RGB, {where}): "
                "the views get brightness and contrast jitter only, no saturation, hue or "
                "random grayscale, so both views of an image keep its colours and the encoder "
                "can match them by colour alone; v2 (v2_small below 64 px) adds them; keep "
                "v2_grey for grey images stored as RGB")
    return None


def check_before_build(p: Params, plan: PretrainPlan) -> None:
    """Refuse, in ``index_shards``, the params that the indexed data refutes.

    Args:
        p: the validated params.
        plan: the pretraining set as the index sees it
            (:class:`pipeline.data.plan.PretrainPlan`: ``images``, ``images_from``, ``mode``,
            ``mode_from``).

    Raises:
        ParamsError: ``moco.K`` at least the pretraining images (:func:`check_queue_size`), a
            ``selection.budget`` above them (:func:`check_budget`), or a colour preset on grey
            ones (:func:`check_preset_mode`); one line naming the key, the folder(s) and shards
            counted.
    """
    check_queue_size(p.moco.K, plan.images, f"{plan.images_from}; counted by index_shards")
    warning = check_preset_mode(p.augment.preset, plan.mode, plan.mode_from)
    if warning:
        log.warning("%s", warning)
    check_budget(p, plan.images, f"{plan.images_from}; counted by index_shards")


def check_against_data(p: Params, pretrain_set: Manifest, split: object) -> None:
    """Refuse, before any training, the params that only the pretraining set can refute.

    The ``check_data`` stage runs this between ``build_shards`` and ``pretrain`` (so a refusal
    deletes none of pretrain's outputs), and ``stages/pretrain.py`` again before training:

    * ``moco.K`` at least the number of pretraining images (moco#146): :func:`check_params_data`
      already refuses it when the params fix the count (:func:`pretrain_images_bound`); with an
      unlabelled tree, an imagefolder or shards read in place only the manifest knows it.
    * A colour ``augment.preset`` (``v1``, ``v2``, ``v2_small``) on 1-channel images
      (:func:`check_preset_mode`): the pretraining set takes the evaluation data's mode
      (:func:`pipeline.data.index.pretrain_manifest`), so grey labelled images make RGB shards
      read in place grey too.
    * An ``embed.pool_grid`` the images cannot fill: :func:`check_params_data` bounds it when
      the params fix the image side; an ``imagefolder`` built at ``data.image_size`` 0 keeps its
      images' own size, which only the manifest knows. (Shards of whole images,
      ``data.max_side``, vary in size: left to ``embed``.)

    ``index_shards`` refuses the first two already, before ``build_shards``, from the index and
    the params (:func:`check_before_build`); here they are the second line, on the manifests as
    built.

    Args:
        p: the validated params.
        pretrain_set: the pretraining set's manifest
            (:func:`pipeline.data.index.pretrain_manifest`: ``num_samples``, ``image_shape``
            ``(C, H, W)`` or None for mixed sizes, ``build.parts``).
        split: where the manifest lives (a path or URL), for the messages.

    Raises:
        ParamsError: names ``moco.K`` and both numbers, ``augment.preset`` and the mode, or
            ``embed.pool_grid`` and the manifest.
    """
    build = pretrain_set.settings
    where = " + ".join(build.get("parts") or [str(split)])
    tree = build.get("unlabelled") or {}
    if tree:
        where += f"; {tree['images']} of them from data.unlabelled_root {tree['root']}"
    check_queue_size(p.moco.K, pretrain_set.num_samples, where)
    # the v2_grey-on-RGB warning is index_shards' to give (once per `dvc repro`)
    check_preset_mode(p.augment.preset, pretrain_set.mode, where)
    check_budget(p, pretrain_set.num_samples, where)
    if p.embed.pool_grid <= 1 or image_side(p):
        return
    shape = pretrain_set.image_shape  # (C, H, W); None = mixed sizes
    if shape:
        check_pool_grid(p, min(shape[1:]), where=f"{split}/manifest.json")

