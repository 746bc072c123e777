"""CUDA throughput of MoCo pretraining; prints JSON. Exits 0 with a message without CUDA.

* ``runs``: the MoCo step alone (SplitBN, queue, EMA, InfoNCE; bf16 autocast, channels_last on
  and off) on synthetic data for resnet18 at 32 px (CIFAR-size, small stem) and resnet50 at
  224 px, with the two views made on the GPU from a uint8 batch (kornia, as in training);
  images/s = median over timed steps after warm-up, synchronised.
* ``end_to_end``: the real engine (``pipeline.train.pretrain``: real train loader, on-device
  views, compile/channels_last auto) on a 32 px, 3-channel version of the Fashion-MNIST shards
  (the CIFAR-10 layout: 50,000 images) with the CIFAR-10 demo's model (resnet18 width 64, small
  stem, K 4096, batch 512), and the estimated minutes of a 200-epoch CIFAR-10-sized run.

Usage: ``python benchmarks/gpu.py [--steps 30] [--batch-r18 512] [--batch-r50 128]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pipeline.data.views import BatchTwoCrop, build_batch_view
from pipeline.moco.backbones import build_backbone, build_head
from pipeline.moco.model import MoCo


def bench(name: str, size: int, batch: int, small_stem: bool, steps: int, dtype: torch.dtype,
          channels_last: bool, device: torch.device) -> dict:
    torch.manual_seed(0)
    bb = build_backbone(name, width=64, in_channels=3, small_stem=small_stem)
    head = build_head("mlp", bb.num_features, bb.num_features, 128)
    net = MoCo(bb, head, K=65536, m=0.999, T=0.2, bn="split", bn_splits=8).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = net.to(memory_format=fmt)
    opt = torch.optim.SGD(net.trainable_parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    src = 256 if size >= 224 else size
    images = torch.randint(0, 256, (batch, 3, src, src), dtype=torch.uint8, device=device)
    views = BatchTwoCrop(build_batch_view("v2", size, (0.5,) * 3, (0.25,) * 3).to(device), fmt)
    times = []
    for step in range(steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        x_q, x_k = views(images, step)
        with torch.autocast("cuda", dtype=dtype):
            out = net(x_q, x_k, step=step)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"model": name, "image_size": size, "batch_size": batch, "dtype": str(dtype),
            "channels_last": channels_last,
            "images_per_s": round(batch / statistics.median(times[max(3, steps // 3):]), 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "final_loss": round(float(out.loss), 4)}


def end_to_end(steps: int, batch: int) -> dict:
    """The real engine on 32 px RGB Fashion-MNIST shards (CIFAR-10 layout), CIFAR demo model."""
    import tempfile
    from pathlib import Path

    from PIL import Image

    from pipeline.config import from_dict
    from pipeline.data.build import write_shards
    from pipeline.data.sources import Sample, open_source
    from pipeline.train.engine import pretrain

    src = open_source("fashion_mnist")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for split, n in (("pretrain", 50000), ("train", 2000), ("test", 1000)):
            part = "train" if split != "test" else "test"
            samples = (Sample(s.key, s.image.resize((32, 32), Image.BILINEAR).convert("RGB"),
                              s.label) for s in src.iter(part, max_images=n))
            write_shards(samples, root / split, split=split, source="fmnist32rgb",
                         class_names=src.class_names, mode="RGB", samples_per_shard=5000,
                         progress=False)
        p = from_dict({"model": {"width": 64, "head": "mlp", "head_hidden": 512},
                       "moco": {"K": 4096, "m": 0.99, "T": 0.1, "bn_splits": 8},
                       "augment": {"preset": "v2_small"},
                       "pretrain": {"epochs": 1, "steps_per_epoch": steps, "batch_size": batch,
                                    "lr": 0.06, "num_workers": 4, "deterministic": False,
                                    "knn_every_epochs": 0, "checkpoint_every_steps": 0,
                                    "log_every_steps": 1}})
        out = root / "out"
        t0 = time.perf_counter()
        m = pretrain(model=p.model, moco=p.moco, opt=p.pretrain, augment=p.augment, seed=0,
                     shards_dir=root, encoder_path=out / "e.pt", checkpoint_dir=out / "ck",
                     metrics_path=out / "m.json", plots_path=out / "p.tsv",
                     knn_plots_path=out / "k.tsv")
        wall = time.perf_counter() - t0
        rows = [r.split("\t") for r in (out / "p.tsv").read_text().splitlines()]
    vals = [dict(zip(rows[0], r)) for r in rows[1:]][steps // 3:]
    rate = statistics.median(float(v["images_per_s"]) for v in vals)
    return {"what": "engine + real loader + on-device views, resnet18 w64 32px, batch "
            f"{batch}", "images_per_s": round(rate, 1),
            "data_wait_fraction": round(statistics.median(
                float(v["data_wait_fraction"]) for v in vals), 3),
            "wall_s_incl_startup_and_compile": round(wall, 1), "steps": steps,
            "est_minutes_200_epochs_50k_images": round(200 * 50000 / rate / 60, 1),
            "final_loss": round(m["loss"], 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-r18", type=int, default=512)
    ap.add_argument("--batch-r50", type=int, default=128)
    ap.add_argument("--e2e-steps", type=int, default=60)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: nothing to measure"}))
        return 0
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "runs": []}
    for name, size, batch, small in (("resnet18", 32, args.batch_r18, True),
                                     ("resnet50", 224, args.batch_r50, False)):
        for cl in (True, False):
            results["runs"].append(bench(name, size, batch, small, args.steps, dtype, cl, device))
            print(json.dumps(results["runs"][-1]), file=sys.stderr, flush=True)
    results["end_to_end"] = end_to_end(args.e2e_steps, args.batch_r18)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
