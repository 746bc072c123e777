"""The params schema: one dataclass per ``params.yaml`` section, loaded strictly with OmegaConf.

Every stage calls :func:`load_params` before doing any work. An unknown key, a value of the
wrong type or a value out of range raises :class:`ParamsError` with ONE message that names the
dotted key (the same name DVC uses, e.g. ``moco.K``) and what is allowed.

Defaults here equal the shipped ``params.yaml`` (the Fashion-MNIST CPU recipe); presets for other
scales live in ``configs/`` as whole params files.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from pipeline.errors import InputError

if TYPE_CHECKING:
    from pipeline.data.index import PretrainPlan


class Choice(str, Enum):
    """The allowed names of a param; a member equals its string (``BnMode.split == "split"``).

    OmegaConf validates an Enum-typed field against the member names, so every choice below is
    defined once, here, and the modules that implement it import it from here.
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
            ValueError: not a member; the message names ``key`` and the allowed names.
        """
        try:
            return cls(str(value))
        except ValueError:
            raise InputError(f"{key} must be one of {', '.join(cls.names())}; got {value!r}"
                             ) from None


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

    ``auto``: a JPEG file whose pixels need no change keeps its bytes, a JPEG that was resized,
    turned upright or converted is encoded as JPEG (quality 95), everything else (PNG, TIFF,
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


# ``embed.layer``: the ResNet stages whose map the embed stage may pool (torchvision's
# ``layer1..layer4``; :func:`pipeline.evaluate.pooling.set_pool_grid`).
EMBED_LAYERS = (1, 2, 3, 4)


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


# Native image side of the fixed-size sources (data.image_size 0 keeps it); imagefolder: unknown.
NATIVE_SIDE = {DataSource.fashion_mnist: 28, DataSource.cifar10: 32, DataSource.cifar100: 32,
               DataSource.stl10: 96}
# Pretraining images of the fixed-size sources (their pretrain split: train; STL-10: train +
# unlabeled), so check_params can bound moco.K before any work.
PRETRAIN_IMAGES = {DataSource.fashion_mnist: 60000, DataSource.cifar10: 50000,
                   DataSource.cifar100: 50000, DataSource.stl10: 105000}
# Image mode of the fixed-size sources (their Source classes' ``mode``; tests/test_config.py
# checks the two agree), so check_params can match augment.preset to grey images.
SOURCE_MODES = {DataSource.fashion_mnist: "L", DataSource.cifar10: "RGB",
                DataSource.cifar100: "RGB", DataSource.stl10: "RGB"}
FORBIDDEN_KEYS = ("size", "nfiles")  # DVC's run cache ignores params with these names
log = logging.getLogger(__name__)


class ParamsError(InputError):
    """A params file that does not satisfy the schema (message names the key).

    Args:
        message: the one-line message.
        key: the dotted key it is about, when one is (:func:`check_params_file` reads it).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass
class MlflowParams:
    """MLflow tracking switches (the URI comes from ``MLFLOW_TRACKING_URI`` or the repo root)."""

    enabled: bool = True
    experiment: str = "moco-pipeline"
    registered_model: str = "moco-encoder"  # "" = log the encoder model, register no version


@dataclass
class DataParams:
    """Where the images come from and how they are sharded.

    ``max_*_images = 0`` means "all"; ``max_pretrain_images`` caps the BUILT pretrain split (the
    labelled source's part and ``unlabelled_root`` together), not ``pretrain_shards``, which are
    read whole. ``test_fraction`` applies to an ImageFolder without ``train/`` and ``test/``
    sub-folders and to the ``webdataset`` source. The pretraining images are the union of the
    labelled source's pretrain split (``pretrain_labelled``), the ``unlabelled_root`` tree and the
    ``pretrain_shards`` read in place (docs/data.md, "Your own images").
    """

    source: DataSource = DataSource.fashion_mnist
    root: str = ""  # "" = the source's default location (see pipeline.data.sources)
    download: bool = False  # allow torchvision to download when the raw files are missing
    image_size: int = 0  # 0 = native; else resize (shorter side) + center crop, in px
    # ImageFolder only: > 0 = shards keep the whole image, shorter side shrunk to max_side px
    # (no crop); image_size is then the training crop / evaluation size. 0 = off.
    max_side: int = 0
    # auto = a JPEG that needs no pixel change keeps its bytes, a changed JPEG is encoded as
    # JPEG (quality 95), everything else as PNG (lossless) | png = all PNG | jpeg = all JPEG
    shard_format: ShardFormat = ShardFormat.auto
    max_pretrain_images: int = 0
    max_train_images: int = 0
    max_test_images: int = 0
    samples_per_shard: int = 10000
    test_fraction: float = 0.2
    shards_dir: str = "data/shards"
    # An image tree without class folders (any nesting, sizes, modes): its images join the
    # pretrain split with label -1. "" = none. Local directory.
    unlabelled_root: str = ""
    pretrain_labelled: bool = True  # the labelled source's pretrain split joins pretraining
    # Existing WebDataset shards read in place for pretraining (never copied): a directory, a
    # glob or a URL, with {000000..000123} braces; img2dataset layout. "" = none.
    pretrain_shards: str = ""
    label_field: str = "cls"  # data.source webdataset: the .cls member, else this .json field
    # WebDataset shards (pretrain_shards, the webdataset source): undecodable samples are
    # skipped and counted up to this share of the samples; more stops the stage. Local image
    # folders (unlabelled_root, an imagefolder root): files that do not decode are listed in
    # data/index/folders.json and left out up to this share of each folder's images.
    max_broken_fraction: float = 0.001


@dataclass
class AugmentParams:
    """Two-crop augmentation preset (:mod:`pipeline.data.views` has the published tables)."""

    preset: AugPreset = AugPreset.v2_grey
    # RandomResizedCrop scale lower bound (MoCo v1/v2: 0.2; 0.5 for 28 px: results/sweep-*.md)
    crop_min_scale: float = 0.5
    # Multi-crop (SwAV / DINO local crops): extra small query crops per image, encoded by the
    # query encoder only and contrasted with the image's key and the queue. 0 = off.
    small_crops: int = 0
    small_crop_size: int = 0  # side in px; 0 = half the training image side
    small_crop_min_scale: float = 0.05  # RandomResizedCrop area range (DINO local crops: 0.05-0.4)
    small_crop_max_scale: float = 0.4


@dataclass
class ModelParams:
    """Backbone and projection head."""

    backbone: Backbone = Backbone.resnet18
    width: int = 32  # channels of the first stage (torchvision: 64); 32 = 256-d features
    small_stem: str = "auto"  # auto|true|false; auto = 3x3 stem, no max-pool below 64 px
    stem_stride: int = 2  # stride of the small stem's 3x3 conv: 1 (CIFAR demo) or 2 (28 px -> 14)
    head: Head = Head.mlp  # linear (MoCo v1) or mlp (MoCo v2)
    head_hidden: int = 512  # MLP hidden width (MoCo v2 uses the backbone's feature width)
    dim: int = 128  # key/query dimension D, MoCo v1/v2


@dataclass
class MocoParams:
    """The dictionary and the contrastive loss."""

    K: int = 4096  # queue length (MoCo CIFAR demo: 4096)
    m: float = 0.99  # momentum of the key encoder (weight on the OLD value)
    m_schedule: MSchedule = MSchedule.constant
    T: float = 0.1  # softmax temperature (MoCo CIFAR demo 0.1; v1 0.07; v2 0.2)
    symmetric: bool = False
    bn: BnMode = BnMode.split  # split (one device) | shuffle (DDP) | sync (SyncBN) | none
    bn_splits: int = 2  # groups for SplitBatchNorm (MoCo CIFAR demo: 8)


@dataclass
class PretrainParams:
    """Optimisation of the query encoder. ``lr`` is per 256 images (scaled to the global batch)."""

    epochs: int = 7
    steps_per_epoch: int = 0  # 0 = pretrain images // batch_size (true epoch); at most that
    batch_size: int = 64  # global batch (split across DDP ranks)
    lr: float = 0.12  # per 256 images (MoCo CIFAR demo: 0.03; results/sweep-*.md)
    lr_schedule: LrSchedule = LrSchedule.cosine
    lr_milestones: list[int] = field(default_factory=lambda: [120, 160])  # epochs, step schedule
    warmup_epochs: float = 0.25
    weight_decay: float = 5e-4
    sgd_momentum: float = 0.9
    precision: PrecisionName = PrecisionName.auto
    channels_last: str = "auto"  # auto|true|false; auto = CUDA only
    compile: str = "auto"  # auto|true|false torch.compile of the encoders; auto = CUDA only
    num_threads: int = 0  # CPU intra-op threads; 0 = auto (probe all usable cores vs half)
    # loader worker processes: an integer >= 0, or auto (CUDA: the usable cores per process on
    # the node less one for the training process; CPU: 1, the training needs the cores)
    num_workers: str = "1"
    # where whole-image shards' JPEGs (data.max_side) decode: workers (PIL at a reduced DCT
    # scale, else torchvision) | device (batched decode_jpeg on the training device: nvjpeg)
    decode: DecodeOn = DecodeOn.workers
    deterministic: bool = True
    checkpoint_every_epochs: int = 1
    checkpoint_every_steps: int = 50  # also checkpoint every N steps (0 = only per epoch)
    knn_every_epochs: int = 1  # 0 = no monitor (kNN with labels, label-free numbers always)
    knn_monitor_train_images: int = 10000
    knn_monitor_test_images: int = 2000
    labelfree_images: int = 2048  # RankMe / alignment / uniformity sample; 0 = off
    log_every_steps: int = 10


@dataclass
class EmbedParams:
    """Frozen feature extraction."""

    batch_size: int = 512
    use_head: bool = False  # True = features after the projection head
    # The ResNet stage whose map is pooled: 1..4 (torchvision's layer1..layer4); 4 = the last
    # stage, the MoCo / InstDisc protocol. The stages after it are not run. 3: the Fashion-MNIST
    # default (results/layer-features-2026-12-04.md: +2.5 kNN points over layer 4, two seeds).
    layer: int = 3
    # Adaptive average pooling of that map to pool_grid x pool_grid cells, flattened
    # (C * pool_grid**2 features). 1 = global average pooling (the MoCo / InstDisc protocol);
    # 4 keeps the whole 4 x 4 map of a 28 px image's layer3 (Fashion-MNIST default, README).
    pool_grid: int = 4


@dataclass
class KnnParams:
    """Weighted kNN (InstDisc protocol, MoCo CIFAR demo: k=200, T=0.1)."""

    k: int = 10  # with select = fixed (InstDisc / MoCo demo: 200)
    T: float = 0.1
    chunk_size: int = 1024  # test images per similarity chunk
    val_fraction: float = 0.0  # > 0: also score kNN on this share of TRAIN held out of the bank
    # val = k, T chosen on 10 % of TRAIN, like the pixel kNN | fixed = knn.k, knn.T
    select: KnnSelect = KnnSelect.val


@dataclass
class LinearParams:
    """Linear probe (MoCo protocol: lr 30 per 256, wd 0, 100 epochs, steps at 60/80)."""

    # features (precomputed, fast) | augment (RandomResizedCrop + flip through the backbone)
    mode: LinearMode = LinearMode.features
    epochs: int = 100
    batch_size: int = 256
    lr: float = 30.0  # per 256 images
    lr_schedule: LrSchedule = LrSchedule.step
    lr_milestones: list[int] = field(default_factory=lambda: [60, 80])
    weight_decay: float = 0.0
    val_fraction: float = 0.0  # held out of the TRAIN set (never the test set)
    feature_norm: FeatureNorm = FeatureNorm.l2  # l2 | none (MoCo main_lincls: raw, at lr 30)


@dataclass
class LabelEfficiencyParams:
    """The label-efficiency curve: probes fitted on a few labelled images per class."""

    per_class: list[int] = field(default_factory=lambda: [1, 2, 5, 10, 25, 100])
    draws: int = 3  # seeded draws per point (mean and spread)


@dataclass
class InsightsParams:
    """Near-duplicates and outliers of the pretraining images (the ``data_insights`` stage)."""

    # A pair whose global-pool features have at least this cosine is a near-duplicate. 0.998,
    # measured with the default encoder on the 60,000 Fashion-MNIST images plus planted copies:
    # every exact copy and 99 % of JPEG re-encodes (q 75-90), 83 pairs of distinct real images
    # (results/near-duplicates-2026-12-06.md)
    duplicate_cosine: float = 0.998
    # Neighbours per image: pairs are looked for among them, and the outlier score is the mean
    # cosine to them (k-nearest-neighbour outlier score, Ramaswamy et al. 2000)
    neighbours: int = 10
    listed: int = 1000  # pairs and outliers listed in eval/data_insights.json (counts cover all)


@dataclass
class ReportParams:
    """Report figures."""

    tsne_points: int = 2000
    retrieval_queries: int = 8
    retrieval_neighbours: int = 8
    insight_images: int = 12  # near-duplicate pairs and outliers shown as thumbnails, each


@dataclass
class Params:
    """The whole ``params.yaml``."""

    seed: int = 0
    mlflow: MlflowParams = field(default_factory=MlflowParams)
    data: DataParams = field(default_factory=DataParams)
    augment: AugmentParams = field(default_factory=AugmentParams)
    model: ModelParams = field(default_factory=ModelParams)
    moco: MocoParams = field(default_factory=MocoParams)
    pretrain: PretrainParams = field(default_factory=PretrainParams)
    embed: EmbedParams = field(default_factory=EmbedParams)
    knn: KnnParams = field(default_factory=KnnParams)
    linear: LinearParams = field(default_factory=LinearParams)
    label_efficiency: LabelEfficiencyParams = field(default_factory=LabelEfficiencyParams)
    insights: InsightsParams = field(default_factory=InsightsParams)
    report: ReportParams = field(default_factory=ReportParams)


def _check(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ParamsError(f"params: '{key}' = {value!r} is invalid; allowed: {allowed}", key)


def _pos(key: str, v: float, strict: bool = True) -> None:
    ok = math.isfinite(v) and (v > 0 if strict else v >= 0)
    _check(ok, key, "> 0" if strict else ">= 0", v)


def _one_of(key: str, v: str, names: tuple[str, ...]) -> None:
    _check(v in names, key, "one of " + ", ".join(names), v)


def _milestones(key: str, v: list[int]) -> None:
    _check(all(m > 0 for m in v) and list(v) == sorted(v), key, "increasing positive epochs", v)


def _switch(key: str, obj: Any, attr: str, names: tuple[str, ...]) -> None:
    """Lower-case a YAML true/false that arrived as "True"/"False", then check the name."""
    v = str(getattr(obj, attr)).lower()
    setattr(obj, attr, v)
    _one_of(key, v, names)


def last_stage_side(side: int, small_stem: str | bool, stem_stride: int, layer: int = 4) -> int:
    """Side of a ResNet's ``layer{layer}`` map for ``side`` px inputs (``embed.pool_grid``'s bound).

    Every stride-2 layer (3x3 pad 1, 7x7 pad 3, the max-pool, the 1x1 downsample) maps n to
    ceil(n / 2). The small stem (``auto`` = below 64 px, as
    :func:`pipeline.moco.backbones.resolve_small_stem`) divides by ``stem_stride``; the ImageNet
    stem by 4; then ``layer2..layer{layer}`` halve ``layer - 1`` times. 28 px with the stride-2
    small stem: 4 after ``layer3``, 2 after ``layer4`` (the last stage; this function's default
    ``layer``, not ``embed.layer``'s).
    """
    def halve(n: int, by: int = 2) -> int:
        return (n + by - 1) // by

    small = side < 64 if small_stem == "auto" else small_stem in (True, "true")
    n = halve(side, stem_stride) if small else halve(halve(side))
    for _ in range(layer - 1):
        n = halve(n)
    return n


def image_side(p: Params) -> int:
    """Image side in px that the params fix: ``data.image_size``, else the source's native side.

    Returns 0 when only the shards know it (``imagefolder`` at ``image_size`` 0).
    """
    return p.data.image_size or NATIVE_SIDE.get(p.data.source, 0)


def small_crop_side(augment: AugmentParams, side: int) -> int:
    """The small crops' side in px: ``augment.small_crop_size``, or half of ``side`` when 0."""
    return augment.small_crop_size or max(1, side // 2)


def check_pool_grid(p: Params, side: int, where: str = "") -> None:
    """Refuse an ``embed.pool_grid`` larger than the ``embed.layer`` map of ``side`` px images.

    Args:
        p: the params (``embed.pool_grid``, ``embed.layer``, ``model.small_stem``,
            ``model.stem_stride``).
        side: image side in px (:func:`image_side`, or a shard manifest's ``image_shape``).
        where: where ``side`` came from, for the message (e.g. a manifest path).

    Raises:
        ParamsError: the grid does not fit; the message names ``embed.pool_grid``, the map and
            the largest grid that fits.
    """
    if p.embed.pool_grid <= 1:
        return
    last = last_stage_side(side, p.model.small_stem, p.model.stem_stride, p.embed.layer)
    src = f" ({where})" if where else ""
    _check(p.embed.pool_grid <= last, "embed.pool_grid",
           f"<= {last}: {side} px images{src} leave a {last} x {last} map after "
           f"layer{p.embed.layer} (embed.layer; model.small_stem {p.model.small_stem}, "
           f"stem_stride {p.model.stem_stride})", p.embed.pool_grid)


def _validate_mlflow(p: Params) -> None:
    # MLflow refuses '/' and ':' in a registered model name; '@' would split a models:/ URI
    name = p.mlflow.registered_model
    _check(name == "" or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name) is not None,
           "mlflow.registered_model", "'' or letters, digits, '.', '_', '-' (at most 100)", name)


def _validate_data(p: Params) -> None:
    _pos("seed", p.seed, strict=False)
    _pos("data.image_size", p.data.image_size, strict=False)
    for k in ("max_pretrain_images", "max_train_images", "max_test_images"):
        _pos(f"data.{k}", getattr(p.data, k), strict=False)
    _pos("data.samples_per_shard", p.data.samples_per_shard)
    _pos("data.max_side", p.data.max_side, strict=False)
    if p.data.max_side:
        _check(p.data.source in (DataSource.imagefolder, DataSource.webdataset)
               or bool(p.data.unlabelled_root), "data.max_side",
               "0 unless data.source is imagefolder or webdataset or data.unlabelled_root is set "
               "(fixed-size datasets keep image_size)", p.data.max_side)
        _check(0 < p.data.image_size <= p.data.max_side, "data.image_size",
               f"between 1 and data.max_side ({p.data.max_side}) when max_side is set",
               p.data.image_size)
    _check(0 < p.data.test_fraction < 1, "data.test_fraction", "0 < x < 1", p.data.test_fraction)
    _check(bool(p.data.shards_dir), "data.shards_dir", "a non-empty path or URL",
           p.data.shards_dir)
    _validate_own_images(p.data)
    if SOURCE_MODES.get(p.data.source) == "L" and not p.data.unlabelled_root:
        # grey labelled images fix grey pretraining (an unlabelled tree may add colour)
        check_preset_mode(p.augment.preset, "L", f"data.source {p.data.source}")
    _check(0 < p.augment.crop_min_scale <= 1, "augment.crop_min_scale", "0 < x <= 1",
           p.augment.crop_min_scale)
    a = p.augment
    _pos("augment.small_crops", a.small_crops, strict=False)
    _pos("augment.small_crop_size", a.small_crop_size, strict=False)
    _check(0 < a.small_crop_min_scale <= a.small_crop_max_scale <= 1,
           "augment.small_crop_min_scale",
           f"0 < x <= augment.small_crop_max_scale ({a.small_crop_max_scale}) <= 1",
           a.small_crop_min_scale)
    if a.small_crops:
        _check(not p.moco.symmetric, "augment.small_crops", "0 with moco.symmetric: true",
               a.small_crops)
        _check(not p.data.max_side, "augment.small_crops",
               "0 with data.max_side (whole images are cropped per image in the loader)",
               a.small_crops)
        side = image_side(p)
        if side:
            _check(small_crop_side(a, side) < side, "augment.small_crop_size",
                   f"smaller than the training image side ({side} px)", a.small_crop_size)


def _validate_own_images(d: DataParams) -> None:
    """The unlabelled tree, the pretraining shards and the webdataset source."""
    _check("://" not in d.unlabelled_root, "data.unlabelled_root",
           "a local directory (images on a URL: data.pretrain_shards)", d.unlabelled_root)
    _check(d.source != DataSource.webdataset or bool(d.root), "data.root",
           "the labelled shards (a directory, glob or URL) when data.source is webdataset",
           d.root)
    _check(d.source != DataSource.imagefolder or bool(d.root), "data.root",
           "the image directory (class sub-folders) when data.source is imagefolder", d.root)
    _check(bool(d.label_field.strip()), "data.label_field",
           "cls (the .cls member) or the name of a .json field", d.label_field)
    _check(0 <= d.max_broken_fraction < 1, "data.max_broken_fraction", "0 <= x < 1",
           d.max_broken_fraction)
    labelled = d.pretrain_labelled and d.source != DataSource.none
    none = " (data.source none has no labelled images)" if d.source == DataSource.none else ""
    _check(labelled or bool(d.unlabelled_root) or bool(d.pretrain_shards),
           "data.pretrain_labelled", "true, or pretraining images from data.unlabelled_root or "
           "data.pretrain_shards" + none, d.pretrain_labelled)


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
    _check(K < n_images, "moco.K",
           f"< {n_images}, the number of pretraining images ({where}): a queue of K >= N keys "
           "holds keys of the very images in the batch as negatives (moco#146); lower moco.K "
           "or add images", K)


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
    _check(mode != "L" or not colour, "augment.preset",
           f"v2_grey: the pretraining images are 1-channel (mode L, {where}; the evaluation "
           "data's mode decides), and a colour preset's jitter needs 3 channels", str(preset))
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
            (:class:`pipeline.data.index.PretrainPlan`: ``images``, ``images_from``, ``mode``,
            ``mode_from``).

    Raises:
        ParamsError: ``moco.K`` at least the pretraining images (:func:`check_queue_size`), or
            a colour preset on grey ones (:func:`check_preset_mode`); one line naming the key,
            the folder(s) and shards counted.
    """
    check_queue_size(p.moco.K, plan.images, f"{plan.images_from}; counted by index_shards")
    warning = check_preset_mode(p.augment.preset, plan.mode, plan.mode_from)
    if warning:
        log.warning("%s", warning)


def check_against_data(p: Params, pretrain_set: dict[str, Any], split: object) -> None:
    """Refuse, before any training, the params that only the pretraining set can refute.

    The ``check_data`` stage runs this between ``build_shards`` and ``pretrain`` (so a refusal
    deletes none of pretrain's outputs), and ``stages/pretrain.py`` again before training:

    * ``moco.K`` at least the number of pretraining images (moco#146): :func:`validate` already
      refuses it when the params fix the count (:func:`pretrain_images_bound`); with an
      unlabelled tree, an imagefolder or shards read in place only the manifest knows it.
    * A colour ``augment.preset`` (``v1``, ``v2``, ``v2_small``) on 1-channel images
      (:func:`check_preset_mode`): the pretraining set takes the evaluation data's mode
      (:func:`pipeline.data.index.pretrain_manifest`), so grey labelled images make RGB shards
      read in place grey too.
    * An ``embed.pool_grid`` the images cannot fill: :func:`validate` bounds it when the params
      fix the image side; an ``imagefolder`` built at ``data.image_size`` 0 keeps its images'
      own size, which only the manifest knows. (Shards of whole images, ``data.max_side``, vary
      in size: left to ``embed``.)

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
    build = pretrain_set.get("build", {})
    where = " + ".join(build.get("parts") or [str(split)])
    tree = build.get("unlabelled") or {}
    if tree:
        where += f"; {tree['images']} of them from data.unlabelled_root {tree['root']}"
    check_queue_size(p.moco.K, int(pretrain_set["num_samples"]), where)
    # the v2_grey-on-RGB warning is index_shards' to give (once per `dvc repro`)
    check_preset_mode(p.augment.preset, pretrain_set.get("mode", "RGB"), where)
    if p.embed.pool_grid <= 1 or image_side(p):
        return
    shape = pretrain_set.get("image_shape")  # (C, H, W); None = mixed sizes
    if shape:
        check_pool_grid(p, min(shape[1:]), where=f"{split}/manifest.json")


def _validate_model(p: Params) -> None:
    _pos("model.width", p.model.width)
    _switch("model.small_stem", p.model, "small_stem", ("auto", "true", "false"))
    _check(p.model.stem_stride in (1, 2), "model.stem_stride", "1 or 2", p.model.stem_stride)
    _pos("model.head_hidden", p.model.head_hidden)
    _pos("model.dim", p.model.dim)
    _check(p.moco.K >= 1, "moco.K", ">= 1", p.moco.K)
    _check(0.0 <= p.moco.m <= 1.0, "moco.m", "0 <= m <= 1", p.moco.m)
    _pos("moco.T", p.moco.T)
    _pos("moco.bn_splits", p.moco.bn_splits)


def _validate_pretrain(p: Params) -> None:
    t = p.pretrain
    for k in ("epochs", "batch_size", "lr", "checkpoint_every_epochs", "knn_monitor_train_images",
              "knn_monitor_test_images", "log_every_steps"):
        _pos(f"pretrain.{k}", getattr(t, k))
    for k in ("steps_per_epoch", "warmup_epochs", "weight_decay", "num_threads",
              "checkpoint_every_steps", "knn_every_epochs", "labelfree_images"):
        _pos(f"pretrain.{k}", getattr(t, k), strict=False)
    _check(t.num_workers == "auto" or t.num_workers.isdigit(), "pretrain.num_workers",
           "auto or an integer >= 0", t.num_workers)
    _milestones("pretrain.lr_milestones", t.lr_milestones)
    _check(t.warmup_epochs < t.epochs, "pretrain.warmup_epochs", "< pretrain.epochs",
           t.warmup_epochs)
    _check(0 <= t.sgd_momentum < 1, "pretrain.sgd_momentum", "0 <= x < 1", t.sgd_momentum)
    for k in ("channels_last", "compile"):
        _switch(f"pretrain.{k}", t, k, ("auto", "true", "false"))
    n = p.data.max_pretrain_images  # an upper bound on the pretraining images when set
    if n and not p.data.pretrain_shards:
        _check(t.batch_size <= n, "pretrain.batch_size",
               f"<= data.max_pretrain_images ({n})", t.batch_size)
        _check(t.steps_per_epoch * t.batch_size <= n, "pretrain.steps_per_epoch",
               f"at most one epoch: steps_per_epoch * batch_size <= data.max_pretrain_images "
               f"({n})", t.steps_per_epoch)
    bound = pretrain_images_bound(p.data)
    if bound is not None:
        capped = bool(p.data.max_pretrain_images) and bound == p.data.max_pretrain_images
        check_queue_size(p.moco.K, bound, "at most, data.max_pretrain_images" if capped
                         else f"data.source {p.data.source}")
    if p.moco.bn == "split":
        _check(t.batch_size % p.moco.bn_splits == 0, "moco.bn_splits",
               f"a divisor of pretrain.batch_size ({t.batch_size})", p.moco.bn_splits)


def _validate_evaluation(p: Params) -> None:
    _pos("embed.batch_size", p.embed.batch_size)
    _pos("embed.pool_grid", p.embed.pool_grid)
    _check(p.embed.layer in EMBED_LAYERS, "embed.layer",
           f"one of {', '.join(map(str, EMBED_LAYERS))} (the ResNet stage whose map is pooled)",
           p.embed.layer)
    if p.embed.use_head and p.embed.layer != 4 and p.embed.pool_grid != 1:  # both, in one
        raise ParamsError(
            "params: 'embed.use_head' = true needs embed.layer 4 and embed.pool_grid 1 (the "
            "head takes the last stage's globally pooled (N, C) features); here embed.layer = "
            f"{p.embed.layer} and embed.pool_grid = {p.embed.pool_grid}", "embed.use_head")
    _check(p.embed.pool_grid == 1 or not p.embed.use_head, "embed.pool_grid",
           "1 with embed.use_head: true (the head takes pooled (N, C) features)",
           p.embed.pool_grid)
    _check(p.embed.layer == 4 or not p.embed.use_head, "embed.layer",
           "4 with embed.use_head: true (the head takes the last stage's features)",
           p.embed.layer)
    side = image_side(p)
    if side:
        check_pool_grid(p, side)
    _pos("knn.k", p.knn.k)
    _pos("knn.T", p.knn.T)
    _pos("knn.chunk_size", p.knn.chunk_size)
    _check(0 <= p.knn.val_fraction < 1, "knn.val_fraction", "0 <= x < 1", p.knn.val_fraction)
    lp = p.linear
    _pos("linear.epochs", lp.epochs)
    _pos("linear.batch_size", lp.batch_size)
    _pos("linear.lr", lp.lr)
    _milestones("linear.lr_milestones", lp.lr_milestones)
    _pos("linear.weight_decay", lp.weight_decay, strict=False)
    _check(0 <= lp.val_fraction < 1, "linear.val_fraction", "0 <= x < 1", lp.val_fraction)
    _pos("report.tsne_points", p.report.tsne_points, strict=False)
    _pos("report.retrieval_queries", p.report.retrieval_queries, strict=False)
    _pos("report.retrieval_neighbours", p.report.retrieval_neighbours)


def _validate_label_efficiency(p: Params) -> None:
    le = p.label_efficiency
    _check(bool(le.per_class) and all(n > 0 for n in le.per_class)
           and list(le.per_class) == sorted(set(le.per_class)), "label_efficiency.per_class",
           "a non-empty list of increasing image counts per class, each >= 1", le.per_class)
    _pos("label_efficiency.draws", le.draws)


def _validate_insights(p: Params) -> None:
    ins = p.insights
    _check(math.isfinite(ins.duplicate_cosine) and -1 < ins.duplicate_cosine <= 1,
           "insights.duplicate_cosine", "a cosine similarity, -1 < x <= 1", ins.duplicate_cosine)
    _pos("insights.neighbours", ins.neighbours)
    _pos("insights.listed", ins.listed, strict=False)
    _pos("report.insight_images", p.report.insight_images, strict=False)


def validate(p: Params) -> Params:
    """Check every range and name constraint of a loaded :class:`Params`.

    Args:
        p: a structurally valid params object.

    Returns:
        ``p`` unchanged (except YAML booleans of auto/true/false switches, lower-cased).

    Raises:
        ParamsError: the first violated constraint, naming the dotted key.
    """
    for section in (_validate_mlflow, _validate_data, _validate_model, _validate_pretrain,
                    _validate_evaluation, _validate_label_efficiency, _validate_insights):
        section(p)
    return p


def _forbidden_keys(tree: Any, prefix: str = "") -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            key = f"{prefix}{k}"
            if k in FORBIDDEN_KEYS:
                raise ParamsError(f"params: key '{key}' is not allowed (DVC's run cache ignores "
                                  f"params named {', '.join(FORBIDDEN_KEYS)})")
            _forbidden_keys(v, key + ".")


def _unknown_key_message(key: str) -> str:
    """``unknown key; did you mean 'k'?`` (``difflib`` close matches among the key's siblings)."""
    import difflib

    section, _, name = key.rpartition(".")
    tree: Any = to_dict(Params())
    for part in section.split(".") if section else ():
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    known = list(tree) if isinstance(tree, dict) else []
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    where = f"section '{section}'" if section else "the top level"
    return f"unknown key{hint} ({where} has: {', '.join(known)})"


def _check_shapes(tree: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> None:
    """Refuse a scalar where the schema has a section or a list, and a quoted number or boolean.

    OmegaConf's own messages for the first name internal node types, or no key at all. A quoted
    ``"3"`` would validate as ``3``, but DVC records the raw text in ``dvc.lock``, so the value
    would rerun every stage that lists the key although nothing changed.
    """
    for k, v in tree.items():
        key, want = f"{prefix}{k}", schema.get(k)
        if isinstance(want, dict):
            _check(isinstance(v, dict), key, f"a section (a mapping of {', '.join(want)})", v)
            _check_shapes(v, want, key + ".")
        elif isinstance(want, list):
            _check(isinstance(v, list), key, f"a list, e.g. {want}", v)
            numbers = bool(want) and not isinstance(want[0], str)
            _check(not (numbers and any(isinstance(x, str) for x in v)), key,
                   f"a list of numbers without quotes, e.g. {want} (DVC compares the quoted "
                   "text, so it would rerun the stages that use the key)", v)
        elif (want == "auto" and isinstance(v, str) and v != "auto"
              and v.lower() in ("auto", "true", "false")):
            # the auto|true|false switches: true and "true" (or auto and Auto) would be one value
            # in two spellings
            _check(False, key, "auto, or true or false without quotes (DVC compares the quoted "
                   "text, so it would rerun the stages that use the key)", v)
        elif isinstance(want, (bool, int, float)) and isinstance(v, str) and "${" not in v:
            kind = ("true or false" if isinstance(want, bool)
                    else "an integer" if isinstance(want, int) else "a number")
            _check(False, key, f"{kind}, without quotes (DVC compares the quoted text, so it "
                   "would rerun the stages that use the key)", v)


def from_dict(tree: dict[str, Any] | None) -> Params:
    """Build and validate :class:`Params` from a plain nested dict (e.g. parsed YAML).

    Raises:
        ParamsError: unknown key, wrong type, interpolation or out-of-range value.
    """
    tree = tree or {}
    if not isinstance(tree, dict):
        raise ParamsError("params: the file must hold a mapping of sections")
    _forbidden_keys(tree)
    _check_shapes(tree, to_dict(Params()))
    raw = OmegaConf.create(tree)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Params), raw)
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        if isinstance(e, ConfigKeyError):  # a typo'd key: name the close ones
            msg = _unknown_key_message(key)
        raise ParamsError(f"params: '{key}': {msg}", key) from None
    if "${" in OmegaConf.to_yaml(raw):
        flat = flatten(tree)
        key = next((k for k, v in flat.items() if "${" in str(v)), None)
        where = f"'{key}' = {flat[key]!r}: " if key else ""
        raise ParamsError(f"params: {where}'${{...}}' interpolation is not allowed (DVC compares "
                          "raw values)", key)
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Params), resolved))
    assert isinstance(obj, Params)
    return validate(obj)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate a whole params file.

    Args:
        path: the YAML file (default ``params.yaml`` in the current directory).

    Returns:
        The validated :class:`Params`.

    Raises:
        ParamsError: the file is missing or a directory, is not YAML, or violates the schema.
    """
    path = Path(path)
    if path.is_dir():
        raise ParamsError(f"{path}: is a directory, not a params file")
    if not path.is_file():
        raise ParamsError(f"{path}: file does not exist")
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # yaml errors come in several classes
        one_line = " ".join(str(e).split())  # PyYAML's message spans several lines
        raise ParamsError(f"{path}: not valid YAML: {one_line}") from None
    try:
        _same_as_dvc_reads(path, tree)
        return from_dict(tree)  # type: ignore[arg-type]
    except ParamsError as e:  # "params.yaml: 'knn.k' = ...", not "params.yaml: params: ..."
        raise ParamsError(f"{path}: {str(e).removeprefix('params: ')}", e.key) from None


def _same_as_dvc_reads(path: Path, tree: Any) -> None:
    """Refuse a value that DVC's YAML reader reads differently from OmegaConf's.

    OmegaConf reads YAML 1.1 (``yes``, ``on``, ``off`` are booleans, ``010`` is octal 8), DVC's
    reader (:func:`dvc.utils.serialize.load_yaml`, YAML 1.2) keeps the text and reads 10, and
    ``dvc.lock``
    records DVC's reading: ``enabled: yes`` would train as ``true`` while a later ``true`` (the
    same value) reruns every stage that lists the key.

    Raises:
        ParamsError: names the first key read differently, with both readings.
    """
    from dvc.utils.serialize import load_yaml

    try:
        theirs = load_yaml(path)
    except Exception as e:  # noqa: BLE001 - any reader error means DVC cannot use the file
        raise ParamsError(f"params: DVC's YAML reader cannot read it: {e}") from None
    if not (isinstance(tree, dict) and isinstance(theirs, dict)):
        return
    mine, dvc = flatten(tree), flatten(theirs)
    for key, v in mine.items():
        if key in dvc and (type(dvc[key]) is not type(v) or dvc[key] != v):
            if isinstance(v, bool):  # a text key takes the word quoted, a boolean key true/false
                default = flatten(to_dict(Params())).get(key)
                hint = ("true or false" if isinstance(default, bool) or default is None
                        else f"'{dvc[key]}' in quotes")
            else:
                hint = "it without leading zeros, as DVC reads it"
            raise ParamsError(
                f"params: '{key}' reads as {v!r} here but as {dvc[key]!r} in DVC "
                f"(YAML 1.2, what dvc.lock records); write {hint}", key)


def missing_keys(path: str | Path) -> list[str]:
    """Dotted schema keys absent from a params file.

    Stages fill absent keys with defaults, but ``dvc repro`` needs every key that ``dvc.yaml``
    lists to be IN the file, so :func:`check_params_file` reports them.
    """
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    have = set(flatten(raw)) if isinstance(raw, dict) else set()
    return sorted(set(flatten(to_dict(Params()))) - have)


def check_params_file(path: str | Path) -> Params:
    """:func:`load_params`, and every schema key present in the file (what ``dvc repro`` needs).

    The ``check_params`` stage and ``python -m pipeline check-params`` run this.

    Raises:
        ParamsError: as :func:`load_params`, or keys missing from the file (all named).
    """
    try:
        params = load_params(path)
    except ParamsError as e:
        # a value refused because a key is absent (its default filled in) is the absence's fault
        if e.key is None or e.key not in (missing := missing_keys(path)):
            raise
        raise _missing_error(path, missing) from None
    missing = missing_keys(path)
    if missing:
        raise _missing_error(path, missing)
    return params


def _missing_error(path: str | Path, missing: list[str]) -> ParamsError:
    return ParamsError(f"{path}: missing keys {', '.join(missing)} (dvc repro needs every key; "
                       "copy them from params.yaml or a preset in configs/)", missing[0])


def to_dict(p: Any) -> dict[str, Any]:
    """A params dataclass (:class:`Params` or a section) as a plain nested dict.

    Choices become their strings, so the dict is plain YAML/JSON (and safe for
    ``torch.load(weights_only=True)`` inside a checkpoint).
    """
    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return str(v) if isinstance(v, Choice) else v

    return plain(asdict(p))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a nested dict to dotted keys, the names DVC uses (``moco.K``).

    Lists stay lists (``[60, 80]``).
    """
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
