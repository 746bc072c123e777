"""build_report end to end: the files it writes and what they say (HTML + its Markdown twin)."""

import json
import os
import re

import pytest
from reporthelpers import KNN, make_run, md_row, md_section, write_json, write_shards

from pipeline.config import from_dict
from pipeline.report.build import build_report
from pipeline.report.check import check_html
from pipeline.report.sections import NOT_AVAILABLE

FIGURES = {
    "pretrain_curves",
    "instance_accuracy",
    "queue_age",
    "throughput",
    "knn_monitor",
    "labelfree",
    "label_efficiency",
    "duplicates",
    "outliers",
    "linear_curves",
    "confusion_knn",
    "confusion_linear",
    "per_class_accuracy",
    "tsne",
    "retrieval",
}


def test_build_report__writes_html_md_and_figures(full_report):
    root, report = full_report
    out = root / "reports"
    assert (report.html, report.markdown) == (out / "report.html", out / "report.md")
    assert report.markdown.is_file()
    assert {p.stem for p in (out / "figures").glob("*.png")} == FIGURES
    assert check_html(report.html) == []
    html = report.html.read_text()
    assert html.count('<img src="data:image/png;base64,') == len(FIGURES)
    assert "<script" not in html  # self-contained and inert
    md = report.markdown.read_text()
    links = re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", md)
    assert sorted(links) == sorted(f"figures/{n}.png" for n in FIGURES)
    assert all((out / link).is_file() for link in links)
    assert [p.name for p in root.iterdir() if p.name.startswith(".reports")] == []


def test_build_report__html_and_markdown_are_twins(full_report):
    root, report = full_report
    html, md = report.html.read_text(), report.markdown.read_text()
    titles = re.findall(r"^## (.+)$", md, flags=re.M)
    assert re.findall(r"<h2>(.+?)</h2>", html) == titles
    assert titles == ["Settings", "Results", "Pretraining", "Quality without labels",
                      "Evaluation", "Label efficiency",
                      "What the embeddings say about the data", "Which images to label",
                      "Embeddings", "Throughput and wall time", "MLflow runs", "DVC outputs",
                      "Provenance"]
    md_rows = [ln for ln in md.splitlines() if ln.startswith("| ")]  # header rows included
    assert html.count("<tr>") == len(md_rows)
    assert md.count("\n|---") == html.count("<table>")


def test_build_report__final_metrics(full_report):
    _, report = full_report
    assert report.final_metrics["knn.top1"] == 71.23
    assert report.final_metrics["pretrain.loss"] == 5.4321


def test_build_report__results_table_has_exact_numbers(full_report):
    root, report = full_report
    md = report.markdown.read_text()
    # PARAMS keep embed's defaults: layer3 pooled to 4 x 4 cells, for MoCo and the random encoder
    assert md_row(md, "MoCo encoder + kNN")[1:] == ["layer3, 4 x 4 cells", "k=20, T=0.1",
                                                    "71.23", "99.50"]
    assert md_row(md, "MoCo encoder + linear probe")[3:] == ["73.87", "100.00"]
    assert md_row(md, "raw pixels (baseline)", "pixels | kNN, k=200")[3:] == ["62.41", "97.00"]
    tuned = md_row(md, "raw pixels (baseline)", "pixels | kNN, k=5, T=0.05 (chosen on a valid")
    assert tuned[3:] == ["66.10", "97.50"]
    assert md_row(md, "raw pixels (baseline)", "pixels | linear probe")[3:] == ["70.02", "99.00"]
    assert md_row(md, "random-init encoder (baseline)")[1:] == [
        "layer3, 4 x 4 cells", "kNN, k=200, T=0.1", "48.09", "90.50"]
    # headline against the BEST raw-pixel baseline of each protocol: kNN max(62.41, 66.10)
    assert ("kNN: MoCo 71.23 % beats the best raw-pixel kNN 66.10 % (+5.13 points)"  # 71.23-66.10
            in md)
    assert "linear: MoCo 73.87 % beats the best raw-pixel linear 70.02 % (+3.85 points)" in md
    assert "kNN +5.13 points vs the best raw-pixel kNN" in md
    # 71.23 - 48.09: same features, but MoCo's kNN ran at k=20 (KNN), the random one at k=200
    assert ("kNN +23.14 points vs the random encoder's kNN (same features; k=200, T=0.1 "
            "against MoCo's k=20, T=0.1)") in md
    assert md.index("Headline") < md.index("| MoCo encoder + kNN")  # above the table
    assert "Fashion-MNIST" in md
    html = report.html.read_text()
    for v in ("71.23", "73.87", "62.41", "48.09"):
        assert f'<td class="num">{v}</td>' in html


def test_build_report__knn_monitor_against_its_own_epoch_zero(full_report):
    root, report = full_report
    md = report.markdown.read_text()
    pre = md_section(md, "Pretraining")
    # plots/knn_monitor.tsv of the tiny run: epoch 0 40.25, last 66.5 (metrics say the same)
    assert md_row(pre, "kNN monitor top-1 at init -> end (%)")[1] == "40.25 -> 66.50"
    caption = next(ln for ln in pre.splitlines() if ln.startswith("*kNN top-1 of the monitor"))
    # 10,000 / 2,000 monitor images asked for; the train shards have no manifest (size not
    # known), the test split has 24 images
    assert ("(k=200 capped at the bank, T=0.1, global average pool of the last stage; bank = "
            "the first 10,000 labelled train images (at most), queries = the first 24 test "
            "images;") in caption
    assert "the last point is +26.25 points from it" in caption  # 66.5 - 40.25
    assert "48.09" not in pre and "62.41" not in pre  # the baselines: other features, all images


def test_build_report__provenance_sections(full_report):
    root, report = full_report
    md = report.markdown.read_text()
    runs = md_section(md, "MLflow runs")
    assert md_row(runs, "pretrain") == ["pretrain", "run01abc", "7"]
    assert md_row(runs, "embed")[1] == "not logged (MLflow disabled)"
    assert "https://***@mlflow.example.org" in runs
    assert "s3cret" not in md and "s3cret" not in report.html.read_text()
    lock = md_section(md, "DVC outputs")
    assert "| build_shards | data/shards | aaaabbbbccccddddeeeeffff00001111.dir |" in lock
    assert "| pretrain | models/encoder.pt | 99998888777766665555444433332222 |" in lock
    # the report stage's own entry is the previous run's while it runs: left out, said so
    assert "0000111122223333444455556666777" not in lock and "| report |" not in lock
    assert "Left out: the report stage's own outputs (reports, runs/report.json)" in lock
    assert "git commit abc1234" in md
    cost = md_section(md, "Throughput and wall time")
    assert md_row(cost, "pretrain")[1:3] == ["31.5", "812.5"]
    assert md_row(cost, "embed")[1:3] == ["1.5", "2000.0"]
    assert md_row(cost, "data_insights")[1:3] == ["4.0", ""]
    # total of the six metrics files' wall times: 31.5 + 4.0 + 1.5 + 0.5 + 2.5 = 40.0
    assert md_row(cost, "total (available)")[1] == "40.0"


def test_build_report__provenance_says_when_what_code_which_machine(tmp_path, monkeypatch):
    import platform

    import torch
    import torchvision

    root = make_run(tmp_path / "run")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(365 * 86400 + 3661))  # 1971-01-01 01:01:01
    report = build_report(params=from_dict({"report": {"tsne_points": 0}}), root=root,
                          out_dir=root / "reports", git_commit="abc1234", git_dirty="true")
    md = report.markdown.read_text()
    prov = md_section(md, "Provenance")
    assert "Code: git commit abc1234 (dirty: tracked files differ from it)." in prov
    # RAN of reporthelpers: what the tiny run's pretraining recorded of its process
    assert md_row(prov, "date") == ["date", "2026-12-01 08:09:10 UTC", "1971-01-01 01:01:01 UTC"]
    assert md_row(prov, "ran as (device, precision, threads)")[1] == (
        "cuda, bf16, 3 thread(s) x 2 process(es)")
    assert md_row(prov, "GPU")[1] == "2 x Test GPU"
    assert md_row(prov, "torch") == ["torch", "9.1.0", torch.__version__]
    assert md_row(prov, "torchvision")[2] == torchvision.__version__
    with open("/proc/cpuinfo") as f:  # this machine's CPU model, read here independently
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                     platform.processor())
    assert md_row(prov, "CPU")[1:] == ["Test CPU 9000, 3 of 8 cores",
                                       f"{model}, {len(os.sched_getaffinity(0))} of "
                                       f"{os.cpu_count()} cores"]
    gpu = md_row(prov, "GPU")[2]
    assert (torch.cuda.get_device_name(0) in gpu if torch.cuda.is_available() else gpu == "none")
    # the setting and what ran: auto resolved to bf16 on that machine
    assert "precision auto (ran as bf16)" in md_section(md, "Settings")


def test_build_report__provenance_without_a_recorded_process(tmp_path):
    root = make_run(tmp_path / "run")
    write_json(root / "runs/pretrain.json", {"stage": "pretrain", "run_id": None})  # older run
    report = build_report(params=from_dict({"report": {"tsne_points": 0}}), root=root,
                          out_dir=root / "reports")
    prov = md_section(report.markdown.read_text(), "Provenance")
    assert "Code: git commit not available (dirty flag not available)." in prov
    assert md_row(prov, "torch")[1] == "not available (runs/pretrain.json records no 'ran')"
    assert "precision auto |" in report.markdown.read_text()  # nothing claimed about what ran


def test_build_report__missing_inputs_say_not_available(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    report = build_report(params=from_dict({}), root=root, out_dir=tmp_path / "out")
    md = report.markdown.read_text()
    assert md_row(md, "MoCo encoder + kNN")[3:] == [NOT_AVAILABLE, NOT_AVAILABLE]
    assert md_row(md, "raw pixels (baseline)")[3:] == [NOT_AVAILABLE, NOT_AVAILABLE]
    assert "dvc.lock: not available." in md
    assert "t-SNE: not available" in md
    assert check_html(report.html) == []
    assert '<td class="na">not available</td>' in report.html.read_text()
    assert list((tmp_path / "out/figures").iterdir()) == []
    assert report.final_metrics == {}


def test_build_report__one_metrics_file_missing(tmp_path):
    root = make_run(tmp_path / "run")
    (root / "eval/metrics/knn.json").unlink()
    (root / "eval/knn_details.json").unlink()
    params = from_dict({"report": {"tsne_points": 0, "retrieval_queries": 0}})
    report = build_report(params=params, root=root, out_dir=root / "reports")
    md = report.markdown.read_text()
    assert md_row(md, "MoCo encoder + kNN")[3:] == [NOT_AVAILABLE, NOT_AVAILABLE]
    assert md_row(md, "MoCo encoder + linear probe")[3:] == ["73.87", "100.00"]
    assert "kNN confusion matrix: not available" in md
    assert (root / "reports/figures/confusion_linear.png").is_file()
    assert "t-SNE: skipped (report.tsne_points = 0" in md
    assert "Retrieval: skipped (report.retrieval_queries = 0)." in md


def test_build_report__replaces_previous_report(tmp_path):
    out = tmp_path / "reports"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    build_report(params=from_dict({}), root=tmp_path, out_dir=out)
    assert not (out / "stale.txt").exists()
    assert (out / "report.html").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reports"]


def test_build_report__broken_figure_keeps_previous_report(tmp_path, monkeypatch):
    out = tmp_path / "reports"
    out.mkdir()
    (out / "report.html").write_text("previous")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots/linear.tsv").write_text("epoch\tloss\n1\t2\n")
    import pipeline.report.figures as fg

    def empty_png(table, path):  # a figure function that writes a file that is not a PNG
        path.write_bytes(b"")
        return path

    monkeypatch.setattr(fg, "plot_linear_curves", empty_png)
    with pytest.raises(RuntimeError, match="img #1: data URI is empty"):
        build_report(params=from_dict({}), root=tmp_path, out_dir=out)
    assert (out / "report.html").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots", "reports"]


def test_build_report__same_inputs_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the date written: fixed
    root = tmp_path / "empty"
    root.mkdir()
    (root / "eval/metrics").mkdir(parents=True)
    (root / "eval/metrics/knn.json").write_text(json.dumps(KNN))
    a = build_report(params=from_dict({}), root=root, out_dir=tmp_path / "a")
    b = build_report(params=from_dict({}), root=root, out_dir=tmp_path / "b")
    assert a.html.read_bytes() == b.html.read_bytes()
    assert a.markdown.read_bytes() == b.markdown.read_bytes()



def test_build_report__hostile_inputs_shown_as_text(tmp_path):
    root = make_run(tmp_path / "run")
    evil = '<img src=x onerror="alert(1)">'
    write_json(root / "runs/knn.json", {"run_id": evil, "experiment_id": "<b>7</b>|x"})
    lock = (root / "dvc.lock").read_text().replace("models/encoder.pt", f"models/{evil}.pt")
    (root / "dvc.lock").write_text(lock)
    params = from_dict({"data": {"source": "imagefolder", "root": f"/data/<script>{evil}"},
                        "report": {"tsne_points": 0, "retrieval_queries": 0}})
    report = build_report(params=params, root=root, out_dir=root / "reports")
    html = report.html.read_text()
    assert "<script" not in html and "onerror=" not in html.replace("onerror=&#34;", "")
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in html
    assert check_html(report.html) == []  # no image smuggled in: all 13 are the real figures
    assert html.count("<img ") == 13
    md = report.markdown.read_text()
    runs = md_section(md, "MLflow runs")
    assert '| knn | &lt;img src=x onerror="alert(1)"> | &lt;b>7&lt;/b>\\|x |' in runs
    assert "<script" not in md and "<img" not in md


def test_build_report__knn_monitor_k_capped_at_a_small_bank(tmp_path):
    # a 60-image train split under a 10,000-image monitor cap: the bank is 60, so k = 60
    root = make_run(tmp_path / "run")
    keys = [f"train{i:05d}" for i in range(60)]
    write_shards(root / "data/shards/train", keys, [i % 3 for i in range(60)], 30, manifest=True)
    report = build_report(params=from_dict({"report": {"tsne_points": 0}}), root=root,
                          out_dir=root / "reports")
    pre = md_section(report.markdown.read_text(), "Pretraining")
    assert ("(k=60 (200 capped at the bank), T=0.1, global average pool of the last stage; "
            "bank = the first 60 labelled train images, queries = the first 24 test images;"
            ) in pre
