"""MoCo pretraining: the loop (:mod:`~pipeline.train.engine`) and its named parts.

* :mod:`~pipeline.train.engine` — the step (views → forward → loss → backward → optimizer; the
  EMA update and the enqueue happen inside :class:`~pipeline.moco.model.MoCo`), the epoch loop
  and the driver.
* :mod:`~pipeline.train.plan` — sizes and schedules checked against the data; the MoCo model.
* :mod:`~pipeline.train.runtime` — device, DDP, precision, CPU threads, channels_last, compile.
* :mod:`pipeline.schedules` — per-step learning rates, shared with the linear probe (momentum
  schedule: :mod:`pipeline.moco.momentum`).
* :mod:`~pipeline.train.checkpoint` — what a checkpoint holds, when it is written, resume.
* :mod:`~pipeline.train.logging` — logging windows (loss, instance accuracy, img/s, data wait).
* :mod:`~pipeline.train.monitor` — the kNN monitor.
* :mod:`~pipeline.train.export` — the torchvision-style encoder, head and final metrics.
"""
