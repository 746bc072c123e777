"""Logging windows: per-step statistics averaged over ``log_every_steps`` steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PLOT_COLUMNS = ("step", "epoch", "loss", "lr", "m", "inst_top1", "inst_top5", "queue_mean_age",
                "data_wait_fraction", "images_per_s")


@dataclass
class LogWindow:
    """Accumulates loss, instance top-1/top-5 (%) and data-wait seconds between two log rows.

    Attributes:
        batch_size: global images per step (for images/s).
    """

    batch_size: int
    loss: float = 0.0
    top1: float = 0.0
    top5: float = 0.0
    wait_s: float = 0.0
    n: int = 0
    t0: float = field(default_factory=time.time)

    def add(self, *, loss: float, top1: float, top5: float, wait_s: float) -> None:
        """Record one step."""
        self.loss += loss
        self.top1 += top1
        self.top5 += top5
        self.wait_s += wait_s
        self.n += 1

    def row(self, *, step: int, steps_per_epoch: int, lr: float, m: float,
            queue_mean_age: float) -> dict[str, float]:
        """The window's averages as one ``plots/pretrain.tsv`` row; then the window restarts."""
        dt = max(time.time() - self.t0, 1e-9)
        n = max(self.n, 1)
        out = {"step": step, "epoch": step / steps_per_epoch, "loss": self.loss / n, "lr": lr,
               "m": m, "inst_top1": self.top1 / n, "inst_top5": self.top5 / n,
               "queue_mean_age": queue_mean_age, "data_wait_fraction": self.wait_s / dt,
               "images_per_s": self.n * self.batch_size / dt}
        self.loss = self.top1 = self.top5 = self.wait_s = 0.0
        self.n = 0
        self.t0 = time.time()
        return out


def format_row(r: dict[str, float], total_steps: int) -> str:
    """One human log line for a row."""
    return (f"step {int(r['step'])}/{total_steps} epoch {r['epoch']:.2f} loss {r['loss']:.4f} "
            f"inst-top1 {r['inst_top1']:.1f}% lr {r['lr']:.4f} {r['images_per_s']:.0f} img/s "
            f"wait {100 * r['data_wait_fraction']:.0f}%")
