"""Where and how training runs: device, DDP, precision, CPU threads, memory format, compile.

One code path serves one CPU process, one GPU and N processes under ``torchrun`` (gloo on CPU,
NCCL on GPU). The device is chosen once in :func:`setup_device` and passed along.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipeline.choices import Switch
from pipeline.cores import usable_cores

log = logging.getLogger(__name__)

# pretrain.compile = auto on CPU (see resolve_compile). Measured on 2 cores (ResNet-18 width 16,
# batch 256, 28 px): compiled 227 vs eager 192 img/s, i.e. ~0.17 s saved per step, but the first
# compile on a cold inductor cache took 565 s (7.5 s warm), so it pays off from ~3,300 steps of
# 256 images, i.e. ~0.66 ms saved per image: ~850,000 images. The rule counts images, not steps:
# at batch 64 a step saves a quarter as much (a 4,685-step run of 300,000 images would lose time).
CPU_COMPILE_MIN_IMAGES = 1_000_000
CPU_COMPILE_MIN_WIDTH = 16


@dataclass
class Runtime:
    """Where and how this process runs."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, checkpoints and exports."""
        return self.rank == 0


def setup_device() -> Runtime:
    """Initialise torch.distributed from torchrun's environment (if present) and pick a device.

    Returns:
        The :class:`Runtime`: ``cuda:LOCAL_RANK`` when CUDA exists, else CPU; gloo on CPU,
        NCCL on CUDA.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Runtime(device=device, rank=rank, world_size=world, local_rank=local)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512_BF16 or AMX), per torch or /proc/cpuinfo.

    Without it, bf16 autocast on CPU was measured ~30x slower than fp32; with AVX512_BF16, 2.3x
    faster (this project's machines, 2026-11-30).
    """
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(cpu, probe, None)
        if fn is not None:
            with contextlib.suppress(Exception):
                if fn():
                    return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_precision(precision: str, device: torch.device,
                      native_bf16: Callable[[], bool] = cpu_has_native_bf16) -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device`` (None = fp32, no autocast).

    ``auto`` = bf16 on CUDA with bf16 support, fp16 (+ GradScaler) on older CUDA, bf16 on a CPU
    with native bf16, fp32 on other CPUs. The InfoNCE loss is computed in fp32 either way
    (:mod:`pipeline.moco.loss`).

    Args:
        precision: ``auto``, ``fp32``, ``bf16`` or ``fp16`` (``pretrain.precision``).
        device: the training device.
        native_bf16: detector for CPU bf16 support (injectable for tests).
    """
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if native_bf16() else None


def resolve_switch(value: Switch | str, *, cpu_default: bool, device: torch.device) -> bool:
    """``auto``/``true``/``false`` → bool; ``auto`` is True on CUDA, ``cpu_default`` on CPU.

    Raises:
        InputError: not a :class:`~pipeline.choices.Switch` name.
    """
    return Switch.parse(value, "auto|true|false switch").on(
        auto=device.type == "cuda" or cpu_default)


class Precision:
    """Autocast and (fp16 only) gradient scaling around the step.

    Args:
        dtype: autocast dtype, or None for fp32.
        device: the training device.
    """

    def __init__(self, dtype: torch.dtype | None, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass's autocast context (disabled for fp32)."""
        return torch.autocast(self.device.type, dtype=self.dtype or torch.float32,
                              enabled=self.dtype is not None)

    def backward_and_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """``loss.backward()`` and ``optimizer.step()``, scaled when fp16."""
        optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        self.scaler.update()

    @property
    def name(self) -> str:
        """``fp32``, ``bf16`` or ``fp16``."""
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]


def resolve_num_workers(value: int | str, device: torch.device, *, cores: int | None = None,
                        local_world_size: int | None = None) -> int:
    """``pretrain.num_workers`` as a count of loader worker processes.

    ``auto`` on CUDA: the usable cores shared by the training processes of this node
    (``LOCAL_WORLD_SIZE``, set by torchrun; 1 otherwise), less one core for each training
    process itself, at least 1. Decoding and cropping photos costs ~1 CPU ms per pair
    (``benchmarks/photo_loader.py``, docs/performance.md), so a GPU that takes ~1,800 pairs/s
    needs every core it can get. ``auto`` on CPU: 1, as before: the training itself runs on
    the same cores (:func:`setup_threads`), and workers that compete with it slow the step.

    Args:
        value: ``auto`` or a non-negative integer (the params schema checks it).
        device: the training device.
        cores: usable cores (default :func:`usable_cores`).
        local_world_size: training processes on this node (default ``LOCAL_WORLD_SIZE``, 1).

    Returns:
        The number of workers, ``>= 0``.
    """
    if value != "auto":
        return int(value)
    if device.type != "cuda":
        return 1
    cores = usable_cores() if cores is None else cores
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local_world_size) - 1)


def thread_candidates(num_workers: int) -> list[int]:
    """Intra-op thread counts worth probing, largest first (deduplicated).

    All usable cores, all minus the loader workers, and half.

    Loader workers only read and decode (views are made on the training device), a small part
    of a core: measured on 2 cores with 1 worker, the stage ran at 205 img/s with 2 threads and
    121 img/s with 1 (``benchmarks/pretrain_step.py``), so all cores come first and the probe
    keeps fewer only when it measures them faster (contended cores).
    """
    full = usable_cores()
    return sorted({full, max(1, full - num_workers), max(1, full // 2)}, reverse=True)


def resolve_compile(value: Switch | str, *, device: torch.device, width: int,
                    total_images: int) -> bool:
    """``pretrain.compile`` → bool.

    ``auto``: on CUDA always. On CPU when the run is long enough to pay for compiling
    (``total_images`` = steps × global batch ``>= CPU_COMPILE_MIN_IMAGES``), the model is not tiny
    (``width >= CPU_COMPILE_MIN_WIDTH``: inductor picks channels_last convolutions, which
    corrupt memory in torch 2.14 at width 4 on one thread) and a C++ compiler is present.

    Raises:
        InputError: not a :class:`~pipeline.choices.Switch` name.
    """
    if (switch := Switch.parse(value, "pretrain.compile")) is not Switch.auto:
        return switch is Switch.true
    if device.type == "cuda":
        return True
    if width < CPU_COMPILE_MIN_WIDTH or total_images < CPU_COMPILE_MIN_IMAGES:
        return False
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:  # noqa: BLE001  (no compiler, or inductor internals moved: stay eager)
        return False


def choose_threads(candidates: list[int], probe: Callable[[], None], repeats: int = 2,
                   margin: float = 0.2) -> int:
    """The thread count for ``probe`` (one training-sized forward+backward).

    On a quiet machine all cores win; when another busy process shares the cores, fewer
    threads avoid OpenMP oversubscription (measured: 1 thread beside one busy process keeps
    0.71x of the quiet 2-thread rate, 2 threads only 0.42x). The probe runs ``repeats`` times
    per candidate after one warm-up; the minimum time counts. A smaller count is chosen only
    when it is faster by more than ``margin`` (20 %), so that on a quiet machine the choice is
    stable and two runs compute the same floats.

    Returns:
        The chosen thread count (also set with ``torch.set_num_threads``).
    """
    if len(candidates) == 1:
        torch.set_num_threads(candidates[0])
        return candidates[0]
    times = {}
    for n in candidates:
        torch.set_num_threads(n)
        probe()
        t = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            probe()
            t = min(t, time.perf_counter() - t0)
        times[n] = t
        log.info("threads %d: probe step %.3f s", n, t)
    best = candidates[0]
    for n in candidates[1:]:
        if times[n] < times[best] * (1 - margin):
            best = n
    torch.set_num_threads(best)
    return best


@contextlib.contextmanager
def kept_threads() -> Iterator[None]:
    """Restore torch's intra-op thread count on exit: a run's thread choice is that run's only."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_threads(*, cores: int | None = None, local_world_size: int | None = None) -> int:
    """``pretrain.num_threads: auto`` on CPU: this process's share of the usable cores.

    A property of the machine (its usable cores, shared by the training processes of the node),
    never of its load at the moment: the same machine and params train the same weights. All
    cores, although a loader worker runs beside them: it only reads and decodes (views are made
    on the training device), and on 2 cores with 1 worker the stage ran at 205 img/s with 2
    threads, 121 img/s with 1 (``benchmarks/pretrain_step.py``).

    Args:
        cores: usable cores (default :func:`usable_cores`).
        local_world_size: training processes on this node (default ``LOCAL_WORLD_SIZE``, 1).
    """
    cores = usable_cores() if cores is None else cores
    local = (int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world_size is None
             else local_world_size)
    return max(1, cores // max(1, local))


def setup_threads(*, requested: int | str, resumed: int, num_workers: int,
                  device: torch.device, probe_model: nn.Module,
                  input_shape: tuple[int, ...]) -> int:
    """CPU intra-op threads: the resumed run's, else ``pretrain.num_threads``.

    A resumed run keeps the thread count it started with, whatever ``pretrain.num_threads``
    says now (float reductions depend on it, so resume stays bit-identical, and a finished
    training exported again reports the count that trained it); an explicit other count gets
    a warning. A fresh run takes a count as given, and ``auto`` as :func:`default_threads`
    (the machine's cores, not their load). ``probe``
    times one training-sized forward+backward of a copy of ``probe_model`` for each of
    :func:`thread_candidates` and keeps the fastest (:func:`choose_threads`): faster on a busy
    machine, but a busy and a quiet machine may then train different weights. The count used
    is in ``eval/metrics/pretrain.json`` (``num_threads``) either way.

    Args:
        requested: ``pretrain.num_threads``: ``auto``, ``probe`` or a count >= 1.
        resumed: the checkpoint's thread count (0 = none).
        num_workers: loader workers (``pretrain.num_workers``).
        device: the training device (CUDA: torch's default, no probe).
        probe_model: the query encoder, copied for the probe (its weights are untouched).
        input_shape: ``(B, C, S, S)`` of one rank's step.

    Returns:
        The thread count now set.
    """
    if resumed > 0 and isinstance(requested, int) and requested != resumed:
        log.warning("pretrain.num_threads = %d, but the checkpoint was trained on %d thread(s): "
                    "it goes on with %d (sums in another order give other weights; to train "
                    "on %d: `python -m pipeline clean-checkpoints`)", requested, resumed,
                    resumed, requested)
    if isinstance(requested, int) or resumed > 0:
        n = resumed or int(requested)
        if n > usable_cores():
            log.warning("pretrain.num_threads = %d exceeds the %d usable cores: threads will "
                        "compete for them", n, usable_cores())
        torch.set_num_threads(n)
        return n
    if device.type == "cuda":
        return torch.get_num_threads()
    if requested == "auto":
        n = default_threads()
        torch.set_num_threads(n)
        log.info("CPU threads: %d (pretrain.num_threads = auto: the usable cores)", n)
        return n
    net = copy.deepcopy(probe_model).train()
    with torch.random.fork_rng(devices=[]):
        x = torch.randn(input_shape)

        def probe() -> None:
            net(x).sum().backward()

        n = choose_threads(thread_candidates(num_workers), probe)
    log.info("CPU threads: %d (pretrain.num_threads = probe: probed %s)", n,
             thread_candidates(num_workers))
    return n


def wrap_model(net: nn.Module, rt: Runtime, *, channels_last: bool, compile_: bool) -> nn.Module:
    """The module the step calls: channels_last memory format, DDP and/or ``torch.compile``.

    Compilation applies to the two encoders (the queue bookkeeping stays eager), so a compiled
    model keeps the same ``state_dict`` keys and checkpoints stay interchangeable.
    """
    if channels_last:
        net.to(memory_format=torch.channels_last)
    if compile_:
        net.encoder_q.compile()
        net.encoder_k.compile()
    if rt.world_size == 1:
        return net
    # No buffer sync: queues are identical by construction (gathered keys), and syncing would
    # re-broadcast the whole (D, K) queue every step.
    return nn.parallel.DistributedDataParallel(
        net, device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        **_no_buffer_sync_kwargs())


def _no_buffer_sync_kwargs() -> dict[str, bool]:
    """DDP kwargs that disable buffer broadcasting (renamed in recent torch releases)."""
    import inspect

    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def configure_determinism(enabled: bool, device: torch.device) -> None:
    """Deterministic algorithms when asked (bit-identical resume); else cuDNN autotuning on CUDA.

    GPU presets keep ``cudnn.benchmark`` unless ``pretrain.deterministic`` asks otherwise.
    """
    if enabled:
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True


LIBRARIES = ("torch", "torchvision", "dvc", "mlflow")  # versions in describe_machine()


def cpu_model() -> str:
    """The CPU's model name: ``/proc/cpuinfo``, else :func:`platform.processor`, else unknown."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe_machine() -> dict[str, str]:
    """The machine and the libraries of this process, in words, for run provenance.

    Returns:
        ``cpu`` (model and usable / all cores, e.g. ``"AMD EPYC, 2 of 2 cores"``), ``gpu``
        (``"1 x NVIDIA H100 80GB HBM3"``; ``"none"`` without CUDA) and the version of each of
        :data:`LIBRARIES` (torch's and torchvision's with their build tag, e.g. ``+cu130``;
        ``"not installed"`` when absent).
    """
    from collections import Counter
    from importlib import metadata

    out = {"cpu": f"{cpu_model()}, {usable_cores()} of {os.cpu_count() or '?'} cores",
           "gpu": "none"}
    if torch.cuda.is_available():
        names = Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        out["gpu"] = ", ".join(f"{n} x {name}" for name, n in sorted(names.items()))
    import torchvision

    out |= {"torch": torch.__version__, "torchvision": torchvision.__version__}  # +cuXYZ builds
    for lib in ("dvc", "mlflow"):  # not imported here: their installed metadata
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = "not installed"
    return out
