"""What the training reads, as one object: the resume key, the registry's recipe, ``dvc.yaml``.

:func:`training_input` gathers everything that decides the trained weights:

- the params that decide them (:data:`WEIGHT_PARAMS` minus :data:`NOT_WEIGHT_PARAMS`);
- the image spec the loader derives from the manifests and params: crop side, channels,
  normalisation (taken from the labelled train split for a joined set), whole images or not;
- the pretraining set's manifest content: every shard's sha256, sample count and layout, the
  images left out as broken, the build settings (where the shards live is left out: the same
  bytes moved elsewhere train the same weights);
- the training code: every ``pipeline/`` module the pretrain stage runs
  (:func:`pipeline.codegraph.output_code`);
- the number of training processes.

Its :attr:`TrainingInput.fingerprint` is the resume key (a checkpoint is resumed only when its
fingerprint equals the run's) and the registry's ``training.fingerprint`` tag;
:func:`params_digest` of the same :func:`weight_params` is the registry's ``params.digest``;
:data:`WEIGHT_PARAMS` is the ``pretrain`` stage's ``params:`` in ``dvc.yaml``
(``tests/train/test_training_input.py`` checks all three).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.codegraph import PRETRAIN_SCRIPT, REPO, code_digest, output_code
from pipeline.config import flatten, to_dict
from pipeline.data.shards import image_spec

if TYPE_CHECKING:
    from pipeline.config import Params
    from pipeline.data.manifest import Manifest

# The params that decide the trained weights, as DVC names them (a section or a dotted key):
# the pretrain stage's `params:` in dvc.yaml. data.image_size is the training crop where the
# shards keep whole images (data.max_side) or a joined set has no single size.
WEIGHT_PARAMS = ("seed", "data.image_size", "model", "moco", "augment", "pretrain")

# Keys inside WEIGHT_PARAMS left out of the resume key: they change how fast or how visibly
# training runs, never its result; and the thread count, which does change float sums: a
# checkpoint goes on with the count it was trained on, whatever pretrain.num_threads says now
# (pipeline.train.runtime.setup_threads), so a changed count never resumes other weights.
NOT_WEIGHT_PARAMS = ("pretrain.checkpoint_every_epochs", "pretrain.checkpoint_every_steps",
                     "pretrain.knn_every_epochs", "pretrain.knn_monitor_train_images",
                     "pretrain.knn_monitor_test_images", "pretrain.log_every_steps",
                     "pretrain.labelfree_images", "pretrain.compile", "pretrain.num_threads")

# Manifest fields that say where the data lives, not what it is
_LOCATION_KEYS = ("url",)
_LOCATION_BUILD_KEYS = ("parts",)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def weight_params(p: Params) -> dict[str, Any]:
    """The params that decide the trained weights, as plain nested values.

    Returns:
        ``{"seed": .., "data": {"image_size": ..}, "model": {..}, ...}``: every leaf under
        :data:`WEIGHT_PARAMS` except :data:`NOT_WEIGHT_PARAMS`.
    """
    leaves = flatten(to_dict(p))
    out: dict[str, Any] = {}
    for key, value in leaves.items():
        if key in NOT_WEIGHT_PARAMS or not any(key == w or key.startswith(w + ".")
                                               for w in WEIGHT_PARAMS):
            continue
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def params_digest(p: Params) -> str:
    """sha256 of :func:`weight_params` (canonical JSON), 64 hex chars: the recipe's identity.

    Two encoders with the same digest were trained from the same params (the data and code may
    still differ: :attr:`TrainingInput.fingerprint` covers those too).
    """
    return _digest(weight_params(p))


def data_content(manifest: Manifest) -> dict[str, Any]:
    """The pretraining set's manifest, less where its shards live (plain JSON values)."""
    d = manifest.to_dict()
    d["shards"] = [{k: v for k, v in s.items() if k not in _LOCATION_KEYS} for s in d["shards"]]
    if d.get("build") is not None:
        d["build"] = {k: v for k, v in d["build"].items() if k not in _LOCATION_BUILD_KEYS}
    return d


@dataclass(frozen=True)
class TrainingInput:
    """Everything that decides the trained weights, and its hashes.

    Attributes:
        params: :func:`weight_params`.
        world_size: training processes.
        image: the resolved image spec: ``channels``, ``size`` (crop side, px), ``mean``,
            ``std`` (0..1 scale), ``variable`` (whole images cropped per image in the loader).
        data: sha256 of :func:`data_content` (64 hex) and the set's image count.
        code: the ``pipeline/`` and ``stages/`` files whose bytes entered the fingerprint,
            repo-relative.
        code_digest: :func:`pipeline.codegraph.code_digest` of :attr:`code`.
    """

    params: dict[str, Any]
    world_size: int
    image: dict[str, Any]
    data: dict[str, Any]
    code: tuple[str, ...]
    code_digest: str

    @property
    def fingerprint(self) -> str:
        """The resume key: sha256 over params, image spec, data and code, 64 hex chars."""
        return _digest(self.described())

    def described(self) -> dict[str, Any]:
        """The fingerprint's input, plain values; a checkpoint stores it to name a mismatch."""
        return {"params": self.params, "world_size": self.world_size, "image": self.image,
                "data": self.data, "code": self.code_digest}


def training_input(p: Params, manifest: Manifest, world_size: int, *,
                   code_root: Path = REPO) -> TrainingInput:
    """The training input of a run; computed once per run, by the pretrain stage.

    Args:
        p: the whole params.
        manifest: the pretraining set (:func:`pipeline.data.index.pretrain_manifest`: the
            built split joined with shards read in place, their spec resolved).
        world_size: number of training processes.
        code_root: the tree holding ``pipeline/`` and ``stages/`` (the repo; a copy in tests).

    Raises:
        ShardError: the manifest fixes no training image size (:func:`image_spec`).
        FileNotFoundError: ``stages/pretrain.py`` is not beside the package.
    """
    spec = image_spec(manifest, manifest.split)
    data = data_content(manifest)
    code = output_code(PRETRAIN_SCRIPT, code_root)
    return TrainingInput(params=weight_params(p), world_size=world_size,
                         image=asdict(spec) | {"mean": list(spec.mean), "std": list(spec.std)},
                         data={"sha256": _digest(data), "num_samples": manifest.num_samples},
                         code=tuple(code), code_digest=code_digest(code, code_root))
