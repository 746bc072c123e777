"""MoCo pretraining engine: a short driver (:func:`pretrain`) and its named parts.

* :mod:`~pipeline.train.engine` — the driver and the step (views → forward → loss → backward →
  optimizer; the EMA update and the enqueue happen inside :class:`~pipeline.moco.model.MoCo`).
* :mod:`~pipeline.train.runtime` — device, DDP, precision, CPU threads, channels_last, compile.
* :mod:`~pipeline.train.schedules` — per-step learning rates (momentum schedule:
  :mod:`pipeline.moco.momentum`).
* :mod:`~pipeline.train.state` — what a checkpoint holds, when it is written, resume.
* :mod:`~pipeline.train.logging` — logging windows (loss, instance accuracy, img/s, data wait).
* :mod:`~pipeline.train.monitor` — the kNN monitor.
* :mod:`~pipeline.train.signals` — SIGTERM/SIGINT → checkpoint at the next step, then stop.
* :mod:`~pipeline.train.export` — the torchvision-style encoder, head and final metrics.
"""

from pipeline.train.engine import NonFiniteLossError, PlanError, build_moco, image_spec, pretrain
from pipeline.train.export import encoder_meta
from pipeline.train.runtime import Runtime, resolve_precision, setup_device
from pipeline.train.schedules import lr_schedule

__all__ = ["NonFiniteLossError", "PlanError", "Runtime", "build_moco", "encoder_meta", "image_spec",
           "lr_schedule", "pretrain", "resolve_precision", "setup_device"]
