"""Dataset readers: every source yields :class:`Sample` ``(key, PIL image, label)`` per split.

One interface for seven sources, one entry point (``open_source(name, root)``):

========================  =====================================================================
``fashion_mnist``         the four idx ``.gz`` files (Debian ``dataset-fashion-mnist`` or
                          torchvision's download), checked against published checksums.
``cifar10``/``cifar100``  the official python pickle batches; md5-checked BEFORE unpickling.
``stl10``                 the official binary ``*_X.bin``/``*_y.bin`` files (no pickle).
``imagefolder``           ``root/<class>/**/*.jpg`` or ``root/{train,test}/<class>/...``.
``webdataset``            existing WebDataset shards with labels (``.cls`` or a ``.json`` field),
                          a directory, glob or URL; held in memory (evaluation data).
``none``                  no labelled images at all (pretraining only).
========================  =====================================================================

Splits: ``pretrain`` (the images MoCo learns from: the train split; STL-10 train + unlabeled;
``unlabelled.PretrainMix`` adds an unlabelled image tree, label -1, or leaves the labelled part
out),
``train`` (labelled train split) and ``test``. Labels are ``0..C-1``; STL-10's unlabeled images
carry ``-1``.

Caps (``max_images``) take a seeded, class-stratified subset (per-class quotas by largest
remainder, so class proportions are kept to within one image), returned in source order unless
``shuffle=True``.

Modules (import the public names from this package, not from the modules):

- ``base``: :class:`Sample`, :class:`Source`, :class:`SourceError`, :func:`select_indices`,
  ``SPLITS``, ``DEFAULT_ROOTS`` and the array-backed source the three array datasets share.
- ``checksum``: :class:`Checksum`, :class:`ChecksumError`, :func:`verify_file` (md5 as
  published, or sha256 of the gunzipped content for Debian's re-gzipped files).
- ``idx``: Fashion-MNIST from idx files.
- ``cifar``: CIFAR-10/100 pickles, verified before a restricted unpickling.
- ``stl10``: STL-10 binaries.
- ``imagefolder``: class-folder trees of image files.
- ``unlabelled``: an image tree without classes (``data.unlabelled_root``), the pretrain split
  that mixes it in, and the ``none`` source.
- ``webdataset``: labelled WebDataset shards (``data.source: webdataset``).
- ``registry``: :func:`open_source` (the names: :class:`pipeline.config.DataSource`).

Every image is converted to 8-bit ``L`` or ``RGB`` by :mod:`pipeline.data.modes`, which the
index and the loader use too.
"""

from pipeline.data.sources.base import (
    DEFAULT_ROOTS,
    SPLITS,
    BrokenImages,
    Sample,
    Source,
    SourceError,
    SourceFile,
    select_indices,
)
from pipeline.data.sources.checksum import Checksum, ChecksumError, verify_file
from pipeline.data.sources.cifar import CifarSource
from pipeline.data.sources.idx import (
    FASHION_MNIST_CHECKSUMS,
    FASHION_MNIST_CLASSES,
    FashionMnistSource,
)
from pipeline.data.sources.imagefolder import IMAGE_EXTENSIONS, ImageFolderSource
from pipeline.data.sources.registry import open_source
from pipeline.data.sources.stl10 import Stl10Source
from pipeline.data.sources.unlabelled import NoLabelsSource, PretrainMix, UnlabelledTree
from pipeline.data.sources.webdataset import WebDatasetSource

__all__ = [
    "BrokenImages",
    "DEFAULT_ROOTS",
    "FASHION_MNIST_CHECKSUMS",
    "FASHION_MNIST_CLASSES",
    "IMAGE_EXTENSIONS",
    "SPLITS",
    "Checksum",
    "ChecksumError",
    "CifarSource",
    "FashionMnistSource",
    "ImageFolderSource",
    "NoLabelsSource",
    "PretrainMix",
    "Sample",
    "Source",
    "SourceError",
    "SourceFile",
    "Stl10Source",
    "UnlabelledTree",
    "WebDatasetSource",
    "open_source",
    "select_indices",
    "verify_file",
]
