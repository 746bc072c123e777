import pytest
from reporthelpers import PARAMS, make_run

from pipeline.config import from_dict
from pipeline.report.inputs import Metrics, read_outputs
from pipeline.report.provenance import cost_section, redact_uri
from pipeline.report.results import results_section
from pipeline.report.sections import (
    NOT_AVAILABLE,
    FigureRef,
    Paragraph,
    Table,
    build_document,
    settings_section,
)


def _metrics(**stages):
    names = ("pretrain", "data_insights", "embed", "baselines", "knn", "linear",
             "label_efficiency")
    return {s: Metrics(stages[s]) if s in stages else None for s in names}


def test_build_document__sections_and_figures(tmp_path):
    root = make_run(tmp_path / "run")
    fig_dir = tmp_path / "figs"
    fig_dir.mkdir()
    params = from_dict({**PARAMS, "report": {"tsne_points": 0, "retrieval_queries": 0}})
    doc = build_document(params, read_outputs(root, "data/shards"), fig_dir, "c0ffee")
    assert [s.title for s in doc.sections] == [
        "Settings", "Results", "Pretraining", "Quality without labels", "Evaluation",
        "Label efficiency", "What the embeddings say about the data", "Which images to label",
        "Embeddings", "Throughput and wall time", "MLflow runs", "DVC outputs", "Provenance",
    ]
    assert doc.title == "MoCo report: fashion_mnist / resnet18"
    assert doc.subtitle.endswith("git commit c0ffee.")
    refs = [b.name for s in doc.sections for b in s.blocks if isinstance(b, FigureRef)]
    assert sorted(refs) == sorted(p.name for p in fig_dir.iterdir())
    assert len(refs) == 13  # all but t-SNE and retrieval
    assert doc.sections[9].anchor == "throughput-and-wall-time"
    assert doc.sections[7].blocks == [Paragraph(
        "Which images to label: not available (eval/selection.json).")]
    assert doc.sections[8].blocks[0] == Paragraph(
        "t-SNE: skipped (report.tsne_points = 0, 24 test embeddings; at least 10 needed)."
    )


def test_build_document__no_labels__says_why_and_keeps_what_needs_none(tmp_path):
    # check_eval found no labelled images: the results say why, the evaluation sections that
    # need labels are left out, the label-free and data sections stay
    from pipeline.atomic import write_json

    root = make_run(tmp_path / "run")
    why = "no labelled train or test images (data.source none)"
    write_json(root / "runs/check_eval.json", {"stage": "check_eval", "run_id": None,
                                               "labelled": False, "skipped": why})
    fig_dir = tmp_path / "figs"
    fig_dir.mkdir()
    params = from_dict({**PARAMS, "report": {"tsne_points": 0, "retrieval_queries": 0}})
    doc = build_document(params, read_outputs(root, "data/shards"), fig_dir, "c0ffee")
    assert [s.title for s in doc.sections] == [
        "Settings", "Results", "Pretraining", "Quality without labels",
        "What the embeddings say about the data", "Which images to label",
        "Throughput and wall time", "MLflow runs", "DVC outputs", "Provenance",
    ]
    text = doc.sections[1].blocks[0].text
    assert text.startswith(f"Evaluation with labels skipped: {why}.")


def test_results_section__published_reference_row_and_distance():
    p = from_dict({"data": {"source": "cifar10"}, "pretrain": {"epochs": 200}})
    m = _metrics(knn={"top1": 80.1, "top5": 99.0, "k": 200.0, "T": 0.1},
                 baselines={"raw_pixels_top1": 40.0})
    sec = results_section(p, m)
    assert sec.blocks[0] == Paragraph(  # linear has no number: only the kNN half
        "Headline — kNN: MoCo 80.10 % beats the best raw-pixel kNN 40.00 % (+40.10 points).")
    table = sec.blocks[1]
    assert isinstance(table, Table)
    assert table.rows[0] == ["MoCo encoder + kNN", "layer3, 4 x 4 cells", "k=200, T=0.1",
                             "80.10", "99.00"]
    assert table.rows[-1] == ["published (200 epochs)", "last stage, global pool", "kNN",
                              "82.60", NOT_AVAILABLE]
    texts = [b.text for b in sec.blocks if isinstance(b, Paragraph)]
    assert "Top-1 gains: kNN +40.10 points vs the best raw-pixel kNN." in texts
    # no MoCo-protocol number: ours is on other features than the published one, and says so
    assert texts[-1] == ("This run's kNN top-1 on its own features (layer3, 4 x 4 cells; "
                         "published: last stage, global pool) is -2.50 points from the "
                         "published number.")
    m["knn"] = Metrics({**m["knn"].values, "protocol_top1": 81.6})
    texts = [b.text for b in results_section(p, m).blocks if isinstance(b, Paragraph)]
    assert texts[-1] == ("This run's kNN top-1 in the MoCo protocol (last stage, global pool, "
                         "as published) is -1.00 points from the published number.")


def test_cost_section__notes_and_total():
    m = _metrics(
        pretrain={"wall_time_s": 10.0, "images_per_s": 5.0, "data_wait_fraction": 0.25,
                  "peak_memory_bytes": 3 * 2**20, "world_size": 2},
        knn={"wall_time_s": 0.5, "num_train": 60, "num_test": 24},
        linear={},
        label_efficiency={"wall_time_s": 2.0, "draws": 5},
    )
    rows = cost_section(m).blocks[0].rows
    assert rows[0] == ["pretrain", "10.0", "5.0",
                       "data wait 25.0 %, peak memory 3 MiB, 2 process(es)"]
    assert rows[1] == ["data_insights", NOT_AVAILABLE, NOT_AVAILABLE, NOT_AVAILABLE]
    assert rows[2] == ["embed", NOT_AVAILABLE, NOT_AVAILABLE, NOT_AVAILABLE]
    assert rows[4] == ["knn", "0.5", "", "60 train / 24 test"]
    assert rows[5] == ["linear", NOT_AVAILABLE, "", ""]  # file present, no numbers
    assert rows[6] == ["label_efficiency", "2.0", "", ""]
    assert rows[-1] == ["total (available)", "12.5", "", ""]


def test_redact_uri__credentials_removed():
    assert redact_uri("https://alice:s3cret@host.org:5000/x") == "https://***@host.org:5000/x"
    assert redact_uri("sqlite:///repo/mlflow.db") == "sqlite:///repo/mlflow.db"


def test_results_section__gains_compare_same_protocol_only():
    # the random encoder is only kNN-scored: MoCo's linear probe is never set against it
    p = from_dict({})
    m = _metrics(knn={"top1": 83.0, "top5": 98.0, "k": 10.0, "T": 0.1},
                 linear={"top1": 84.5, "top5": 99.0},
                 baselines={"raw_pixels_top1": 81.0, "raw_pixels_knn_tuned_top1": 87.5,
                            "raw_pixels_linear_top1": 83.75, "random_encoder_top1": 70.25})
    texts = [b.text for b in results_section(p, m).blocks if isinstance(b, Paragraph)]
    assert ("Top-1 gains: kNN -4.50 points vs the best raw-pixel kNN; kNN +12.75 points vs the "
            "random encoder's kNN (same features; k=200, T=0.1 against MoCo's k=10, T=0.1); "
            "linear +0.75 points vs the best raw-pixel linear.") in texts


@pytest.mark.parametrize("params, knn, said", [
    ({}, {"k": 200.0, "T": 0.1}, "same features and kNN"),
    ({"embed": {"use_head": True, "layer": 4, "pool_grid": 1}}, {"k": 200.0, "T": 0.1},
     "features last stage, global pool against MoCo's projection head"),
    ({"embed": {"layer": 4, "pool_grid": 1}}, {"k": 20.0, "T": 0.02},
     "same features; k=200, T=0.1 against MoCo's k=20, T=0.02"),
])
def test_results_section__random_encoder_gain_says_what_differs(params, knn, said):
    m = _metrics(knn={"top1": 80.0, **knn}, baselines={"random_encoder_top1": 70.0})
    texts = [b.text for b in results_section(from_dict(params), m).blocks
             if isinstance(b, Paragraph)]
    assert f"kNN +10.00 points vs the random encoder's kNN ({said})." in texts[-2]


def test_settings_section__knn_row_says_how_k_and_T_were_set():
    def knn_row(knn):
        rows = settings_section(from_dict({"knn": knn})).blocks[0].rows
        return next(r for r in rows if r[0] == "kNN")[1]

    assert knn_row({"select": "fixed", "k": 20, "T": 0.05}) == "k=20, T=0.05"
    # with select = val the params' k and T are not used: the row must not quote them
    assert knn_row({"select": "val", "k": 20, "T": 0.05}) == (
        "k and T chosen on 10 % of train (grid k 1-200, T 0.02-1)")


def test_settings_section__features_row_names_the_pooled_stage():
    def row(embed):
        rows = settings_section(from_dict({"embed": embed})).blocks[0].rows
        return next(r for r in rows if r[0] == "features")[1]

    assert row({"layer": 3, "pool_grid": 4}) == (
        "backbone (pre-head), layer3 average-pooled to 4 x 4 cells, flattened")
    assert row({"layer": 4, "pool_grid": 2}) == (
        "backbone (pre-head), last stage average-pooled to 2 x 2 cells, flattened")
    assert row({"layer": 4, "pool_grid": 1}) == "backbone (pre-head), global average pool"
    assert row({"layer": 3, "pool_grid": 1}) == (
        "backbone (pre-head), global average pool of layer3")


def test_runs_section__links_the_ui_runs_table_without_credentials(tmp_path):
    from pipeline.report.provenance import runs_section

    sec = runs_section(read_outputs(make_run(tmp_path / "run"), "data/shards"))
    (link,) = [b for b in sec.blocks if isinstance(b, Paragraph) and b.href]
    # the helper's runs were logged to https://alice:s3cret@mlflow.example.org, experiment 7
    assert link.href == ("https://mlflow.example.org/#/experiments/7/runs"
                         "?workflowType=machine_learning&viewStateShareKey=headline")


def test_results_section__moco_protocol_rows_beside_ours():
    p = from_dict({})
    m = _metrics(knn={"top1": 85.0, "top5": 99.0, "k": 10.0, "T": 0.02, "protocol_top1": 82.5,
                      "protocol_top5": 98.5},
                 linear={"top1": 88.0, "top5": 99.5, "protocol_top1": 86.25,
                         "protocol_top5": 99.25},
                 baselines={"raw_pixels_top1": 80.0})
    rows = results_section(p, m).blocks[1].rows
    names = [r[0] for r in rows]
    assert names[:4] == ["MoCo encoder + kNN", "MoCo encoder + kNN, MoCo protocol",
                         "MoCo encoder + linear probe",
                         "MoCo encoder + linear probe, MoCo protocol"]
    assert rows[1][3:] == ["82.50", "98.50"] and rows[3][3:] == ["86.25", "99.25"]
    assert rows[1][1] == rows[3][1] == "last stage, global pool"  # the protocol's features
    assert rows[0][1] == rows[2][1] == "layer3, 4 x 4 cells"  # embed's default features


def test_headline__gap_under_seed_noise_is_level_not_a_win():
    from pipeline.report.results import SEED_NOISE_POINTS, headline

    assert SEED_NOISE_POINTS == 0.3
    m = _metrics(knn={"top1": 87.30}, linear={"top1": 88.68},
                 baselines={"raw_pixels_top1": 81.78, "raw_pixels_knn_tuned_top1": 87.16,
                            "raw_pixels_linear_top1": 83.84})
    # the long preset on the EPYC: kNN 87.30 - 87.16 = +0.14 < 0.3; linear +4.84
    assert headline(m) == (
        "Headline — kNN: MoCo 87.30 % is level with the best raw-pixel kNN 87.16 % (+0.14 "
        "points, within seed noise of 0.3); linear: MoCo 88.68 % beats the best raw-pixel "
        "linear 83.84 % (+4.84 points).")
    m = _metrics(knn={"top1": 86.90}, baselines={"raw_pixels_knn_tuned_top1": 87.16})
    assert headline(m) == ("Headline — kNN: MoCo 86.90 % is level with the best raw-pixel kNN "
                           "87.16 % (-0.26 points, within seed noise of 0.3).")
    m = _metrics(knn={"top1": 86.80}, baselines={"raw_pixels_knn_tuned_top1": 87.16})
    assert headline(m) == ("Headline — kNN: MoCo 86.80 % does not beat the best raw-pixel kNN "
                           "87.16 % (-0.36 points).")
    # a printed gap of exactly 0.30 is not under 0.3, whatever the float subtraction gives
    for ours, px, verdict in ((78.8, 78.5, "beats"), (78.5, 78.8, "does not beat"),
                              (88.33, 88.03, "beats")):
        m = _metrics(knn={"top1": ours}, baselines={"raw_pixels_knn_tuned_top1": px})
        assert f" {verdict} the best raw-pixel kNN" in headline(m), (ours, px)


@pytest.mark.parametrize("data, shown", [
    ({}, None),  # the labelled train images only: the dataset row says it all
    ({"unlabelled_root": "data/raw/photos"},
     "the labelled train images, the unlabelled tree data/raw/photos"),
    ({"source": "none", "unlabelled_root": "/x/photos"}, "the unlabelled tree /x/photos"),
    # shards read in place are not named: a respelling of the same shards reruns nothing
    ({"pretrain_shards": "https://host/s/{0..3}.tar"}, None),
])
def test_settings_section__names_every_pretraining_source(data, shown):
    rows = dict(settings_section(from_dict({"data": data})).blocks[0].rows)
    assert rows.get("pretraining images") == shown
