"""STL-10 from the official binary ``*_X.bin`` / ``*_y.bin`` files (memory-mapped, no pickle)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.data.sources.base import DEFAULT_ROOTS, ArraySource, Part, SourceError, find_dir

_FILES = ["train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin", "unlabeled_X.bin",
          "class_names.txt"]


class Stl10Source(ArraySource):
    """STL-10 (Coates et al. 2011): 5000 train / 8000 test / 100000 unlabeled, 96x96 RGB.

    The ``.bin`` files are memory-mapped (unlabeled_X.bin is 2.7 GB). Each image is stored as
    3 x 96 x 96 bytes, channel-major and column-major (as torchvision's ``STL10`` reads it);
    labels are stored 1..10 and returned as 0..9. There is no per-file published checksum
    (torchvision checks only the archive), and no file is unpickled, so files are checked by
    size and label range. The ``pretrain`` split is train + unlabeled (labels ``-1``).
    """

    name = "stl10"
    mode = "RGB"
    mean = (0.4467, 0.4398, 0.4066)  # commonly used STL-10 pixel statistics
    std = (0.2603, 0.2566, 0.2713)
    native_shape = (3, 96, 96)
    _IMAGE_BYTES = 3 * 96 * 96

    def __init__(self, root: str | Path = "", *, download: bool = False):
        """Map the binary files.

        Args:
            root: directory holding ``stl10_binary/`` or the ``.bin`` files; "" =
                ``data/raw/stl10``.
            download: let torchvision download and extract the archive into ``root``.

        Raises:
            SourceError: files missing, of the wrong size, or labels outside 1..10.
        """
        root = Path(root or DEFAULT_ROOTS[self.name])
        directory = find_dir(root, ["stl10_binary", ""], _FILES)
        if directory is None and download:
            from torchvision.datasets import STL10

            STL10(str(root), split="train", download=True)
            directory = find_dir(root, ["stl10_binary"], _FILES)
        if directory is None:
            raise SourceError(f"{root}: STL-10 files {_FILES} not found in {root} or "
                              f"{root / 'stl10_binary'} (set data.download: true to fetch them)")
        self.class_names = tuple(
            line.strip() for line in (directory / "class_names.txt").read_text().splitlines()
            if line.strip())
        if len(self.class_names) != 10:
            raise SourceError(f"{directory / 'class_names.txt'}: expected 10 class names, "
                              f"found {len(self.class_names)}")
        parts = {p: self._part(directory, p) for p in ("train", "test", "unlabeled")}
        super().__init__({"pretrain": [parts["train"], parts["unlabeled"]],
                          "train": [parts["train"]], "test": [parts["test"]]})

    def _part(self, directory: Path, prefix: str) -> Part:
        xpath = directory / f"{prefix}_X.bin"
        nbytes = xpath.stat().st_size
        if nbytes == 0 or nbytes % self._IMAGE_BYTES:
            raise SourceError(f"{xpath}: {nbytes} bytes is not a positive multiple of "
                              f"{self._IMAGE_BYTES} (3x96x96)")
        images = np.memmap(xpath, dtype=np.uint8, mode="r").reshape(-1, 3, 96, 96)
        if prefix == "unlabeled":
            labels = np.full(len(images), -1, dtype=np.int64)
        else:
            ypath = directory / f"{prefix}_y.bin"
            labels = np.fromfile(ypath, dtype=np.uint8).astype(np.int64)
            if len(labels) != len(images):
                raise SourceError(f"{ypath}: {len(labels)} labels for {len(images)} images")
            if len(labels) and (labels.min() < 1 or labels.max() > 10):
                raise SourceError(f"{ypath}: labels outside 1..10")
            labels = labels - 1
        # stored (C, W, H) per image, i.e. column-major: -> (H, W, C)
        return Part(prefix, images, labels, to_hwc=_chw_colmajor_to_hwc)


def _chw_colmajor_to_hwc(a: np.ndarray) -> np.ndarray:
    return a.transpose(2, 1, 0)
