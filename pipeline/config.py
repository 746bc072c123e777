"""The params schema: one strict pydantic model per ``params.yaml`` section.

Every stage calls :func:`load_params` before doing any work. The file is read by DVC's own
reader (ruamel, YAML 1.2), so a value means here what ``dvc.lock`` records; the schema is strict
(no ``"3"`` for an integer, no ``"true"`` for a boolean, no unknown key). Any violation raises
:class:`ParamsError` with ONE line that names the dotted key (DVC's name, e.g. ``moco.K``) and
what is allowed. Defaults equal the shipped ``params.yaml``; presets live in ``configs/``.
"""

from __future__ import annotations

import difflib
import math
import operator
import re
from collections.abc import Callable
from functools import reduce
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, PlainValidator, ValidationError

from pipeline.choices import (
    EMBED_LAYERS,
    AugPreset,
    Backbone,
    BnMode,
    DataSource,
    DecodeOn,
    FeatureNorm,
    Head,
    KnnSelect,
    LinearMode,
    LrSchedule,
    MSchedule,
    PrecisionName,
    SelectMethod,
    ShardFormat,
    Switch,
)
from pipeline.data.checks import check_params_data
from pipeline.errors import ParamsError


def _rule(ok: Callable[[Any], bool], allowed: str) -> AfterValidator:
    """A field constraint: a value that fails ``ok`` is refused with ``allowed: <allowed>``."""
    def check(value: Any) -> Any:
        if not ok(value):
            raise ValueError(allowed)
        return value

    return AfterValidator(check)


INT_MAX = 2**31 - 1  # counts end up as C ints (torch.set_num_threads, sizes): larger overflow
LABELFREE_MIN_IMAGES = 64  # fewer: one view moves view top-1 >= 0.8 %, the verdict reads noise


def _count_or(words: tuple[str, ...], least: int) -> PlainValidator:
    """One of ``words`` or an unquoted count >= ``least`` (not a bool, not "2")."""
    def check(v: Any) -> int | str:
        if v in words and type(v) is str or type(v) is int and least <= v <= INT_MAX:
            return v
        raise ValueError(f"{', '.join(words)} or an integer >= {least} (at most {INT_MAX}), "
                         "without quotes")

    return PlainValidator(check)


PosInt = Annotated[int, _rule(lambda v: 0 < v <= INT_MAX, f"> 0 (at most {INT_MAX})")]
NonNegInt = Annotated[int, _rule(lambda v: 0 <= v <= INT_MAX, f">= 0 (at most {INT_MAX})")]
PosFloat = Annotated[float, _rule(lambda v: math.isfinite(v) and v > 0, "a finite number > 0")]
NonNegFloat = Annotated[float, _rule(lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")]
Fraction = Annotated[float, _rule(lambda v: 0 <= v < 1, "0 <= x < 1")]
Epochs = Annotated[list[int], _rule(lambda v: all(0 < m <= INT_MAX for m in v)
                                    and v == sorted(v), "increasing positive epochs")]
Counts = Annotated[list[int], _rule(lambda v: bool(v) and 0 < min(v) and max(v) <= INT_MAX
                                    and v == sorted(set(v)),
                                    "a non-empty list of increasing counts, each >= 1")]


class Section(BaseModel):
    """A strict section: exact types (an int may stand for a float), no unknown key."""

    model_config = ConfigDict(strict=True, extra="forbid")


class MlflowParams(Section):
    """MLflow tracking switches (the URI comes from ``MLFLOW_TRACKING_URI`` or the repo root)."""

    enabled: bool = True
    experiment: Annotated[str, _rule(lambda v: bool(v.strip()), "non-empty")] = "moco-pipeline"
    registered_model: Annotated[str, _rule(  # "" = none; MLflow refuses '/', ':'; '@' splits URIs
        lambda v: re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]{0,99})?", v) is not None,
        "'' or letters, digits, '.', '_', '-' (at most 100)")] = "moco-encoder"


class DataParams(Section):
    """Where the images come from and how they are sharded (docs/data.md; rules: data.checks).

    Pretraining reads the labelled pretrain split (``pretrain_labelled``) and ``unlabelled_root``
    (both capped by ``max_pretrain_images``, 0 = all) and ``pretrain_shards`` whole, in place.
    """

    source: DataSource = DataSource.fashion_mnist
    root: str = ""  # "" = the source's default location (see pipeline.data.sources)
    download: bool = False  # allow torchvision to download when the raw files are missing
    image_size: NonNegInt = 0  # 0 = native; else resize (shorter side) + center crop, in px
    max_side: NonNegInt = 0  # > 0: shards keep whole images, shorter side <= max_side px
    shard_format: ShardFormat = ShardFormat.auto
    max_pretrain_images: NonNegInt = 0
    max_train_images: NonNegInt = 0
    max_test_images: NonNegInt = 0
    samples_per_shard: PosInt = 10000
    build_workers: Annotated[int | str, _count_or(("auto",), 1)] = "auto"  # auto = usable cores
    test_fraction: Annotated[float, _rule(lambda v: 0 < v < 1, "0 < x < 1")] = 0.2  # no test/
    shards_dir: Annotated[str, _rule(bool, "a non-empty path or URL")] = "data/shards"
    unlabelled_root: str = ""  # a local image tree without class folders: label -1; "" = none
    pretrain_labelled: bool = True  # the labelled source's pretrain split joins pretraining
    pretrain_shards: str = ""  # WebDataset shards read in place: dir, glob or URL; "" = none
    label_field: Annotated[str, _rule(  # webdataset source: the .cls member, else a .json field
        lambda v: bool(v.strip()), "cls (the .cls member) or the name of a .json field")] = "cls"
    max_broken_fraction: Fraction = 0.001  # undecodable images left out up to this share


class AugmentParams(Section):
    """Two-crop augmentation preset (:mod:`pipeline.data.views` has the published tables)."""

    preset: AugPreset = AugPreset.v2_grey
    crop_min_scale: Annotated[float, _rule(lambda v: 0 < v <= 1, "0 < x <= 1")] = 0.5  # MoCo: 0.2
    small_crops: NonNegInt = 0  # multi-crop (SwAV / DINO local crops): extra query crops; 0 = off
    small_crop_size: NonNegInt = 0  # side in px; 0 = half the training image side
    small_crop_min_scale: float = 0.05  # RandomResizedCrop area range (DINO local crops: 0.05-0.4)
    small_crop_max_scale: float = 0.4


class ModelParams(Section):
    """Backbone and projection head."""

    backbone: Backbone = Backbone.resnet18
    width: PosInt = 32  # channels of the first stage (torchvision: 64); 32 = 256-d features
    small_stem: Switch = Switch.auto  # auto = 3x3 stem, no max-pool below 64 px
    stem_stride: Annotated[int, _rule(lambda v: v in (1, 2), "1 or 2")] = 2  # the small stem's
    head: Head = Head.mlp  # linear (MoCo v1) or mlp (MoCo v2)
    head_hidden: PosInt = 512  # MLP hidden width (MoCo v2 uses the backbone's feature width)
    dim: PosInt = 128  # key/query dimension D, MoCo v1/v2


class MocoParams(Section):
    """The dictionary and the contrastive loss."""

    K: PosInt = 4096  # queue length (MoCo CIFAR demo: 4096)
    m: Annotated[float, _rule(lambda v: 0 <= v <= 1, "0 <= m <= 1")] = 0.99  # weight on the OLD
    m_schedule: MSchedule = MSchedule.constant
    T: PosFloat = 0.1  # softmax temperature (MoCo CIFAR demo 0.1; v1 0.07; v2 0.2)
    symmetric: bool = False
    bn: BnMode = BnMode.split  # split (one device) | shuffle (DDP) | sync (SyncBN) | none
    bn_splits: PosInt = 2  # groups for SplitBatchNorm (MoCo CIFAR demo: 8)


class PretrainParams(Section):
    """Optimisation of the query encoder. ``lr`` is per 256 images (scaled to the global batch)."""

    epochs: PosInt = 7
    steps_per_epoch: NonNegInt = 0  # 0 = pretrain images // batch_size (true epoch); at most that
    batch_size: PosInt = 64  # global batch (split across DDP ranks)
    lr: PosFloat = 0.12  # per 256 images (MoCo CIFAR demo: 0.03; results/sweep-*.md)
    lr_schedule: LrSchedule = LrSchedule.cosine
    lr_milestones: Epochs = [120, 160]  # epochs, step schedule
    warmup_epochs: NonNegFloat = 0.25
    weight_decay: NonNegFloat = 5e-4
    sgd_momentum: Fraction = 0.9
    precision: PrecisionName = PrecisionName.auto
    channels_last: Switch = Switch.auto  # auto = CUDA only
    compile: Switch = Switch.auto  # torch.compile of the encoders (pipeline.train.runtime)
    # CPU threads, loader processes: pipeline.train.runtime (setup_threads, resolve_num_workers)
    num_threads: Annotated[int | str, _count_or(("auto", "probe"), 1)] = "auto"
    num_workers: Annotated[int | str, _count_or(("auto",), 0)] = 1
    decode: DecodeOn = DecodeOn.workers  # where whole-image shards' JPEGs (data.max_side) decode
    deterministic: bool = True
    checkpoint_every_epochs: PosInt = 1
    checkpoint_every_steps: NonNegInt = 50  # also checkpoint every N steps (0 = only per epoch)
    knn_every_epochs: NonNegInt = 1  # the monitor (kNN, label-free numbers, verdict); 0 = off
    knn_monitor_train_images: PosInt = 10000
    knn_monitor_test_images: PosInt = 2000
    labelfree_images: Annotated[int, _rule(  # label-free sample (train.monitor); 0 = off
        lambda v: v == 0 or LABELFREE_MIN_IMAGES <= v <= INT_MAX,
        f"0 (off) or at least {LABELFREE_MIN_IMAGES} (at most {INT_MAX})")] = 2048
    log_every_steps: PosInt = 10


class EmbedParams(Section):
    """Frozen feature extraction."""

    batch_size: PosInt = 512
    use_head: bool = False  # True = features after the projection head
    # the ResNet stage pooled (4: MoCo / InstDisc; 3: +2.5 kNN points, results/layer-features-*)
    layer: Annotated[int, _rule(lambda v: v in EMBED_LAYERS, "one of 1, 2, 3, 4 (the ResNet "
                                "stage whose map is pooled)")] = 3
    pool_grid: PosInt = 4  # 1 = global pooling (MoCo / InstDisc); 4 = layer3's whole map at 28 px


class KnnParams(Section):
    """Weighted kNN (InstDisc protocol, MoCo CIFAR demo: k=200, T=0.1)."""

    k: PosInt = 10  # with select = fixed (InstDisc / MoCo demo: 200)
    T: PosFloat = 0.1
    chunk_size: PosInt = 1024  # test images per similarity chunk
    val_fraction: Fraction = 0.0  # > 0: also score kNN on this share of TRAIN held out of the bank
    select: KnnSelect = KnnSelect.val  # val: k, T chosen on 10 % of TRAIN | fixed: knn.k, knn.T


class LinearParams(Section):
    """Linear probe (MoCo protocol: lr 30 per 256, wd 0, 100 epochs, steps at 60/80)."""

    mode: LinearMode = LinearMode.features  # precomputed | augment (crops through the backbone)
    epochs: PosInt = 100
    batch_size: PosInt = 256
    lr: PosFloat = 30.0  # per 256 images
    lr_schedule: LrSchedule = LrSchedule.step
    lr_milestones: Epochs = [60, 80]
    weight_decay: NonNegFloat = 0.0
    val_fraction: Fraction = 0.0  # held out of the TRAIN set (never the test set)
    feature_norm: FeatureNorm = FeatureNorm.l2  # l2 | none (MoCo main_lincls: raw, at lr 30)


class LabelEfficiencyParams(Section):
    """The label-efficiency curve: probes fitted on a few labelled images per class."""

    per_class: Counts = [1, 2, 5, 10, 25, 100]  # labelled images per class, one curve point each
    draws: PosInt = 3  # seeded draws per point (mean and spread)


class InsightsParams(Section):
    """Near-duplicates and outliers of the pretraining images (the ``data_insights`` stage)."""

    duplicate_cosine: Annotated[float, _rule(  # results/near-duplicates-2026-12-06.md
        lambda v: -1 < v <= 1, "a cosine similarity, -1 < x <= 1")] = 0.998
    neighbours: PosInt = 10  # searched for pairs; outliers: isolation in two of the views
    listed: NonNegInt = 1000  # pairs and outliers listed in eval/data_insights.json (counts: all)


class SelectionParams(Section):
    """Which pretraining images to label: the ``select_labels`` stage (docs/selection.md)."""

    budget: Counts = [10, 20, 50, 100, 250]  # labelled images in all, one selection each
    method: SelectMethod = SelectMethod.typical  # the picks of selection/labels_to_collect.csv
    compare: list[SelectMethod] = [SelectMethod.random, SelectMethod.kcenter, SelectMethod.typical]
    draws: PosInt = 5  # seeded draws of random (mean and spread)
    exclude_outliers: Fraction = 0.01  # the most isolated images, never picked (but by random)


class ReportParams(Section):
    """Report figures."""

    tsne_points: NonNegInt = 2000
    retrieval_queries: NonNegInt = 8
    retrieval_neighbours: PosInt = 8
    insight_images: NonNegInt = 12  # near-duplicate pairs and outliers shown as thumbnails, each


class Params(Section):
    """The whole ``params.yaml``."""

    seed: Annotated[int, _rule(lambda v: 0 <= v < 2**32, "0 <= seed < 2**32 (the range numpy, "
                               "torch and scikit-learn all take)")] = 0
    mlflow: MlflowParams = MlflowParams()
    data: DataParams = DataParams()
    augment: AugmentParams = AugmentParams()
    model: ModelParams = ModelParams()
    moco: MocoParams = MocoParams()
    pretrain: PretrainParams = PretrainParams()
    embed: EmbedParams = EmbedParams()
    knn: KnnParams = KnnParams()
    linear: LinearParams = LinearParams()
    label_efficiency: LabelEfficiencyParams = LabelEfficiencyParams()
    insights: InsightsParams = InsightsParams()
    selection: SelectionParams = SelectionParams()
    report: ReportParams = ReportParams()


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ParamsError.invalid(key, value, allowed)


def validate(p: Params) -> Params:
    """Check the rules that tie keys together, then :func:`~pipeline.data.checks.check_params_data`.

    Returns:
        ``p`` unchanged.

    Raises:
        ParamsError: the first violated rule, naming the dotted key.
    """
    a, t, e = p.augment, p.pretrain, p.embed
    _check(0 < a.small_crop_min_scale <= a.small_crop_max_scale <= 1,
           "augment.small_crop_min_scale", a.small_crop_min_scale,
           f"0 < x <= augment.small_crop_max_scale ({a.small_crop_max_scale}) <= 1")
    if a.small_crops:
        _check(not p.moco.symmetric, "augment.small_crops", a.small_crops,
               "0 with moco.symmetric: true")
        _check(not p.data.max_side, "augment.small_crops", a.small_crops,
               "0 with data.max_side (whole images are cropped per image in the loader)")
    _check(t.warmup_epochs < t.epochs, "pretrain.warmup_epochs", t.warmup_epochs,
           "< pretrain.epochs")
    n = p.data.max_pretrain_images  # an upper bound on the pretraining images when set
    if n and not p.data.pretrain_shards:
        _check(t.batch_size <= n, "pretrain.batch_size", t.batch_size,
               f"<= data.max_pretrain_images ({n})")
        _check(t.steps_per_epoch * t.batch_size <= n, "pretrain.steps_per_epoch",
               t.steps_per_epoch, "at most one epoch: steps_per_epoch * batch_size <= "
               f"data.max_pretrain_images ({n})")
    if p.moco.bn == BnMode.split:
        _check(t.batch_size % p.moco.bn_splits == 0, "moco.bn_splits", p.moco.bn_splits,
               f"a divisor of pretrain.batch_size ({t.batch_size})")
    if e.use_head and (e.layer, e.pool_grid) != (4, 1):  # the key at fault; both: use_head
        key, value = (("embed.pool_grid", e.pool_grid) if e.layer == 4 else ("embed.layer", e.layer)
                      if e.pool_grid == 1 else ("embed.use_head", True))
        _check(False, key, value, "embed.use_head true needs embed.layer 4 and embed.pool_grid 1 "
               "(the head takes the last stage's globally pooled (N, C) features)")
    check_params_data(p)
    return p


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false",
          "string": "text (quoted if it looks like a number or a boolean)"}


def _schema_error(err: Any, tree: dict[str, Any]) -> ParamsError:
    """One pydantic error as a :class:`ParamsError` naming the dotted key and the rule."""
    names = [str(x) for x in err["loc"] if isinstance(x, str)]  # a list item: the list's key
    key, section = ".".join(names), reduce(operator.getitem, names[:-1], to_dict(Params()))
    if err["type"] == "extra_forbidden":  # a typo'd key: name the close ones
        close = difflib.get_close_matches(names[-1], list(section), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        where = f"section '{'.'.join(names[:-1])}'" if names[:-1] else "the top level"
        return ParamsError(f"params: '{key}': unknown key{hint} ({where} has: "
                           f"{', '.join(section)})", key)
    value, default = reduce(operator.getitem, names, tree), section[names[-1]]
    if isinstance(default, dict):
        allowed = f"a section (a mapping of {', '.join(default)})"
    elif err["type"] == "value_error":
        allowed = str(err["ctx"]["error"])
    elif isinstance(default, list):
        allowed = f"a list of integers, e.g. {default}"
    else:
        allowed = _KINDS.get(err["type"].split("_")[0], err["msg"])
        if isinstance(value, str) and not isinstance(default, str):
            allowed += ", without quotes"
    return ParamsError.invalid(key, value, allowed)


def _check_key_names(tree: dict[Any, Any], at: list[str]) -> None:
    """Refuse a key that is not a name (``: 5``, ``true: 1``, ``1.5: x``), naming where it is."""
    for k, v in tree.items():
        where = f"section '{'.'.join(at)}'" if at else "the top level"
        if not isinstance(k, str):
            raise ParamsError(f"params: {where} has the key {k!r}, not a name", ".".join(at))
        if isinstance(v, dict) and not at:  # a section; a mapping inside it is a wrong value
            _check_key_names(v, [*at, k])


def from_dict(tree: dict[str, Any] | None) -> Params:
    """Build and validate :class:`Params` from a plain nested dict (e.g. parsed YAML).

    Raises:
        ParamsError: unknown key, wrong type, interpolation or out-of-range value.
    """
    tree = tree or {}
    if not isinstance(tree, dict):
        raise ParamsError("params: the file must hold a mapping of named sections")
    _check_key_names(tree, [])
    for key, value in flatten(tree).items():
        if any(isinstance(v, str) and "${" in v for v in (value if isinstance(value, list)
                                                          else [value])):
            raise ParamsError(f"params: '{key}' = {value!r}: '${{...}}' interpolation is not "
                              "allowed (DVC compares raw values)", key)
    try:
        params = Params.model_validate(tree)
    except ValidationError as e:
        raise _schema_error(e.errors()[0], tree) from None
    return validate(params)


def read_yaml(path: str | Path) -> Any:
    """A params file as DVC reads it (:func:`dvc.utils.serialize.parse_yaml`: ruamel, YAML 1.2).

    Raises:
        ParamsError: not valid YAML; one line with the parser's reason.
    """
    from dvc.utils.serialize import YAMLFileCorruptedError, parse_yaml

    try:
        return parse_yaml(Path(path).read_text(encoding="utf-8"), str(path))
    except (YAMLFileCorruptedError, ValueError) as e:  # ValueError: bad UTF-8, > 4300 digits
        reason = " ".join(str(e.__cause__ or e).split())  # the parser's message spans lines
        raise ParamsError(f"{path}: not valid YAML: {reason}") from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate a whole params file (default ``params.yaml`` in the current directory).

    Raises:
        ParamsError: the file is missing or a directory, is not YAML, or violates the schema.
    """
    path = Path(path)
    if path.is_dir():
        raise ParamsError(f"{path}: is a directory, not a params file")
    if not path.is_file():
        raise ParamsError(f"{path}: file does not exist")
    tree = read_yaml(path)
    try:
        return from_dict(tree)
    except ParamsError as e:  # "params.yaml: 'knn.k' = ...", not "params.yaml: params: ..."
        raise ParamsError(f"{path}: {str(e).removeprefix('params: ')}", e.key) from None


def missing_keys(path: str | Path) -> list[str]:
    """Dotted schema keys absent from a params file (``dvc repro`` needs every key in it)."""
    raw = read_yaml(path)

    def present(node: Any, parts: list[str]) -> bool:  # a mapping where a value belongs: present
        return not parts or isinstance(node, dict) and parts[0] in node and present(
            node[parts[0]], parts[1:])

    return sorted(k for k in flatten(to_dict(Params())) if not present(raw, k.split(".")))


def check_params_file(path: str | Path) -> Params:
    """:func:`load_params`, and every schema key present in the file (what ``dvc repro`` needs).

    Raises:
        ParamsError: as :func:`load_params`, or keys missing from the file (all named).
    """
    params = None
    try:
        params = load_params(path)
    except ParamsError as e:
        # a value refused because a key is absent (its default filled in) is the absence's fault
        if e.key is None or e.key not in missing_keys(path):
            raise
    if missing := missing_keys(path):
        raise ParamsError(f"{path}: missing keys {', '.join(missing)} (dvc repro needs every key; "
                          "copy them from `git show HEAD:params.yaml` or configs/)", missing[0])
    assert params is not None  # refused only for a missing key, which raised above
    return params


def to_dict(p: BaseModel) -> dict[str, Any]:
    """A params model as a plain nested dict, choices as strings (YAML/JSON, weights_only)."""
    return p.model_dump(mode="json")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a nested dict to dotted keys, the names DVC uses (``moco.K``); lists stay lists."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
