"""The report's provenance sections: what each stage cost, its MLflow run, its DVC outputs."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping

from pipeline.report.document import NOT_AVAILABLE, Block, Paragraph, Section, Table, fmt
from pipeline.report.inputs import Metrics, RunOutputs, metric

COST_STAGES = ("pretrain", "data_insights", "embed", "baselines", "knn", "linear",
               "label_efficiency")


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
        d = m[stage]
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
    """The output hashes recorded in ``dvc.lock``."""
    if outputs.dvc_lock is None:
        return Section("DVC outputs", [Paragraph(f"dvc.lock: {NOT_AVAILABLE}.")])
    return Section(
        "DVC outputs",
        [
            Paragraph("Output hashes recorded in dvc.lock (md5; '.dir' = a directory listing)."),
            Table(["stage", "output", "md5"], [[r.stage, r.path, r.md5] for r in outputs.dvc_lock]),
        ],
    )
