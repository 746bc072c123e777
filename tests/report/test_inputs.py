import json

import numpy as np
import torch
from reporthelpers import (
    BASELINES,
    CLASS_NAMES,
    DATA_INSIGHTS,
    DATA_INSIGHTS_METRICS,
    DVC_LOCK,
    KNN,
    LINEAR,
    PRETRAIN,
    RAN,
    image,
    make_run,
    write_json,
    write_shards,
)

from pipeline.report.inputs import (
    EvalDetails,
    LockRow,
    Metrics,
    RunRecord,
    collect_final_metrics,
    load_shard_images,
    read_data_insights,
    read_dvc_lock,
    read_metrics,
    read_outputs,
    read_tsv,
    shard_images,
)


def test_read_outputs__complete_run_typed(tmp_path):
    root = make_run(tmp_path / "run")
    out = read_outputs(root, "data/shards")
    assert out.metrics["knn"] == Metrics({k: float(v) for k, v in KNN.items()})
    assert out.metrics["pretrain"].get("inst_top5") == 70.25
    assert out.plots["knn_monitor"]["knn_top1"].tolist() == [40.25, 55.0, 66.5]
    assert np.isnan(out.plots["pretrain"]["queue_mean_age"][0])  # the 'nan' cell
    det = out.details["linear"]
    assert isinstance(det, EvalDetails) and det.class_names == CLASS_NAMES
    assert det.per_class_accuracy == [75.0, 77.5, 69.1]
    assert det.confusion.dtype == np.int64 and det.confusion.tolist()[2] == [2, 1, 5]
    assert out.features["train"].features.shape == (60, 8)
    assert out.features["test"].keys[:2] == ["test00000", "test00001"]
    assert out.test_class_names == CLASS_NAMES
    assert out.data_insights == DATA_INSIGHTS and out.root == root
    assert out.runs["embed"] == RunRecord(None, "7", "https://alice:s3cret@mlflow.example.org")
    assert out.runs["knn"].run_id == "run04abc"
    assert out.runs["pretrain"].ran == RAN and out.runs["knn"].ran == {}
    assert out.split_sizes == {"train": None, "test": 24}  # the train shards have no manifest
    md5 = "99998888777766665555444433332222"
    assert out.dvc_lock[1] == LockRow("pretrain", "models/encoder.pt", md5)
    assert out.shards_dir == root / "data/shards"


def test_read_outputs__nothing_there_is_none(tmp_path):
    out = read_outputs(tmp_path, "data/shards")
    for group in (out.metrics, out.plots, out.details, out.features, out.runs):
        assert set(group.values()) == {None}
    assert out.test_class_names is None and out.dvc_lock is None


def test_read_metrics__keeps_finite_numbers_only(tmp_path):
    (tmp_path / "m.json").write_text(
        '{"a": 1, "b": 2.5, "flag": true, "s": "x", "n": NaN, "i": Infinity, "d": {"x": 1}}'
    )
    assert read_metrics(tmp_path / "m.json") == Metrics({"a": 1.0, "b": 2.5})
    (tmp_path / "e.json").write_text("{}")
    (tmp_path / "l.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{not json")
    for name in ("e.json", "l.json", "bad.json", "absent.json"):
        assert read_metrics(tmp_path / name) is None, name


def test_read_details__unscored_class_is_nan(tmp_path):
    # run._details writes null for a class absent from the test set
    write_json(tmp_path / "d.json", {"per_class_accuracy": [50.0, None],
                                     "confusion_matrix": [[1, 1], [0, 0]]})
    out = read_outputs(tmp_path, "data/shards")
    assert out.details["knn"] is None  # not at eval/knn_details.json
    write_json(tmp_path / "eval/knn_details.json", json.loads((tmp_path / "d.json").read_text()))
    det = read_outputs(tmp_path, "data/shards").details["knn"]
    assert det.class_names == ["0", "1"]  # no names recorded: the indices
    assert det.per_class_accuracy[0] == 50.0 and np.isnan(det.per_class_accuracy[1])


def test_read_tsv__ragged_and_empty(tmp_path):
    (tmp_path / "t.tsv").write_text("a\tb\n1\t\n2\t3\t99\n\n")
    got = read_tsv(tmp_path / "t.tsv")
    assert got["a"].tolist() == [1.0, 2.0]
    assert np.isnan(got["b"][0]) and got["b"][1] == 3.0
    (tmp_path / "e.tsv").write_text("\n")
    assert read_tsv(tmp_path / "e.tsv") is None and read_tsv(tmp_path / "absent.tsv") is None


def test_load_shard_images__decodes_requested_keys(tmp_path):
    keys = [f"k{i:03d}" for i in range(10)]
    write_shards(tmp_path / "s", keys, [0] * 10, 4, manifest=True)
    got = load_shard_images(tmp_path / "s", ["k001", "k009", "absent"])
    assert sorted(got) == ["k001", "k009"]
    assert np.array_equal(np.asarray(got["k009"]), np.asarray(image(9)))
    assert got["k001"].mode == "L"


def test_shard_images__img2dataset_keys_with_dots_and_jpeg(tmp_path):
    # a shard read in place: keys end at the LAST dot (photo.2024), JPEG members, a .json beside
    import io

    import webdataset as wds
    from PIL import Image

    def jpeg(i):
        buf = io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), 40 * i, dtype=np.uint8)).save(buf, format="JPEG",
                                                                         quality=95)
        return buf.getvalue()

    with wds.TarWriter(str(tmp_path / "x.tar")) as sink:
        for i, key in enumerate(["photo.2024", "b", "c"]):
            sink.write({"__key__": key, "jpg": jpeg(i + 1), "json": b"{}"})
    got = shard_images(tmp_path / "x.tar", {"photo.2024", "c", "absent"})
    assert sorted(got) == ["c", "photo.2024"]
    # JPEG keeps a flat 8x8 block exact up to rounding: 40 * 1 = 40 and 40 * 3 = 120
    assert abs(int(np.asarray(got["photo.2024"]).mean()) - 40) <= 1
    assert abs(int(np.asarray(got["c"]).mean()) - 120) <= 1
    assert shard_images(tmp_path / "absent.tar", {"c"}) == {}


def test_read_data_insights__malformed_is_none(tmp_path, caplog):
    bad = {**DATA_INSIGHTS, "pairs": [{"cosine": "high", "a": {}, "b": {}}]}
    write_json(tmp_path / "eval/data_insights.json", bad)
    assert read_data_insights(tmp_path / "eval/data_insights.json") is None
    assert "not a data-insights file" in caplog.text
    assert read_data_insights(tmp_path / "absent.json") is None


def test_read_dvc_lock__rows(tmp_path):
    (tmp_path / "dvc.lock").write_text(DVC_LOCK)
    assert read_dvc_lock(tmp_path / "dvc.lock") == [
        LockRow("build_shards", "data/shards", "aaaabbbbccccddddeeeeffff00001111.dir"),
        LockRow("pretrain", "models/encoder.pt", "99998888777766665555444433332222"),
        LockRow("report", "reports", "0000111122223333444455556666777f.dir"),
        LockRow("report", "runs/report.json", "0000111122223333444455556666777e"),
    ]
    assert read_dvc_lock(tmp_path / "absent.lock") is None
    (tmp_path / "list.lock").write_text("- 1\n")
    assert read_dvc_lock(tmp_path / "list.lock") is None


def test_collect_final_metrics__union_with_prefixes(tmp_path):
    root = make_run(tmp_path / "run")
    (root / "eval/metrics/embed.json").unlink()
    write_json(root / "eval/metrics/linear.json",
               {**LINEAR, "note": "text", "flag": True, "nested": {"a": 2}})
    expected = {f"pretrain.{k}": float(v) for k, v in PRETRAIN.items()}
    expected |= {f"knn.{k}": float(v) for k, v in KNN.items()}
    expected |= {f"linear.{k}": float(v) for k, v in LINEAR.items()}
    expected |= {f"baselines.{k}": float(v) for k, v in BASELINES.items()}
    expected |= {f"data_insights.{k}": float(v) for k, v in DATA_INSIGHTS_METRICS.items()}
    expected["linear.nested.a"] = 2.0
    got = collect_final_metrics(root)
    assert got == expected
    assert got["knn.top1"] == 71.23 and got["baselines.raw_pixels_top1"] == 62.41
    assert collect_final_metrics(tmp_path / "nothing") == {}


def test_read_outputs__features_labels_are_tensors(tmp_path):
    root = make_run(tmp_path / "run")
    test = read_outputs(root, "data/shards").features["test"]
    assert test.labels.dtype == torch.int64 and test.labels[:4].tolist() == [0, 1, 2, 0]
