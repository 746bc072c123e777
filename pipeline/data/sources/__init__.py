"""Dataset readers: every source yields :class:`Sample` ``(key, PIL image, label)`` per split.

One interface for five sources, one entry point (``open_source(name, root)``):

========================  =====================================================================
``fashion_mnist``         the four idx ``.gz`` files (Debian ``dataset-fashion-mnist`` or
                          torchvision's download), checked against published checksums.
``cifar10``/``cifar100``  the official python pickle batches; md5-checked BEFORE unpickling.
``stl10``                 the official binary ``*_X.bin``/``*_y.bin`` files (no pickle).
``imagefolder``           ``root/<class>/**/*.jpg`` or ``root/{train,test}/<class>/...``.
========================  =====================================================================

Splits: ``pretrain`` (the images MoCo learns from: the train split; STL-10 train + unlabeled),
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
- ``modes``: every PIL image mode to 8-bit ``L`` or ``RGB`` (scaled, composited on white, or
  refused), and the grey/colour rule that sets a folder's channel count.
- ``registry``: :func:`open_source` (the names: :class:`pipeline.config.DataSource`).
"""

from pipeline.data.sources.base import (
    DEFAULT_ROOTS,
    SPLITS,
    Sample,
    Source,
    SourceError,
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

__all__ = [
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
    "Sample",
    "Source",
    "SourceError",
    "Stl10Source",
    "open_source",
    "select_indices",
    "verify_file",
]
