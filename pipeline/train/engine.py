"""The pretraining loop: :func:`train_step` (Algorithm 1), one epoch, the whole run.

Read top to bottom: :func:`pretrain` wires the parts into a :class:`Run` (resuming from a
checkpoint when one fits), calls :func:`train_one_epoch` until the last step and exports the
query backbone. :func:`train_one_epoch` is the cadence of every step: batch → views → MoCo
step → logging window → kNN monitor at the epoch's end → stop signal → checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from pipeline.config import (
    AugmentParams,
    MocoParams,
    ModelParams,
    Params,
    PretrainParams,
)
from pipeline.data.loader import train_loader
from pipeline.data.manifest import Manifest, read_manifest
from pipeline.data.remote import ShardURL
from pipeline.data.shards import missing_labels
from pipeline.data.views import (
    BatchTwoCrop,
    SeededRandomResizedCrop,
    build_batch_view,
    build_eval_transform,
)
from pipeline.data.workers import LoaderWorkerError, SharedMemoryError, shut_down, worker_death
from pipeline.errors import InputError
from pipeline.evaluate.verdict import TAG as VERDICT_TAG
from pipeline.evaluate.verdict import collapse_reason
from pipeline.moco.distributed import ranks_identical
from pipeline.moco.geometry import small_crop_side
from pipeline.moco.model import MoCo, MocoOutput
from pipeline.seeds import batch_seed
from pipeline.signals import StopFlag, Terminated, signal_name, stop_on_signals
from pipeline.train.checkpoint import (
    MONITOR_PARAMS,
    Checkpointer,
    CheckpointPolicy,
    NonFiniteError,
    TrainState,
)
from pipeline.train.export import export_outputs, final_metrics
from pipeline.train.logging import LogWindow, format_row
from pipeline.train.monitor import KnnMonitor, LabelFreeProbe, Monitor
from pipeline.train.plan import RunPlan, build_moco, plan_run
from pipeline.train.runtime import (
    Precision,
    Runtime,
    configure_determinism,
    describe_machine,
    kept_threads,
    resolve_compile,
    resolve_num_workers,
    resolve_precision,
    resolve_switch,
    setup_device,
    setup_threads,
    wrap_model,
)
from pipeline.train.training_input import TrainingInput, training_input

if TYPE_CHECKING:
    from pipeline.tracking import StageRun

log = logging.getLogger(__name__)


class NonFiniteLossError(NonFiniteError):
    """The loss became NaN or inf; training stopped before the optimizer step."""


def train_step(net: nn.Module, images: torch.Tensor, *, views: BatchTwoCrop, aug_seed: int,
               optimizer: torch.optim.Optimizer, precision: Precision, lr: float, m: float,
               step: int) -> MocoOutput:
    """One MoCo step, as Algorithm 1 of He et al. (2020).

    Args:
        net: the MoCo module (possibly DDP-wrapped).
        images: ``(B, C, H, W)`` uint8 batch on the training device.
        views: makes the query and key views (and the small crops of multi-crop).
        aug_seed: the batch's augmentation seed (:func:`pipeline.seeds.batch_seed`).
        optimizer: SGD over the query encoder.
        precision: autocast and gradient scaling.
        lr: this step's learning rate.
        m: this step's key-encoder momentum.
        step: global step (queue bookkeeping).

    Returns:
        The forward's :class:`MocoOutput` (loss, logits ``(B, 1 + K)``, instance accuracy).

    Raises:
        NonFiniteLossError: the loss is NaN or inf (nothing was updated by the optimizer).
    """
    im_q, im_k, small = views.draw_all(images, aug_seed)  # (B, C, S, S) each; small: (B, C, s, s)
    for group in optimizer.param_groups:
        group["lr"] = lr
    with precision.autocast():
        out = net(im_q, im_k, m=m, step=step, im_small=small)  # q; EMA; k; InfoNCE; enqueue
    if not torch.isfinite(out.loss.detach()):
        raise NonFiniteLossError(f"non-finite loss ({out.loss.item()}) at step {step}")
    precision.backward_and_step(out.loss, optimizer)  # SGD on the query encoder only
    return out


@dataclass
class Run:
    """Everything one pretraining run holds between steps (built once by :func:`pretrain`).

    Attributes:
        rt: device and ranks.
        plan: sizes and per-step schedules.
        opt: the ``pretrain`` params (cadences, workers).
        seed: the run seed (data order, views).
        shards_dir: holds ``pretrain/``, ``train/``, ``test/``.
        pretrain_set: the pretraining set's manifest (the built split, possibly joined with
            indexed shards read in place: :func:`pipeline.data.index.pretrain_manifest`).
        net: the MoCo module (its state is what a checkpoint saves).
        ddp_net: what the step calls (``net``, possibly DDP-wrapped and compiled).
        precision: autocast and gradient scaling.
        optimizer: SGD over the query encoder.
        ckpt: writes and restores ``last.pt``.
        state: the step, the logged rows, wall time so far.
        views: MoCo's two views, on the device.
        crop: per-image crop in the loader workers (variable-size shards), else None.
        monitor: the kNN monitor.
        policy: when a checkpoint is due.
        stop: set by SIGTERM/SIGINT; checked after every step.
        bar: the progress bar (disabled off a terminal and on ranks > 0).
        tracking: the MLflow run (rank 0), or None.
        in_step: between taking a batch and the end of its step (the state is not whole).
    """

    rt: Runtime
    plan: RunPlan
    opt: PretrainParams
    seed: int
    shards_dir: Path | ShardURL
    pretrain_set: Manifest
    net: MoCo
    ddp_net: nn.Module
    precision: Precision
    optimizer: torch.optim.Optimizer
    ckpt: Checkpointer
    state: TrainState
    views: BatchTwoCrop
    crop: SeededRandomResizedCrop | None
    num_workers: int
    monitor: Monitor
    policy: CheckpointPolicy
    stop: StopFlag
    bar: tqdm
    tracking: StageRun | None
    in_step: bool = False


def save_checkpoint(r: Run) -> None:
    """Write ``last.pt`` at the current step (rank 0)."""
    r.ckpt.save(r.net, r.optimizer, r.precision.scaler, r.state)


def worker_died(r: Run, died: LoaderWorkerError) -> BaseException:
    """The one-line failure for a dead loader worker, with the step to resume from.

    Between two steps (the usual case: the death surfaces while a batch is awaited) the state
    is whole, so a checkpoint is written at the current step; inside a step the one on disk
    stands, and its step is read from the file (the death can surface while it is written).
    When this process also received SIGTERM/SIGINT (a signal to the whole process group
    reaches the worker first), it is that signal's :class:`Terminated`. A batch that did not
    fit in ``/dev/shm`` advises ``pretrain.num_workers: 0`` too.
    """
    if isinstance(died, SharedMemoryError):
        died = died.with_workers_key("pretrain.num_workers")
    if not r.in_step:
        save_checkpoint(r)
        where = f"checkpoint written at step {r.state.step} to {r.ckpt.path}"
    elif (saved := r.ckpt.saved_step()) is not None:
        where = f"the last checkpoint is at step {saved} ({r.ckpt.path})"
    else:
        where = "no checkpoint was written yet"
    if r.stop.raised:
        return Terminated(f"{signal_name(r.stop.signum)}: {where} (a DataLoader worker was "
                          f"killed by {died.signal_name} first)", signum=r.stop.signum)
    return died.with_where(f"{where}; rerun to resume from it")


def train_one_epoch(r: Run, epoch: int, stop_at: int) -> None:
    """The steps of ``epoch`` from the current step (a resumed epoch skips what was done).

    Raises:
        NonFiniteLossError: the loss became NaN/inf (the last good checkpoint is kept).
        Terminated: SIGTERM or SIGINT arrived (a checkpoint was written at this step).
    """
    spe, state, plan = r.plan.steps_per_epoch, r.state, r.plan
    loader = train_loader(r.shards_dir / "pretrain", batch_size=plan.per_rank_batch, steps=spe,
                          epoch=epoch, seed=r.seed, rank=r.rt.rank, world_size=r.rt.world_size,
                          num_workers=r.num_workers, skip_batches=state.step - epoch * spe,
                          pin_memory=r.rt.device.type == "cuda", crop=r.crop,
                          manifest=r.pretrain_set, decode=str(r.opt.decode))
    r.net.train()
    batches = iter(loader)
    try:
        _train_steps(r, batches, epoch, stop_at)
    finally:  # the workers stop here, not later in the iterator's __del__
        shut_down(batches)


def _train_steps(r: Run, batches: Iterator[Any], epoch: int, stop_at: int) -> None:
    """The steps of :func:`train_one_epoch`, from ``batches`` (``iter`` of its loader)."""
    spe, state, plan = r.plan.steps_per_epoch, r.state, r.plan
    window = LogWindow(r.opt.batch_size)
    while state.step < min((epoch + 1) * spe, stop_at):
        s = state.step
        t_wait = time.time()
        images, _ = next(batches)
        r.in_step = True  # from here to the step's end the state is not whole
        wait_s = time.time() - t_wait
        # an EncodedBatch (pretrain.decode: device) decodes its JPEGs on the device here
        images = images.to(r.rt.device, non_blocking=True)
        try:
            out = train_step(r.ddp_net, images, views=r.views,
                             aug_seed=batch_seed(r.seed, epoch, s, r.rt.rank),
                             optimizer=r.optimizer, precision=r.precision, lr=plan.lrs[s],
                             m=plan.momenta[s], step=s)
        except NonFiniteLossError as e:
            raise NonFiniteLossError(f"{e} (epoch {epoch}); training stopped, "
                                     f"{r.ckpt.kept()}. Lower pretrain.lr or check the "
                                     "data") from None
        state.step = s = s + 1
        window.add(loss=out.loss.item(), top1=float(out.top1), top5=float(out.top5),
                   wait_s=wait_s)
        r.bar.update(1)
        r.bar.set_postfix(loss=f"{out.loss.item():.3f}", refresh=False)
        if s % r.opt.log_every_steps == 0 or s == plan.total_steps:
            row = window.row(step=s, steps_per_epoch=spe, lr=plan.lrs[s - 1],
                             m=plan.momenta[s - 1], queue_mean_age=float(r.net.queue.mean_age(s)))
            state.rows.append(row)
            if r.tracking is not None:
                r.tracking.log_metrics({k: v for k, v in row.items() if k != "step"}, step=s)
            if r.bar.disable and r.rt.is_main:
                log.info(format_row(row, plan.total_steps))
        if s % spe == 0:
            record_monitor(r, s // spe, last=s == plan.total_steps)
        if r.stop.raised:
            save_checkpoint(r)
            raise Terminated(f"{signal_name(r.stop.signum)}: checkpoint written at step {s} to "
                             f"{r.ckpt.path}", signum=r.stop.signum)
        if r.policy.due(s):
            save_checkpoint(r)
        r.in_step = False


def record_monitor(r: Run, epoch: int, *, last: bool = False) -> None:
    """The monitor after ``epoch`` epochs, when due (rank 0): rows, and MLflow metrics.

    ``last``: the training's last epoch, always due.

    The kNN part (with labels) appends to ``knn_rows`` and logs ``monitor_knn_top1/5``; the
    label-free part to ``labelfree_rows``, logging ``labelfree_<number>``, with a warning when
    the encoder looks collapsed (:func:`pipeline.evaluate.verdict.collapse_reason`). Neither
    touches the training RNG or the weights (eval mode, forked RNG).
    """
    if not (r.rt.is_main and r.monitor.due(epoch, last=last)):
        return
    step = epoch * r.plan.steps_per_epoch
    backbone = r.net.encoder_q.backbone
    for part, rows, prefix in ((r.monitor.knn, r.state.knn_rows, "monitor_"),
                               (r.monitor.labelfree, r.state.labelfree_rows, "labelfree_")):
        if part is None:
            continue
        res = part(backbone)
        rows.append({"epoch": epoch, "step": step, **res})
        if r.tracking is not None:
            r.tracking.log_metrics({f"{prefix}{k}": v for k, v in res.items()}, step=step)
        if part is r.monitor.labelfree and (why := collapse_reason(
                res, r.monitor.max_rank(backbone.num_features))):
            log.warning("pretrain: the encoder looks collapsed after epoch %d: %s", epoch, why)


def pretrain(*, model: ModelParams, moco: MocoParams, opt: PretrainParams, augment: AugmentParams,
             seed: int, shards_dir: Path | ShardURL, encoder_path: Path,
             checkpoint_dir: Path, metrics_path: Path,
             plots_path: Path, knn_plots_path: Path, run: StageRun | None = None,
             max_steps: int | None = None, details_path: Path | None = None,
             pretrain_set: Manifest | None = None,
             resume_key: TrainingInput | None = None,
             abandoned: Callable[[], bool] | None = None) -> dict[str, float]:
    """Pretrain MoCo on the ``pretrain`` shards and export the query backbone.

    Args:
        model: backbone and head params.
        moco: queue/loss params (K, m, T, BN mode).
        opt: optimisation params (``pretrain`` section).
        augment: augmentation preset.
        seed: global seed (model init, data order, augmentation).
        shards_dir: directory (or URL) holding ``pretrain/``, ``train/``, ``test/`` shards.
        encoder_path: where the QUERY backbone ``state_dict`` is written (plain BatchNorm2d,
            no ``fc.*``); ``encoder.json`` beside it records the architecture and ``head.pt``
            the query projection head.
        checkpoint_dir: ``last.pt`` lives here (resume state, outside DVC's outputs; the
            stage's resume store entry, :func:`pipeline.train.resume_store.open_entry`).
        metrics_path: the headline of the final metrics (``metrics/pretrain.json``:
            :data:`pipeline.train.export.HEADLINE`).
        plots_path: per-logged-step TSV (``plots/pretrain.tsv``).
        knn_plots_path: kNN-monitor TSV per epoch (``plots/knn_monitor.tsv``).
        run: MLflow handle (rank 0) or None.
        max_steps: stop after this global step (tests simulate an interruption with it).
        details_path: every final metric (``eval/metrics/pretrain.json``); None = not written.
        pretrain_set: the pretraining set's manifest when it is more than
            ``shards_dir/pretrain`` (:func:`pipeline.data.index.pretrain_manifest`); None =
            that split alone.
        resume_key: the run's :func:`pipeline.train.training_input.training_input`, as the
            stage computed it to find ``checkpoint_dir``; None = computed here (with
            ``data.image_size`` 0: the manifest fixes the crop).
        abandoned: asked when the data fails between two steps; True = the workspace was
            abandoned and the failure is its consequence (DVC deleting a killed experiment's
            shards), so a checkpoint is written and :class:`Terminated` raised instead
            (:meth:`pipeline.train.resume_store.WorkspaceWatch.abandoned`). None = never.

    Returns:
        The final metrics (all of them; ``details_path`` holds them too).

    Raises:
        PlanError: sizes that do not fit the data or the processes (names the param).
        NonFiniteError: the loss, or a parameter or buffer to be saved, became NaN/inf (the
            last good checkpoint is kept).
        Terminated: SIGTERM or SIGINT was received, or ``abandoned`` said so (a checkpoint was
            written first).
        LoaderWorkerError: a DataLoader worker died (e.g. SIGKILL from the out-of-memory
            killer); the message names the signal and the checkpoint step to resume from.
    """
    with kept_threads():
        r = _build_run(model=model, moco=moco, opt=opt, augment=augment, seed=seed,
                       shards_dir=shards_dir, checkpoint_dir=checkpoint_dir, run=run,
                       pretrain_set=pretrain_set, resume_key=resume_key)
        stop_at = r.plan.total_steps if max_steps is None else min(max_steps,
                                                                    r.plan.total_steps)
        if r.state.step == 0 and not (r.state.knn_rows or r.state.labelfree_rows):
            record_monitor(r, 0)  # the random-init encoder: the curve's starting point
        with stop_on_signals(r.stop), r.bar:
            try:
                while r.state.step < stop_at:
                    train_one_epoch(r, r.state.step // r.plan.steps_per_epoch, stop_at)
            except Exception as e:
                died = worker_death(e)  # PyTorch's SIGCHLD handler raises at any line
                if died is not None:
                    raise worker_died(r, died) from None
                if r.in_step or abandoned is None or not abandoned():
                    raise
                save_checkpoint(r)
                raise Terminated(f"workspace abandoned: checkpoint written at step "
                                 f"{r.state.step} to {r.ckpt.path}") from None
        if r.state.step < r.plan.total_steps:  # stopped early by max_steps (tests)
            return {"step": float(r.state.step)}
        return _finish(r, model, encoder_path, (metrics_path, details_path), plots_path,
                       knn_plots_path)


def _build_run(*, model: ModelParams, moco: MocoParams, opt: PretrainParams,
               augment: AugmentParams, seed: int, shards_dir: Path | ShardURL,
               checkpoint_dir: Path, run: StageRun | None,
               pretrain_set: Manifest | None, resume_key: TrainingInput | None) -> Run:
    """Plan, build the model and optimizer, restore a fitting checkpoint, pick threads."""
    rt = setup_device()
    manifest = pretrain_set if pretrain_set is not None else read_manifest(shards_dir / "pretrain")
    parts = manifest.settings.get("parts")
    plan = plan_run(manifest, " + ".join(parts) if parts else shards_dir / "pretrain", opt=opt,
                    moco=moco, world_size=rt.world_size, cuda=rt.device.type == "cuda")
    spec = plan.spec
    configure_determinism(opt.deterministic, rt.device)
    torch.manual_seed(seed)
    net = build_moco(model, moco, in_channels=spec.channels, image_size=spec.size,
                     world_size=rt.world_size).to(rt.device)
    precision = Precision(resolve_precision(opt.precision, rt.device), rt.device)
    optimizer = torch.optim.SGD(net.trainable_parameters(), lr=0.0, momentum=opt.sgd_momentum,
                                weight_decay=opt.weight_decay)
    key = resume_key or training_input(
        Params(seed=seed, model=model, moco=moco, augment=augment, pretrain=opt), manifest,
        rt.world_size)
    ckpt = Checkpointer(Path(checkpoint_dir) / "last.pt", key, rt.is_main,
                        run_id=run.run_id if run is not None else None,
                        monitor={k: getattr(opt, k) for k in MONITOR_PARAMS})
    state = _restore(ckpt, net, optimizer, precision, rt=rt, total_steps=plan.total_steps)
    num_workers = resolve_num_workers(opt.num_workers, rt.device)
    state.num_threads = setup_threads(
        requested=opt.num_threads, resumed=state.num_threads, num_workers=num_workers,
        device=rt.device, probe_model=net.encoder_q,
        input_shape=(plan.per_rank_batch, spec.channels, spec.size, spec.size))
    channels_last = resolve_switch(opt.channels_last, cpu_default=False, device=rt.device)
    compile_ = resolve_compile(opt.compile, device=rt.device, width=model.width,
                               total_images=plan.total_steps * opt.batch_size)
    log.info("pretrain: %s, %s, threads %d, loader workers %d, channels_last %s, compile %s, "
             "%d steps", rt.device, precision.name, state.num_threads, num_workers,
             channels_last, compile_, plan.total_steps)
    view = build_batch_view(augment.preset, spec.size, spec.mean, spec.std,
                            augment.crop_min_scale, crop=not spec.variable)
    small_view = (build_batch_view(augment.preset, small_crop_side(augment, spec.size),
                                   spec.mean, spec.std, augment.small_crop_min_scale,
                                   crop_max_scale=augment.small_crop_max_scale).to(rt.device)
                  if augment.small_crops else None)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return Run(
        rt=rt, plan=plan, opt=opt, seed=seed, shards_dir=shards_dir, pretrain_set=manifest,
        net=net,
        ddp_net=wrap_model(net, rt, channels_last=channels_last, compile_=compile_),
        precision=precision, optimizer=optimizer, ckpt=ckpt, state=state,
        views=BatchTwoCrop(view.to(rt.device), fmt, small_view=small_view,
                           small_crops=augment.small_crops),
        crop=(SeededRandomResizedCrop(spec.size, scale=(augment.crop_min_scale, 1.0))
              if spec.variable else None),
        num_workers=num_workers,
        monitor=_build_monitor(shards_dir, spec=spec, augment=augment, opt=opt, rt=rt),
        policy=CheckpointPolicy(opt.checkpoint_every_epochs, opt.checkpoint_every_steps,
                                plan.total_steps, plan.steps_per_epoch),
        stop=StopFlag(),
        bar=tqdm(total=plan.total_steps, initial=state.step, desc="pretrain", unit="step",
                 disable=None if rt.is_main else True),
        tracking=run)


def _restore(ckpt: Checkpointer, net: MoCo, optimizer: torch.optim.Optimizer,
             precision: Precision, *, rt: Runtime, total_steps: int) -> TrainState:
    """Restore a fitting checkpoint; one line when it is a finished training, reused as it is.

    Raises:
        ValueError: the checkpoint's key was computed for another number of processes.
    """
    if ckpt.key.world_size != rt.world_size:
        raise InputError(f"resume_key was computed for {ckpt.key.world_size} "
                         f"processes, this run has {rt.world_size}")
    state = ckpt.restore(net, optimizer, precision.scaler)
    if state.step >= total_steps and rt.is_main:  # DVC reran a stage whose training is done
        log.warning("pretrain: %s is a finished training of this fingerprint (step %d of %d): "
                    "its weights are exported again, nothing is trained (to retrain: `python -m "
                    "pipeline clean-checkpoints`)", ckpt.path, state.step, total_steps)
    return state


def _finish(r: Run, model: ModelParams, encoder_path: Path,
            metrics_paths: tuple[Path, Path | None], plots_path: Path,
            knn_plots_path: Path) -> dict[str, float]:
    """Final metrics and the verdict; rank 0 exports; all ranks compare their queues.

    The verdict (:func:`pipeline.evaluate.verdict.verdict`; none without a label-free monitor):
    a log line, ``verdict_code``/``_epoch`` in the metrics, ``encoder.json``, an MLflow tag.

    ``queue_ranks_identical`` (several processes only: one has nothing to compare) is 1 when
    every rank's queue (keys, pointer, write steps) is bit-identical to the others', 0 with a
    warning when not (the keys must be gathered from all ranks before the enqueue).
    """
    metrics = final_metrics(r.state, total_steps=r.plan.total_steps, epochs=r.opt.epochs,
                            wall_s=r.ckpt.wall_time(r.state), device=r.rt.device,
                            world_size=r.rt.world_size)
    if r.rt.world_size > 1:
        same = ranks_identical(*r.net.queue.buffers())
        metrics["queue_ranks_identical"] = int(same)
        if not same and r.rt.is_main:
            log.warning("pretrain: the key queues differ across the %d ranks after training "
                        "(eval/metrics/pretrain.json queue_ranks_identical 0)", r.rt.world_size)
    metrics["pretrain_images"] = r.pretrain_set.num_samples
    metrics["broken_images_skipped"] = r.pretrain_set.num_broken or 0
    judged = (r.monitor.verdict(r.state.labelfree_rows, r.net.encoder_q.backbone.num_features)
              if r.rt.is_main else None)
    if judged is not None:
        metrics.update(judged.metrics())
        log.info("pretrain verdict: %s (%s)", judged.text, judged.why)
    elif r.rt.is_main:
        log.info("pretrain verdict: none (%s)", r.monitor.no_verdict())
    if r.rt.is_main:
        export_outputs(r.net, model, in_channels=r.plan.spec.channels,
                       image_size=r.plan.spec.size, state=r.state, metrics=metrics,
                       encoder_path=encoder_path, metrics_path=metrics_paths[0],
                       details_path=metrics_paths[1], plots_path=plots_path,
                       knn_plots_path=knn_plots_path,
                       verdict=judged.text if judged is not None else None)
        if r.tracking is not None:
            r.tracking.log_metrics({f"final_{k}": v for k, v in metrics.items()})
            r.tracking.record["ran"] = how_it_ran(r)  # runs/pretrain.json: the report reads it
            if judged is not None:
                r.tracking.set_tags({VERDICT_TAG: judged.text})
    if r.rt.world_size > 1:
        dist.barrier()
    return metrics


def how_it_ran(r: Run) -> dict[str, Any]:
    """How this training ran, as ``runs/pretrain.json`` records it under ``ran``.

    Returns:
        ``precision`` (``fp32`` / ``bf16`` / ``fp16``: what autocast ran, not the param),
        ``num_threads``, ``processes`` (world size), ``device`` (``cpu`` / ``cuda``),
        ``finished_utc`` (``YYYY-MM-DD HH:MM:SS``) and :func:`describe_machine`'s fields.
    """
    from datetime import datetime, timezone

    return {"precision": r.precision.name, "num_threads": r.state.num_threads,
            "processes": r.rt.world_size, "device": r.rt.device.type,
            "finished_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            **describe_machine()}


def _build_monitor(shards_dir: Path | ShardURL, *, spec: Any, augment: AugmentParams,
                   opt: PretrainParams, rt: Runtime) -> Monitor:
    """The monitor of this run: kNN with labelled images, label-free numbers on pretraining ones.

    Built on rank 0 only (the others never run it). The label-free sample is the first
    ``pretrain.labelfree_images`` of the built ``pretrain`` split; without built pretraining
    images (only shards read in place) the label-free part is off, with a log line.
    """
    if not rt.is_main or not opt.knn_every_epochs:
        return Monitor(0, labelfree_off="pretrain.knn_every_epochs is 0: no monitor")
    knn = (KnnMonitor(shards_dir, transform=build_eval_transform(spec.size, spec.mean, spec.std),
                      device=rt.device, n_train=opt.knn_monitor_train_images,
                      n_test=opt.knn_monitor_test_images)
           if _labelled(shards_dir) else None)
    labelfree, off = None, "pretrain.labelfree_images is 0: no label-free numbers"
    if opt.labelfree_images:
        if read_manifest(shards_dir / "pretrain").num_samples:
            labelfree = LabelFreeProbe(shards_dir / "pretrain", image_size=spec.size,
                                       mean=spec.mean, std=spec.std, preset=augment.preset,
                                       crop_min_scale=augment.crop_min_scale, device=rt.device,
                                       n=opt.labelfree_images)
        else:
            off = "no built pretraining images (only shards read in place)"
            log.info("label-free monitor off: %s", off)
    return Monitor(opt.knn_every_epochs, knn=knn, labelfree=labelfree, labelfree_off=off)


def _labelled(shards_dir: Path | ShardURL) -> bool:
    """Whether the train and test splits hold images (the kNN monitor needs both)."""
    why = missing_labels(shards_dir)
    if why is not None:
        log.info("kNN monitor off: %s", why)
    return why is None


__all__ = ["NonFiniteLossError", "Run", "pretrain", "train_one_epoch", "train_step"]
