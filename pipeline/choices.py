"""The allowed names of the params that name a choice, defined once (imported by their users).

Each :class:`Choice` member equals its string (``BnMode.split == "split"``), so a value read
from ``params.yaml`` compares with either. The schema (:mod:`pipeline.config`) takes a choice
only as its exact name in YAML text; :class:`Switch` (``auto|true|false``) takes ``auto`` or a
YAML boolean.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic_core import core_schema

from pipeline.errors import InputError


class Choice(str, Enum):
    """The allowed names of a param; a member equals its string (``BnMode.split == "split"``).

    Every choice is defined once, here; the modules that implement it import it from here. The
    schema takes the exact name (YAML text), nothing else.
    """

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The allowed strings, in declaration order."""
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value: str, key: str) -> Choice:
        """``value`` as a member.

        Raises:
            InputError: not a member; the message names ``key`` and the allowed names.
        """
        try:
            return cls(str(value))
        except ValueError:
            raise InputError(f"{key} must be one of {', '.join(cls.names())}; got {value!r}"
                             ) from None

    @classmethod
    def _from_yaml(cls, value: Any) -> Choice:
        if isinstance(value, cls) or (type(value) is str and value in cls.names()):
            return cls(value)
        raise ValueError(f"one of {', '.join(cls.names())}")

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(cls._from_yaml)


class Switch(Choice):
    """An ``auto|true|false`` param (``model.small_stem``, ``pretrain.channels_last``, ...).

    In YAML: ``auto``, or the booleans ``true``/``false``; a quoted ``"true"`` or ``Auto`` is
    refused (``dvc.lock`` would record a second spelling of the same value).
    """

    auto = "auto"
    true = "true"
    false = "false"

    @classmethod
    def parse(cls, value: str | bool, key: str) -> Switch:
        """``value`` (a member, a bool or its name) as a member; see :meth:`Choice.parse`."""
        return super().parse(str(value).lower() if isinstance(value, bool) else value, key)

    @classmethod
    def _from_yaml(cls, value: Any) -> Switch:
        if isinstance(value, bool):
            return cls.true if value else cls.false
        if isinstance(value, cls) or (type(value) is str and value == "auto"):
            return cls(value)
        raise ValueError("auto, or true or false without quotes")

    def on(self, auto: bool) -> bool:
        """True for ``true``, False for ``false``, ``auto`` for ``auto``."""
        return auto if self is Switch.auto else self is Switch.true


class DataSource(Choice):
    """``data.source``: where the images come from (:func:`pipeline.data.sources.open_source`)."""

    fashion_mnist = "fashion_mnist"
    cifar10 = "cifar10"
    cifar100 = "cifar100"
    stl10 = "stl10"
    imagefolder = "imagefolder"
    webdataset = "webdataset"  # existing WebDataset shards with labels (``data.label_field``)
    none = "none"  # no labelled images: pretraining only (unlabelled_root / pretrain_shards)


class ShardFormat(Choice):
    """``data.shard_format``: how ``build_shards`` stores each image (:mod:`pipeline.data.build`).

    ``auto``: a JPEG file whose pixels need no change keeps its bytes (its EXIF orientation
    too: every reader applies it), a JPEG that was resized or converted is encoded as JPEG
    (quality 95), everything else (PNG, TIFF,
    Fashion-MNIST, CIFAR, STL-10 arrays) as lossless PNG. ``png``: every image as PNG (lossless;
    the only format before 2026-12-06). ``jpeg``: every image as JPEG (kept bytes where the
    file is a JPEG that needs no change, else encoded at quality 95).
    """

    auto = "auto"
    png = "png"
    jpeg = "jpeg"


class DecodeOn(Choice):
    """``pretrain.decode``: where the JPEGs of whole-image shards (``data.max_side``) decode.

    ``workers``: in the loader workers, by PIL at the reduced DCT scale the crops allow (JPEG
    draft), else by ``torchvision.io.decode_jpeg``. ``device``: the workers pass the JPEG bytes
    and the crop boxes on, and each batch is decoded on the training device
    (``torchvision.io.decode_jpeg``, nvjpeg on CUDA; :mod:`pipeline.data.jpeg`).
    """

    workers = "workers"
    device = "device"


class Backbone(Choice):
    """``model.backbone`` (:func:`pipeline.moco.backbones.build_backbone`)."""

    resnet18 = "resnet18"
    resnet34 = "resnet34"
    resnet50 = "resnet50"


class AugPreset(Choice):
    """``augment.preset``: the two-crop recipe (:mod:`pipeline.data.views` has the tables)."""

    v1 = "v1"
    v2 = "v2"
    v2_small = "v2_small"
    v2_grey = "v2_grey"

    @property
    def needs_colour(self) -> bool:
        """True for the presets whose colour jitter, grayscale and hue need 3 channels."""
        return self is not AugPreset.v2_grey


class Head(Choice):
    """``model.head``: linear (MoCo v1) or mlp (MoCo v2)."""

    linear = "linear"
    mlp = "mlp"


class BnMode(Choice):
    """``moco.bn``: how BatchNorm is kept from cheating (:mod:`pipeline.moco.batchnorm`)."""

    split = "split"
    shuffle = "shuffle"
    sync = "sync"
    none = "none"


class PrecisionName(Choice):
    """``pretrain.precision`` (:func:`pipeline.train.runtime.resolve_precision`)."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class LrSchedule(Choice):
    """``pretrain.lr_schedule`` / ``linear.lr_schedule`` (:mod:`pipeline.schedules`)."""

    cosine = "cosine"
    step = "step"


class MSchedule(Choice):
    """``moco.m_schedule`` (:func:`pipeline.moco.momentum.momentum_schedule`)."""

    constant = "constant"
    cosine = "cosine"


class LinearMode(Choice):
    """``linear.mode``: precomputed features, or augmented images through the backbone."""

    features = "features"
    augment = "augment"


class FeatureNorm(Choice):
    """``linear.feature_norm`` (:mod:`pipeline.evaluate.linear`)."""

    l2 = "l2"
    none = "none"


class KnnSelect(Choice):
    """``knn.select``: k, T as given, or chosen on a held-out split of TRAIN."""

    fixed = "fixed"
    val = "val"


class SelectMethod(Choice):
    """``selection.method`` and ``selection.compare`` (:mod:`pipeline.evaluate.selection`)."""

    random = "random"
    kcenter = "kcenter"
    typical = "typical"
    probcover = "probcover"


# ``embed.layer``: the ResNet stages whose map the embed stage may pool (torchvision's
# ``layer1..layer4``; :func:`pipeline.evaluate.pooling.set_pool_grid`).
EMBED_LAYERS = (1, 2, 3, 4)
