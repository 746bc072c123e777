"""The report's provenance: when, from which code, on which machines the numbers were made.

Also what each stage cost, its MLflow run and its DVC outputs.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping

from pipeline.report.document import NOT_AVAILABLE, Block, Paragraph, Section, Table, fmt
from pipeline.report.inputs import Metrics, RunOutputs, metric

REPORT_STAGE = "report"  # the stage that writes this report (its dvc.lock entry is stale here)
COST_STAGES = ("pretrain", "data_insights", "embed", "baselines", "knn", "linear",
               "label_efficiency", "select_labels")


def redact_uri(uri: str) -> str:
    """A tracking URI without user name / password."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return uri


# --------------------------------------------------------------------------- settings, results


def _cost_notes(m: Mapping[str, Metrics | None]) -> dict[str, str]:
    pre, knn, lin = m["pretrain"], m["knn"], m["linear"]
    wait, peak, world = (metric(pre, k) for k in
                         ("data_wait_fraction", "peak_memory_bytes", "world_size"))
    pre_notes = [
        f"data wait {100 * wait:.1f} %" if wait is not None else "",
        f"peak memory {peak / 2**20:.0f} MiB" if peak is not None else "",
        f"{world:.0f} process(es)" if world is not None else "",
    ]
    n_train, n_test = metric(knn, "num_train"), metric(knn, "num_test")
    batch, lr_eff = metric(lin, "batch_size"), metric(lin, "lr_effective")
    return {
        "pretrain": ", ".join(x for x in pre_notes if x),
        "knn": (f"{n_train:.0f} train / {n_test:.0f} test"
                if n_train is not None and n_test is not None else ""),
        "linear": (f"batch {batch:.0f}, effective lr {lr_eff:g}"
                   if batch is not None and lr_eff is not None else ""),
    }


def cost_section(m: Mapping[str, Metrics | None]) -> Section:
    """Wall time and throughput per stage, with the total of the available wall times."""
    notes = _cost_notes(m)
    rows, total = [], 0.0
    for stage in COST_STAGES:
        d = m.get(stage)
        wall = metric(d, "wall_time_s")
        total += wall or 0.0
        ips = metric(d, "images_per_s")
        rows.append([
            stage,
            fmt(wall, ".1f"),
            "" if d and ips is None else fmt(ips, ".1f"),
            notes.get(stage, "") if d else NOT_AVAILABLE,
        ])
    rows.append(["total (available)", f"{total:.1f}", "", ""])
    return Section(
        "Throughput and wall time", [Table(["stage", "wall time (s)", "images / s", "notes"], rows)]
    )


def runs_section(outputs: RunOutputs) -> Section:
    """The MLflow run of every tracked stage, the (redacted) tracking URIs, the UI's runs table."""
    from pipeline.tracking import ui_url

    rows, uris, ui = [], [], []
    for stage, run in outputs.runs.items():
        if run is None:
            rows.append([stage, NOT_AVAILABLE, ""])
            continue
        rows.append([stage, run.run_id or "not logged (MLflow disabled)", run.experiment_id])
        if run.tracking_uri and redact_uri(run.tracking_uri) not in uris:
            uris.append(redact_uri(run.tracking_uri))
        if run.run_id and run.tracking_uri and not ui:
            ui.append(ui_url(run.tracking_uri, run.experiment_id or None))
    blocks: list[Block] = [
        Table(["stage", "MLflow run id", "experiment id"], rows),
        Paragraph("Tracking URI: " + (", ".join(uris) if uris else NOT_AVAILABLE) + "."),
    ]
    if ui:  # with a database: the UI that `make ui` starts
        blocks.append(Paragraph("The runs table in the MLflow UI (`make ui` for a database):",
                                href=ui[0]))
    return Section("MLflow runs", blocks)


def lock_section(outputs: RunOutputs) -> Section:
    """The output hashes recorded in ``dvc.lock``, less the report stage's own.

    Under ``dvc repro`` each upstream stage's entry is written when that stage finishes, so it
    holds this run's hashes; the report stage's own entry is written after this page (while
    it runs it is the previous run's), so its rows are left out and a note says so.
    """
    if outputs.dvc_lock is None:
        return Section("DVC outputs", [Paragraph(f"dvc.lock: {NOT_AVAILABLE}.")])
    own = [r.path for r in outputs.dvc_lock if r.stage == REPORT_STAGE]
    rows = [[r.stage, r.path, r.md5] for r in outputs.dvc_lock if r.stage != REPORT_STAGE]
    blocks: list[Block] = [
        Paragraph("Output hashes recorded in dvc.lock as each stage finished (md5; '.dir' = a "
                  "directory listing)."),
        Table(["stage", "output", "md5"], rows),
    ]
    if own:
        blocks.append(Paragraph(f"Left out: the {REPORT_STAGE} stage's own outputs "
                                f"({', '.join(own)}), whose dvc.lock entry DVC writes after "
                                "this page; until then it is the previous run's."))
    return Section("DVC outputs", blocks)


# --------------------------------------------------------------------------- provenance


def report_time() -> str:
    """When the report is written, ``YYYY-MM-DD HH:MM:SS UTC``.

    ``SOURCE_DATE_EPOCH`` (seconds, the reproducible-builds convention) replaces the clock when
    set, so the same inputs can give the same bytes.
    """
    from datetime import datetime, timezone

    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = (datetime.fromtimestamp(int(epoch), timezone.utc) if epoch
            else datetime.now(timezone.utc))
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _code(git_commit: str | None, git_dirty: str | None) -> str:
    """The code in words: commit and whether tracked files differ from it."""
    dirty = {"true": "dirty: tracked files differ from it", "false": "clean"}.get(
        git_dirty or "", f"dirty flag {NOT_AVAILABLE}")
    return f"git commit {git_commit or NOT_AVAILABLE} ({dirty})"


def provenance_section(outputs: RunOutputs, *, written: str, here: Mapping[str, str],
                       git_commit: str | None, git_dirty: str | None) -> Section:
    """When, from which code, on which machines and libraries the numbers were made.

    Two columns: the pretraining (what ``runs/pretrain.json`` recorded under ``ran``:
    :func:`pipeline.train.engine.how_it_ran`) and this report's own process.

    Args:
        outputs: the run's outputs (``runs["pretrain"].ran``).
        written: when this report is written (:func:`report_time`).
        here: this process's machine and libraries
            (:func:`pipeline.train.runtime.describe_machine`).
        git_commit: the code's commit (None: not known).
        git_dirty: ``"true"`` / ``"false"`` (:func:`pipeline.tracking.git_state`), else unknown.

    Returns:
        The "Provenance" section.
    """
    from pipeline.train.runtime import LIBRARIES

    record = outputs.runs.get("pretrain")
    ran = dict(record.ran) if record is not None else {}
    missing = (f"{NOT_AVAILABLE} (runs/pretrain.json records no 'ran')" if record is not None
               else f"{NOT_AVAILABLE} (runs/pretrain.json)")

    def got(key: str) -> str:
        return str(ran[key]) if key in ran else missing

    how = (f"{ran['device']}, {ran['precision']}, {ran['num_threads']} thread(s) x "
           f"{ran['processes']} process(es)"
           if all(k in ran for k in ("device", "precision", "num_threads", "processes"))
           else missing)
    rows = [["date", f"{got('finished_utc')} UTC" if "finished_utc" in ran else missing,
             written],
            ["ran as (device, precision, threads)", how, ""],
            ["CPU", got("cpu"), here.get("cpu", NOT_AVAILABLE)],
            ["GPU", got("gpu"), here.get("gpu", NOT_AVAILABLE)],
            *[[lib, got(lib), here.get(lib, NOT_AVAILABLE)] for lib in LIBRARIES]]
    return Section("Provenance", [
        Paragraph(f"Code: {_code(git_commit, git_dirty)}."),
        Table(["", "pretraining (ended)", "this report (written)"], rows),
    ])
