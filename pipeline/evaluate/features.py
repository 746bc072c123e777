"""Frozen feature extraction and the on-disk feature file (``features/{train,test}.pt``).

A :class:`FeatureSet` is what the embed stage writes and the kNN / linear stages read: fp32
features, int64 labels and the sample keys (WebDataset ``__key__``) in the order read.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from pipeline.atomic import save_torch
from pipeline.errors import InputError

FORMAT_VERSION = 1
FINITE_ROWS = 65536  # rows checked for NaN / Inf at a time (a (rows, D) bool temporary)


def pick_device() -> torch.device:
    """The evaluation device: CUDA when available, else CPU (chosen once per stage)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class FeatureSet:
    """Features of one split, row ``i`` belonging to sample ``keys[i]``.

    Attributes:
        features: (N, D) float32 on CPU.
        labels: (N,) int64 on CPU.
        keys: N sample keys (str), in the order the samples were read.
    """

    features: Tensor
    labels: Tensor
    keys: list[str]

    def __post_init__(self) -> None:
        """Check the shapes and dtypes (see :func:`check_feature_set`)."""
        check_feature_set(self)

    def __len__(self) -> int:
        """N, the number of samples."""
        return self.features.shape[0]

    def subset(self, index: Tensor | Sequence[int]) -> FeatureSet:
        """The rows ``index`` (an int64 index tensor or a list of ints), in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        keys = [self.keys[i] for i in idx.tolist()]
        return FeatureSet(self.features[idx], self.labels[idx], keys)


def check_feature_set(fs: FeatureSet, where: str = "FeatureSet") -> None:
    """Validate shapes and dtypes of a :class:`FeatureSet`.

    Args:
        fs: the feature set.
        where: a name for error messages (e.g. the file it came from).

    Raises:
        ValueError: features not (N, D) float32, labels not (N,) int64, or keys not N strings.
    """
    f, y, keys = fs.features, fs.labels, fs.keys
    if not isinstance(f, Tensor) or f.ndim != 2 or f.dtype != torch.float32:
        desc = f"{tuple(f.shape)} {f.dtype}" if isinstance(f, Tensor) else type(f).__name__
        raise InputError(f"{where}: 'features' must be an (N, D) float32 tensor, got {desc}")
    n = f.shape[0]
    if not isinstance(y, Tensor) or y.shape != (n,) or y.dtype != torch.int64:
        desc = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, Tensor) else type(y).__name__
        raise InputError(f"{where}: 'labels' must be an (N,) = ({n},) int64 tensor, got {desc}")
    if not isinstance(keys, list) or len(keys) != n or not all(isinstance(k, str) for k in keys):
        got = f"{len(keys)} items" if isinstance(keys, list) else type(keys).__name__
        raise InputError(f"{where}: 'keys' must be a list of N = {n} strings, got {got}")


@torch.no_grad()
def extract_features(
    backbone: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor | Sequence[int], Sequence[str]]],
    *,
    device: torch.device | str,
    head: nn.Module | None = None,
    progress: bool = True,
    desc: str = "features",
    rows: int | None = None,
    allocate: Callable[[int, int], Tensor] | None = None,
) -> FeatureSet:
    """Run a frozen backbone (optionally + projection head) over batches and collect features.

    The modules are put in eval mode (BatchNorm uses its running statistics) and run under
    ``torch.no_grad()`` (not ``inference_mode``: the returned tensors must stay usable as inputs
    of a trained linear probe). Features are cast to fp32 and moved to CPU batch by batch. Every
    submodule's previous train/eval flag is restored afterwards, even on error. The modules must
    already be on ``device``.

    Args:
        backbone: maps (B, C, H, W) images to (B, D) features (e.g. a ResNet with ``fc``
            replaced by ``nn.Identity``).
        batches: yields ``(images (B, C, H, W), labels (B,), keys (B strings))``; read exactly
            once, in order.
        device: where images are sent before the forward pass.
        head: applied to the backbone output when given (``embed.use_head``).
        progress: show a tqdm bar (tqdm draws it on a terminal only).
        desc: the progress bar's label.
        rows: N, when known: the (N, D) result is made at the first batch (by ``allocate``)
            and filled in place, never held twice (a list of batches, then their
            concatenation). None: concatenated at the end.
        allocate: ``(N, D) -> (N, D) float32 CPU tensor`` for ``rows`` (default
            ``torch.empty``; a file-backed tensor keeps the features out of the process's
            anonymous memory: :func:`file_backed`).

    Returns:
        :class:`FeatureSet` with (N, D) float32 CPU features, (N,) int64 labels and N keys, in
        batch order.

    Raises:
        ValueError: no batches, a batch whose labels/keys do not match its size, a model
            output that is not (B, D), or a count of images other than ``rows``.
    """
    modules = [backbone] + ([head] if head is not None else [])
    modes = [(mod, mod.training) for top in modules for mod in top.modules()]
    feats: list[Tensor] = []
    out: Tensor | None = None  # (rows, D) when rows is given
    filled = 0
    labels: list[Tensor] = []
    keys: list[str] = []
    try:
        for top in modules:
            top.eval()
        bar = tqdm(batches, desc=desc, disable=None if progress else True, unit="batch")
        for images, y, k in bar:
            b = images.shape[0]
            y = torch.as_tensor(y, dtype=torch.long).cpu()
            if y.shape != (b,) or len(k) != b:
                raise InputError(
                    f"batch {len(labels)}: {b} images but labels {tuple(y.shape)} and {len(k)} keys"
                )
            f = backbone(images.to(device, non_blocking=True))
            if head is not None:
                f = head(f)
            if f.ndim != 2 or f.shape[0] != b:
                raise InputError(
                    f"batch {len(labels)}: the model returned {tuple(f.shape)}, expected (B, D) "
                    f"with B = {b} (flatten pooled features in the model)"
                )
            if rows is None:
                feats.append(f.float().cpu())
            else:
                if out is None:
                    out = (allocate or _empty)(rows, f.shape[1])
                if filled + b > rows:
                    raise InputError(f"extract_features: more than the {rows} images expected")
                out[filled:filled + b] = f
            filled += b
            labels.append(y)
            keys.extend(str(x) for x in k)
    finally:
        for mod, was_training in modes:
            mod.training = was_training
    if not labels:
        raise InputError("extract_features: no batches")
    if rows is not None and filled != rows:
        raise InputError(f"extract_features: {filled} images, {rows} expected")
    return FeatureSet(torch.cat(feats) if out is None else out, torch.cat(labels), keys)


def _empty(n: int, d: int) -> Tensor:
    return torch.empty(n, d)


def file_backed(path: Path | None, n: int, d: int) -> Tensor:
    """A zeroed (n, d) float32 tensor whose memory is the file ``path`` (created, n*d*4 bytes).

    Its pages belong to the page cache, which the kernel writes back and frees under memory
    pressure, not to the process's anonymous memory: features far larger than the RAM can be
    filled batch by batch and saved (:func:`save_features` reads them back through the
    mapping). The caller removes the file once the tensor is no longer used; ``path`` None: an
    unlinked temporary file (``TMPDIR``), gone from its directory at once and freed with the
    tensor.
    """
    if path is None:
        with tempfile.TemporaryDirectory(prefix="rows-") as tmp:
            return file_backed(Path(tmp) / "rows.f32", n, d)  # the mapping outlives the name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return torch.from_file(str(path), shared=True, size=n * d, dtype=torch.float32).view(n, d)


def save_features(fs: FeatureSet, path: str | Path) -> None:
    """Write a :class:`FeatureSet` atomically (temporary file in the same folder + ``os.replace``).

    A reader never sees a half-written file; an interrupted write leaves the old file (if any).

    Args:
        fs: the features to write.
        path: the ``.pt`` file (its folder is created when missing).

    Raises:
        ValueError: ``fs`` is malformed (see :func:`check_feature_set`).
        OSError: the file cannot be written.
    """
    check_feature_set(fs)
    path = Path(path)
    payload = {
        "format_version": FORMAT_VERSION,
        "features": fs.features.detach().cpu().contiguous(),
        "labels": fs.labels.detach().cpu().contiguous(),
        "keys": list(fs.keys),
    }
    save_torch(payload, path)


def load_features(path: str | Path) -> FeatureSet:
    """Read a file written by :func:`save_features` (``torch.load(weights_only=True)``, to CPU).

    The features are memory-mapped from the file (``mmap=True``): pages are read as rows are
    used and belong to the page cache, not the process's anonymous memory, so a stage that
    reads (N, D) features in blocks holds little more than a block (a write to them copies
    the page; the file is never changed).

    Args:
        path: the ``.pt`` file.

    Returns:
        The validated :class:`FeatureSet`.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a feature file of this format, its shapes/dtypes are
            wrong, or a row holds NaN or Inf (the message names the file, and the first such
            row and its key).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"feature file '{path}' does not exist")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # zip/pickle errors come in several classes
        raise InputError(f"{path}: not a readable feature file: {e}") from None
    if not isinstance(data, dict) or not {"features", "labels", "keys"} <= data.keys():
        raise InputError(f"{path}: expected a dict with 'features', 'labels' and 'keys'")
    if data.get("format_version") != FORMAT_VERSION:
        raise InputError(
            f"{path}: format_version {data.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    fs = FeatureSet.__new__(FeatureSet)  # validate with the file name in the message
    fs.features, fs.labels, fs.keys = data["features"], data["labels"], data["keys"]
    check_feature_set(fs, where=str(path))
    bad = torch.cat([(~torch.isfinite(fs.features[r0:r0 + FINITE_ROWS]).all(dim=1)).nonzero()
                     .flatten() + r0 for r0 in range(0, max(len(fs), 1), FINITE_ROWS)])
    if len(bad):
        first = int(bad[0])
        raise InputError(f"{path}: {len(bad)} of {len(fs)} feature rows hold NaN or Inf (first: "
                         f"row {first}, key {fs.keys[first]!r}); the encoder gave non-finite "
                         "features: check models/encoder.pt, then rerun embed")
    return fs
