"""What pretraining leaves behind: the query backbone, its head, its architecture, metrics.

The backbone is written twice, with the same tensors: ``encoder.pt`` (a ``torch.save``'d
torchvision-style ``state_dict``) and ``encoder.safetensors`` (the same keys, loadable without
pickle by ``safetensors.torch.load_file``, with ``encoder.json``'s fields as its metadata). The
key names are torchvision's ResNet names, which timm's ResNets share: for the ImageNet stem
(``small_stem: false``) and 3 channels, ``timm.create_model("resnet18", num_classes=0)`` loads
the file with ``strict=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import headline, save_torch, write_atomic, write_json, write_metrics, write_tsv
from pipeline.config import ModelParams
from pipeline.evaluate.labelfree import METRICS as LABELFREE_METRICS
from pipeline.moco.backbones import resolve_small_stem, resolve_stem_stride
from pipeline.moco.model import MoCo
from pipeline.train.checkpoint import TrainState
from pipeline.train.logging import PLOT_COLUMNS

LABELFREE_PLOT = "labelfree.tsv"  # beside plots/knn_monitor.tsv
# metrics/pretrain.json (pipeline.atomic.headline): the label-free end values, throughput and
# cost; the loss, the kNN monitor and the rest are curves (plots/) and eval/metrics/pretrain.json
HEADLINE = (*LABELFREE_METRICS, "images_per_s", "wall_time_s")


def encoder_meta(model: ModelParams, *, in_channels: int, image_size: int,
                 num_features: int) -> dict[str, Any]:
    """The architecture needed to load ``encoder.pt`` back (written as ``encoder.json``)."""
    return {"backbone": model.backbone, "width": model.width, "in_channels": in_channels,
            "small_stem": resolve_small_stem(model.small_stem, image_size),
            "stem_stride": resolve_stem_stride(
                model.stem_stride, resolve_small_stem(model.small_stem, image_size)),
            "image_size": image_size, "num_features": num_features}


def save_safetensors(state_dict: dict[str, torch.Tensor], path: Path,
                     meta: dict[str, Any]) -> None:
    """Write a backbone ``state_dict`` as safetensors, atomically, ``meta`` as its metadata.

    The bytes depend only on the inputs: safetensors writes its ``__metadata__`` map in a
    random order per call (a Rust ``HashMap``), which would change the file's md5, and so
    ``dvc.lock`` and every stage after ``pretrain``, at each rerun; the header is rewritten
    here with the metadata keys sorted (:func:`_sorted_metadata`).

    Args:
        state_dict: CPU tensors (made contiguous here; safetensors stores no strides).
        path: the ``.safetensors`` file.
        meta: JSON-able values (safetensors metadata holds strings: each value is JSON-encoded).
    """
    import json

    from safetensors.torch import save

    data = save({k: v.contiguous() for k, v in state_dict.items()},
                metadata={k: json.dumps(v, sort_keys=True) for k, v in meta.items()})
    data = _sorted_metadata(data)
    write_atomic(path, lambda f: f.write(data))


def _sorted_metadata(data: bytes) -> bytes:
    """Safetensors bytes with the header's ``__metadata__`` keys in sorted order.

    The format: an 8-byte little-endian header length N, N bytes of JSON (the tensors'
    entries and ``__metadata__``; padded with spaces to a multiple of 8), then the tensor data,
    whose offsets are relative to its start and so do not move.
    """
    import json

    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n:]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA max allocated, else max RSS (Linux reports KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def final_metrics(state: TrainState, *, total_steps: int, epochs: int, wall_s: float,
                  device: torch.device, world_size: int) -> dict[str, float]:
    """Every final number: last window's loss/accuracy, mean throughput, cost, kNN, label-free.

    Written whole to ``eval/metrics/pretrain.json``, :data:`HEADLINE` of it to
    ``metrics/pretrain.json`` (:func:`export_outputs`).
    """
    rows = state.rows
    last = rows[-1] if rows else {}

    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows) if rows else 0.0

    out = {"loss": last.get("loss", float("nan")), "inst_top1": last.get("inst_top1", 0.0),
           "inst_top5": last.get("inst_top5", 0.0), "steps": total_steps, "epochs": epochs,
           "images_per_s": mean("images_per_s"), "data_wait_fraction": mean("data_wait_fraction"),
           "wall_time_s": wall_s, "peak_memory_bytes": peak_memory_bytes(device),
           "world_size": world_size, "num_threads": state.num_threads}
    if state.knn_rows:
        out["knn_top1"] = state.knn_rows[-1]["knn_top1"]
        out["knn_top5"] = state.knn_rows[-1]["knn_top5"]
        out["knn_top1_init"] = state.knn_rows[0]["knn_top1"]
    if state.labelfree_rows:  # the last monitor point: the end of training
        out.update({k: state.labelfree_rows[-1][k] for k in LABELFREE_METRICS})
        out.update({f"{k}_init": state.labelfree_rows[0][k] for k in LABELFREE_METRICS})
    return out


def export_outputs(net: MoCo, model: ModelParams, *, in_channels: int, image_size: int,
                   state: TrainState, metrics: dict[str, float], encoder_path: Path,
                   metrics_path: Path, plots_path: Path, knn_plots_path: Path,
                   details_path: Path | None = None) -> None:
    """Write the encoder (plain BN, no ``fc``; ``.pt`` and ``.safetensors``), head, metrics.

    Also ``head.pt``, ``encoder.json`` and the curves: ``plots_path``, ``knn_plots_path`` and,
    beside it, :data:`LABELFREE_PLOT` (the label-free monitor rows). ``metrics_path`` gets the
    :data:`HEADLINE` numbers, ``details_path`` (None: not written) all of ``metrics``. Every
    file is written atomically (temp file + rename).
    """
    backbone = net.export_backbone()
    meta = encoder_meta(model, in_channels=in_channels, image_size=image_size,
                        num_features=net.encoder_q.backbone.num_features)
    save_torch(backbone, encoder_path)
    save_safetensors(backbone, encoder_path.with_suffix(".safetensors"), meta)
    head = net.encoder_q.head
    # plain types only: torch.load(weights_only=True) refuses any class, a params enum included
    save_torch({"kind": str(model.head), "in_dim": net.encoder_q.backbone.num_features,
                 "hidden": model.head_hidden, "dim": model.dim,
                 "state_dict": {k: v.detach().cpu() for k, v in head.state_dict().items()}},
                encoder_path.with_name("head.pt"))
    write_json(encoder_path.with_suffix(".json"), meta)
    if details_path is not None:
        write_metrics(details_path, metrics)
    write_metrics(metrics_path, headline(metrics, HEADLINE))
    write_tsv(plots_path, PLOT_COLUMNS, state.rows)
    write_tsv(knn_plots_path, ("epoch", "step", "knn_top1", "knn_top5"), state.knn_rows)
    write_tsv(knn_plots_path.with_name(LABELFREE_PLOT), ("epoch", "step", *LABELFREE_METRICS),
              state.labelfree_rows)
