"""The pretrained encoder as an MLflow logged model that loads without this project.

The pretrain run logs the query backbone (``models/encoder.pt``, rebuilt as the ``embed`` stage
rebuilds it, with the ``embed.layer`` / ``embed.pool_grid`` pooling) as its MLflow logged model
``encoder``, pytorch flavour, ``serialization_format="pickle"`` with the standard
:mod:`pickle`: an ordinary ``nn.Module`` (``.eval()``, ``.train()``, ``.to(device)``,
fine-tuning) made of torch and torchvision classes only (:func:`plain_encoder`), so loading
needs torch, torchvision and mlflow, not this project. Signature: ``(-1, C, S, S)`` float32
normalised images -> ``(-1, D)`` float32 features, the rows of ``features/*.pt``; the input
example is the first two test images after the evaluation transform. ``encoder.json`` goes with
it (``extra_files``), and its preprocessing (size, mean, std) is the model's metadata. The same
module as a ``torch.export`` program (``extra_files/encoder.pt2``) serves deployments that load
no pickle. Registering it, trusting it and electing a champion: :mod:`pipeline.tracking.
registry`.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from pipeline.data.remote import ShardURL

if TYPE_CHECKING:
    from pipeline.data.manifest import Manifest

log = logging.getLogger(__name__)


LOGGED_MODEL_NAME = "encoder"


GRAPH_FILE = "encoder.pt2"  # the torch.export program, an extra file of the logged model


EXAMPLE_IMAGES = 2


# What the pickled module may reference besides the standard library: a plain venv has these.
PORTABLE_PACKAGES = ("torch", "torchvision")


def plain_encoder(backbone: nn.Module) -> nn.Module:
    """The backbone as a module of torch and torchvision classes only (changed in place).

    What :func:`~pipeline.evaluate.run.embed.load_encoder` builds is a
    :class:`~pipeline.moco.backbones.WideResNet` (a torchvision ``ResNet`` whose ``__init__``
    takes a width; same forward) pooled by a
    :class:`~pipeline.evaluate.pooling.GridPool` (``adaptive_avg_pool2d`` to ``g x g`` after a
    size check). Pickled as they are, loading needs this project on the path. Here the class
    becomes ``torchvision.models.ResNet`` and the pool ``nn.AdaptiveAvgPool2d(g)``: the same
    operations in the same order, so the features are bit-identical; only GridPool's error for
    a map smaller than ``g x g`` is gone (adaptive pooling repeats cells instead).

    Args:
        backbone: the module (its attributes and weights are kept).

    Returns:
        ``backbone``, now of torch/torchvision classes.

    Raises:
        TypeError: pickling it would still reference a module outside the standard library and
            :data:`PORTABLE_PACKAGES` (each named), e.g. a subclass with its own forward; or it
            cannot be pickled at all.
    """
    from torchvision.models.resnet import ResNet

    from pipeline.evaluate.pooling import GridPool

    for name, module in list(backbone.named_modules()):
        if isinstance(module, GridPool):
            pool = nn.AdaptiveAvgPool2d((module.grid, module.grid))
            if name:
                backbone.set_submodule(name, pool)
            else:
                backbone = pool
    kind = type(backbone)
    if (kind is not ResNet and isinstance(backbone, ResNet) and kind.forward is ResNet.forward
            and kind._forward_impl is ResNet._forward_impl):
        backbone.__class__ = ResNet
    try:
        names = pickled_globals(backbone)
    except pickle.PicklingError as e:  # e.g. a class defined inside a function
        raise TypeError(f"the encoder module cannot be pickled: {e}") from None
    foreign = sorted(g for g in names
                     if g.split(".")[0] not in (*PORTABLE_PACKAGES, *sys.stdlib_module_names))
    if foreign:
        raise TypeError(f"the encoder module would need {', '.join(foreign)} to be unpickled; "
                        f"only {', '.join(PORTABLE_PACKAGES)} and the standard library are "
                        "installed where the registered model is loaded")
    return backbone


class _GlobalsRecorder(pickle._Pickler):  # the Python pickler: its save_global can be wrapped
    """Pickles into nothing, recording every class or function the pickle would import."""

    def __init__(self) -> None:
        class _Sink:
            def write(self, data: bytes) -> int:
                return len(data)

        super().__init__(_Sink(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: set[str] = set()

    def persistent_id(self, obj: Any) -> str | None:
        import torch

        # tensors and storages reduce to torch functions only; skip their bytes
        return "tensor" if isinstance(obj, (torch.Tensor, torch.UntypedStorage)) else None

    def save_global(self, obj: Any, name: str | None = None) -> None:
        module = getattr(obj, "__module__", None) or pickle.whichmodule(obj, name)
        self.found.add(f"{module}.{name or obj.__qualname__}")
        super().save_global(obj, name)


def pickled_globals(obj: Any) -> set[str]:
    """``module.name`` of every class and function that unpickling ``obj`` would import."""
    recorder = _GlobalsRecorder()
    recorder.dump(obj)
    return recorder.found


def _example_images(split: Path | ShardURL, image_size: int,
                    n: int) -> tuple[Any, Manifest]:
    """The split's first ``n`` images after the evaluation transform, and its manifest.

    Returns:
        (``(n, C, S, S)`` float32 images, the manifest).
    """
    from pipeline.data.eval_loader import eval_loader
    from pipeline.data.manifest import read_manifest
    from pipeline.data.views import build_eval_transform

    m = read_manifest(split)
    loader = eval_loader(split, transform=build_eval_transform(image_size, m.mean, m.std),
                         batch_size=n, max_images=n)
    images, _, _ = next(iter(loader))
    return images, m


def export_graph(model: nn.Module, images: Any, path: Path) -> None:
    """Save ``model`` (in eval mode) as a ``torch.export`` program with a free batch size.

    Args:
        model: the encoder, ``(N, C, S, S)`` -> ``(N, D)``.
        images: ``(2, C, S, S)`` example images: ``torch.export`` fixes a dimension of size 1,
            so a single image would give a program that only takes one.
        path: the ``.pt2`` file.
    """
    import torch

    program = torch.export.export(model.eval(), (images,),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, str(path))


def log_encoder(*, encoder_path: Path, pool_grid: int, layer: int,
                example_split: Path | ShardURL, tags: dict[str, str]) -> str:
    """Log ``encoder.pt`` as the active run's MLflow logged model; return its model id.

    The model is :func:`plain_encoder` of the embed stage's backbone, pickled (standard
    :mod:`pickle`); ``encoder.json`` and the ``torch.export`` program (:data:`GRAPH_FILE`) are
    its extra files.

    Args:
        encoder_path: ``models/encoder.pt`` (``encoder.json`` beside it).
        pool_grid: ``embed.pool_grid``: the model's features are the embed stage's.
        layer: ``embed.layer``: the stage whose map is pooled (the later ones are left out).
        example_split: the split whose first images are the input example (test).
        tags: tags of the logged model.

    Raises:
        Exception: whatever MLflow or ``torch.export`` raise (the caller reports the
            :func:`optional_failures`).
    """
    import tempfile

    import mlflow
    import numpy as np
    import torch
    import torchvision
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    from pipeline.evaluate.run.embed import load_encoder

    backbone, meta = load_encoder(encoder_path, pool_grid=pool_grid, layer=layer)
    model = plain_encoder(backbone).eval()
    images, manifest = _example_images(example_split, int(meta["image_size"]), EXAMPLE_IMAGES)
    c, s = images.shape[1], images.shape[2]
    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, c, s, s))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, int(meta["num_features"])))]))
    preprocessing = {"image_size": int(meta["image_size"]), "mean": list(manifest.mean),
                     "std": list(manifest.std),
                     "transform": "pipeline.data.views.build_eval_transform"}
    quiet = logging.getLogger("mlflow.pytorch")  # its advice against pickle: chosen, see above
    with tempfile.TemporaryDirectory() as tmp, _level(quiet, logging.ERROR):
        graph = Path(tmp) / GRAPH_FILE
        export_graph(model, images, graph)
        info = mlflow.pytorch.log_model(
            model, name=LOGGED_MODEL_NAME, serialization_format="pickle", pickle_module=pickle,
            signature=signature, input_example=images.numpy(),
            extra_files=[str(encoder_path.with_suffix(".json")), str(graph)],
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                              f"torchvision=={torchvision.__version__.split('+')[0]}"],
            metadata={"encoder": meta, "preprocessing": preprocessing},
            params={f"encoder.{k}": v for k, v in meta.items()}, tags=tags)
    return info.model_id


@contextlib.contextmanager
def _level(logger: logging.Logger, level: int) -> Iterator[None]:
    """``logger`` at ``level`` inside the block."""
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
