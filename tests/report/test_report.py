import base64
import io
import json
import re

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from pipeline.config import from_dict
from pipeline.report import figures as fg
from pipeline.report.render import (
    NOT_AVAILABLE,
    build_report,
    check_html,
    collect_final_metrics,
    load_shard_images,
    published_reference,
    read_dvc_lock,
    reference_note,
)

CLASS_NAMES = ["shirt", "shoe", "bag"]
PRETRAIN = {
    "loss": 5.4321,
    "inst_top1": 41.5,
    "inst_top5": 70.25,
    "steps": 20,
    "epochs": 2,
    "images_per_s": 812.5,
    "data_wait_fraction": 0.125,
    "wall_time_s": 31.5,
    "peak_memory_bytes": 104857600,
    "world_size": 1,
    "knn_top1": 66.5,
    "knn_top5": 98.0,
    "knn_top1_init": 40.25,
}
KNN = {
    "top1": 71.23,
    "top5": 99.5,
    "k": 20,
    "T": 0.1,
    "num_train": 60,
    "num_test": 24,
    "wall_time_s": 0.5,
}
LINEAR = {
    "top1": 73.87,
    "top5": 100.0,
    "epochs": 5,
    "lr": 30.0,
    "lr_effective": 3.75,
    "batch_size": 32,
    "mode_augment": 0,
    "wall_time_s": 2.5,
}
BASELINES = {
    "raw_pixels_top1": 62.41,
    "raw_pixels_top5": 97.0,
    "random_encoder_top1": 48.09,
    "random_encoder_top5": 90.5,
}
EMBED = {"images_per_s": 2000.0, "wall_time_s": 1.5}
DVC_LOCK = """\
schema: '2.0'
stages:
  build_shards:
    cmd: python stages/build_shards.py
    deps:
    - path: stages/build_shards.py
      hash: md5
      md5: 0123456789abcdef0123456789abcdef
    outs:
    - path: data/shards
      hash: md5
      md5: aaaabbbbccccddddeeeeffff00001111.dir
  pretrain:
    cmd: python stages/pretrain.py
    outs:
    - path: models/encoder.pt
      hash: md5
      md5: 99998888777766665555444433332222
"""
PARAMS = {
    "seed": 3,
    "knn": {"k": 20},
    "report": {"tsne_points": 40, "retrieval_queries": 3, "retrieval_neighbours": 4},
}


def _image(key_index: int) -> Image.Image:
    """A 28x28 grey image whose pixels encode its index (to check decoding)."""
    arr = np.full((28, 28), 3 * key_index % 256, dtype=np.uint8)
    arr[10:18, 10:18] = 255 - 3 * key_index % 256
    return Image.fromarray(arr, mode="L")


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _write_shards(split_dir, keys, labels, per_shard, *, manifest):
    split_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for s, start in enumerate(range(0, len(keys), per_shard)):
        name = f"shard-{s:06d}.tar"
        with wds.TarWriter(str(split_dir / name)) as sink:
            for i in range(start, min(start + per_shard, len(keys))):
                sink.write({"__key__": keys[i], "png": _png(_image(i)), "cls": int(labels[i])})
        shards.append(
            {"name": name, "num_samples": min(per_shard, len(keys) - start), "sha256": "0" * 64}
        )
    if manifest:
        _write_json(
            split_dir / "manifest.json",
            {"shards": shards, "class_names": CLASS_NAMES, "mode": "L", "shape": [1, 28, 28]},
        )


def _features(n, seed):
    """(n, 8) features around 3 fixed class centres (shared by train and test), noise by seed."""
    centres = torch.randn(3, 8, generator=torch.Generator().manual_seed(123)) * 3
    labels = torch.arange(n) % 3
    feats = centres[labels] + torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return feats, labels


def make_run(root):
    """Every input of the report, tiny: 60 train / 24 test embeddings of 3 classes."""
    for name, obj in (
        ("pretrain", PRETRAIN),
        ("knn", KNN),
        ("linear", LINEAR),
        ("baselines", BASELINES),
        ("embed", EMBED),
    ):
        _write_json(root / f"metrics/{name}.json", obj)
    (root / "plots").mkdir()
    rows = [
        "step\tepoch\tloss\tlr\tm\tinst_top1\tinst_top5\tqueue_mean_age\t"
        "data_wait_fraction\timages_per_s"
    ]
    for s in range(1, 6):
        rows.append(
            f"{s * 4}\t{s // 3}\t{6 - s * 0.2}\t{0.06 / s}\t0.99\t{10 * s}\t{15 * s}\t"
            f"{'nan' if s == 1 else s * 1.5}\t0.1\t{800 + s}"
        )
    (root / "plots/pretrain.tsv").write_text("\n".join(rows) + "\n")
    (root / "plots/knn_monitor.tsv").write_text(
        "epoch\tstep\tknn_top1\tknn_top5\n0\t0\t40.25\t90\n1\t10\t55\t95\n2\t20\t66.5\t98\n"
    )
    (root / "plots/linear.tsv").write_text(
        "epoch\tloss\ttrain_acc\tlr\tval_acc\n"
        + "".join(f"{e}\t{2 - e * 0.3}\t{50 + 5 * e}\t3.75\t{48 + 5 * e}\n" for e in range(1, 6))
    )
    for stem, acc in (("knn", [70.0, 80.0, 63.7]), ("linear", [75.0, 77.5, 69.1])):
        _write_json(
            root / f"eval/{stem}_details.json",
            {
                "class_names": CLASS_NAMES,
                "per_class_accuracy": acc,
                "confusion_matrix": [[6, 1, 1], [1, 6, 1], [2, 1, 5]],
            },
        )
    train_x, train_y = _features(60, 0)
    test_x, test_y = _features(24, 1)
    train_keys = [f"train{i:05d}" for i in range(60)]
    test_keys = [f"test{i:05d}" for i in range(24)]
    (root / "features").mkdir()
    torch.save(
        {"features": train_x, "labels": train_y, "keys": train_keys}, root / "features/train.pt"
    )
    torch.save({"features": test_x, "labels": test_y, "keys": test_keys}, root / "features/test.pt")
    _write_shards(root / "data/shards/train", train_keys, train_y, 30, manifest=False)
    _write_shards(root / "data/shards/test", test_keys, test_y, 24, manifest=True)
    (root / "dvc.lock").write_text(DVC_LOCK)
    for i, stage in enumerate(("build_shards", "pretrain", "embed", "baselines", "knn", "linear")):
        _write_json(
            root / f"runs/{stage}.json",
            {
                "stage": stage,
                "run_id": None if stage == "embed" else f"run{i:02d}abc",
                "tracking_uri": "https://alice:s3cret@mlflow.example.org",
                "experiment_id": "7",
            },
        )
    return root


@pytest.fixture(scope="module")
def full_report(tmp_path_factory):
    root = make_run(tmp_path_factory.mktemp("run"))
    html_path = build_report(
        params=from_dict(PARAMS), root=root, out_dir=root / "reports", git_commit="abc1234"
    )
    return root, html_path


def _section(md, title):
    return md.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _md_row(md, first_cell):
    rows = [ln for ln in md.splitlines() if ln.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, (first_cell, rows)
    return [c.strip() for c in rows[0].strip("|").split("|")]


def test_build_report__writes_html_md_and_figures(full_report):
    root, html_path = full_report
    out = root / "reports"
    assert html_path == out / "report.html"
    assert (out / "report.md").is_file()
    expected = {
        "pretrain_curves",
        "instance_accuracy",
        "queue_age",
        "throughput",
        "knn_monitor",
        "linear_curves",
        "confusion_knn",
        "confusion_linear",
        "per_class_accuracy",
        "tsne",
        "retrieval",
    }
    assert {p.stem for p in (out / "figures").glob("*.png")} == expected
    assert check_html(html_path) == []
    html = html_path.read_text()
    assert html.count('<img src="data:image/png;base64,') == len(expected)
    md = (out / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", md)
    assert sorted(links) == sorted(f"figures/{n}.png" for n in expected)
    assert all((out / link).is_file() for link in links)
    assert [p.name for p in root.iterdir() if p.name.startswith(".reports")] == []


def test_build_report__results_table_has_exact_numbers(full_report):
    root, html_path = full_report
    md = (root / "reports/report.md").read_text()
    assert _md_row(md, "MoCo encoder + kNN")[2:] == ["71.23", "99.50"]
    assert _md_row(md, "MoCo encoder + linear probe")[2:] == ["73.87", "100.00"]
    assert _md_row(md, "raw pixels (baseline)")[2:] == ["62.41", "97.00"]
    assert _md_row(md, "random-init encoder (baseline)")[2:] == ["48.09", "90.50"]
    assert "k=20, T=0.1" in _md_row(md, "MoCo encoder + kNN")[1]
    assert "kNN +8.82 points vs raw pixels" in md  # 71.23 - 62.41
    assert "Fashion-MNIST" in md
    html = html_path.read_text()
    for v in ("71.23", "73.87", "62.41", "48.09"):
        assert f'<td class="num">{v}</td>' in html


def test_build_report__provenance_sections(full_report):
    root, html_path = full_report
    md = (root / "reports/report.md").read_text()
    runs = _section(md, "MLflow runs")
    assert _md_row(runs, "pretrain") == ["pretrain", "run01abc", "7"]
    assert _md_row(runs, "embed")[1] == "not logged (MLflow disabled)"
    assert "https://***@mlflow.example.org" in runs
    assert "s3cret" not in md and "s3cret" not in html_path.read_text()
    lock = _section(md, "DVC outputs")
    assert "| build_shards | data/shards | aaaabbbbccccddddeeeeffff00001111.dir |" in lock
    assert "| pretrain | models/encoder.pt | 99998888777766665555444433332222 |" in lock
    assert "git commit abc1234" in md
    cost = _section(md, "Throughput and wall time")
    assert _md_row(cost, "pretrain")[1:3] == ["31.5", "812.5"]
    assert _md_row(cost, "embed")[1:3] == ["1.5", "2000.0"]
    # total of the five metrics files' wall times: 31.5 + 1.5 + 0.5 + 2.5 = 36.0
    assert _md_row(cost, "total (available)")[1] == "36.0"


def test_build_report__missing_inputs_say_not_available(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    html_path = build_report(params=from_dict({}), root=root, out_dir=tmp_path / "out")
    md = (tmp_path / "out/report.md").read_text()
    assert _md_row(md, "MoCo encoder + kNN")[2:] == [NOT_AVAILABLE, NOT_AVAILABLE]
    assert _md_row(md, "raw pixels (baseline)")[2:] == [NOT_AVAILABLE, NOT_AVAILABLE]
    assert "dvc.lock: not available." in md
    assert "t-SNE: not available" in md
    assert check_html(html_path) == []
    assert list((tmp_path / "out/figures").iterdir()) == []


def test_build_report__one_metrics_file_missing(tmp_path):
    root = make_run(tmp_path / "run")
    (root / "metrics/knn.json").unlink()
    (root / "eval/knn_details.json").unlink()
    params = from_dict({"report": {"tsne_points": 0, "retrieval_queries": 0}})
    build_report(params=params, root=root, out_dir=root / "reports")
    md = (root / "reports/report.md").read_text()
    assert _md_row(md, "MoCo encoder + kNN")[2:] == [NOT_AVAILABLE, NOT_AVAILABLE]
    assert _md_row(md, "MoCo encoder + linear probe")[2:] == ["73.87", "100.00"]
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


def test_build_report__same_inputs_same_markdown(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    (root / "metrics").mkdir()
    (root / "metrics/knn.json").write_text(json.dumps(KNN))
    a = build_report(params=from_dict({}), root=root, out_dir=tmp_path / "a")
    b = build_report(params=from_dict({}), root=root, out_dir=tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    assert (tmp_path / "a/report.md").read_bytes() == (tmp_path / "b/report.md").read_bytes()


def test_collect_final_metrics__union_with_prefixes(tmp_path):
    root = make_run(tmp_path / "run")
    (root / "metrics/embed.json").unlink()
    _write_json(
        root / "metrics/linear.json", {**LINEAR, "note": "text", "flag": True, "nested": {"a": 2}}
    )
    expected = {f"pretrain.{k}": float(v) for k, v in PRETRAIN.items()}
    expected |= {f"knn.{k}": float(v) for k, v in KNN.items()}
    expected |= {f"linear.{k}": float(v) for k, v in LINEAR.items()}
    expected |= {f"baselines.{k}": float(v) for k, v in BASELINES.items()}
    expected["linear.nested.a"] = 2.0
    got = collect_final_metrics(root)
    assert got == expected
    assert got["knn.top1"] == 71.23 and got["baselines.raw_pixels_top1"] == 62.41
    assert collect_final_metrics(tmp_path / "nothing") == {}


def _brute_force_neighbours(q, bank, k):
    out_idx, out_sim = [], []
    for row in q.tolist():
        sims = []
        for j, b in enumerate(bank.tolist()):
            dot = sum(x * y for x, y in zip(row, b))
            nq = sum(x * x for x in row) ** 0.5
            nb = sum(y * y for y in b) ** 0.5
            sims.append((dot / (nq * nb), j))
        sims.sort(key=lambda t: -t[0])
        out_idx.append([j for _, j in sims[:k]])
        out_sim.append([s for s, _ in sims[:k]])
    return out_idx, out_sim


@pytest.mark.parametrize("chunk_rows", [65536, 7])
def test_nearest_neighbours__matches_brute_force(monkeypatch, chunk_rows):
    monkeypatch.setattr(fg, "_BANK_CHUNK_ROWS", chunk_rows)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, generator=g)
    bank = torch.randn(50, 6, generator=g) * torch.rand(50, 1, generator=g) * 10  # mixed norms
    idx, sim = fg.nearest_neighbours(q, bank, 4)
    ref_idx, ref_sim = _brute_force_neighbours(q, bank, 4)
    assert idx.tolist() == ref_idx
    assert np.allclose(sim.numpy(), ref_sim, atol=1e-5)


def test_nearest_neighbours__k_clipped_to_bank(tmp_path):
    idx, sim = fg.nearest_neighbours(torch.ones(2, 3), torch.eye(3), 10)
    assert idx.shape == sim.shape == (2, 3)
    with pytest.raises(ValueError, match="k must be"):
        fg.nearest_neighbours(torch.ones(2, 3), torch.eye(3), 0)


def test_seeded_subsample__distinct_sorted_reproducible():
    a = fg.seeded_subsample(100, 10, seed=5)
    assert len(set(a.tolist())) == 10 and a.tolist() == sorted(a.tolist())
    assert a.tolist() == fg.seeded_subsample(100, 10, seed=5).tolist()
    assert fg.seeded_subsample(4, 10, seed=5).tolist() == [0, 1, 2, 3]


def test_plot_tsne__skipped_below_minimum(tmp_path):
    feats, labels = _features(30, 0)
    assert (
        fg.plot_tsne(feats, labels, CLASS_NAMES, tmp_path / "t.png", num_points=0, seed=0) is None
    )
    assert (
        fg.plot_tsne(feats, labels, CLASS_NAMES, tmp_path / "t.png", num_points=9, seed=0) is None
    )
    assert not (tmp_path / "t.png").exists()


def test_load_shard_images__decodes_requested_keys(tmp_path):
    keys = [f"k{i:03d}" for i in range(10)]
    _write_shards(tmp_path / "s", keys, [0] * 10, 4, manifest=True)
    got = load_shard_images(tmp_path / "s", ["k001", "k009", "absent"])
    assert sorted(got) == ["k001", "k009"]
    assert np.array_equal(np.asarray(got["k009"]), np.asarray(_image(9)))
    assert got["k001"].mode == "L"


def test_read_dvc_lock__rows(tmp_path):
    (tmp_path / "dvc.lock").write_text(DVC_LOCK)
    assert read_dvc_lock(tmp_path / "dvc.lock") == [
        ("build_shards", "data/shards", "aaaabbbbccccddddeeeeffff00001111.dir"),
        ("pretrain", "models/encoder.pt", "99998888777766665555444433332222"),
    ]
    assert read_dvc_lock(tmp_path / "absent.lock") is None


def test_published_reference__presets():
    cifar = from_dict(
        {
            "data": {"source": "cifar10"},
            "model": {"backbone": "resnet18"},
            "pretrain": {"epochs": 200},
        }
    )
    ref = published_reference(cifar)
    assert (ref.protocol, ref.top1, ref.epochs) == ("knn", 82.6, 200)
    assert "82.6 %" in reference_note(cifar)
    imagenet = from_dict(
        {
            "data": {"source": "imagefolder", "root": "/datasets/ImageNet"},
            "model": {"backbone": "resnet50"},
            "augment": {"preset": "v2"},
        }
    )
    assert published_reference(imagenet).top1 == 67.5
    fashion = from_dict({})
    assert published_reference(fashion) is None
    assert "No MoCo result has been published for Fashion-MNIST" in reference_note(fashion)


def test_check_html__reports_missing_file_and_bad_data(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures/ok.png").write_bytes(b"x")
    png = base64.b64encode(_png(_image(1))).decode()
    (tmp_path / "r.html").write_text(
        f'<html><body><img src="figures/ok.png"><img src="figures/missing.png">'
        f'<img src="data:image/png;base64,{png}"><img src="data:image/png;base64,!!!">'
        f'<img src="data:image/png;base64,{base64.b64encode(b"GIF89a").decode()}">'
        f'<img src="https://example.org/x.png"><img alt="no src"></body></html>'
    )
    problems = check_html(tmp_path / "r.html")
    assert len(problems) == 5, problems
    assert problems[0].startswith("img #2:") and "missing.png" in problems[0]
    assert problems[1].startswith("img #4:") and "base64" in problems[1]
    assert problems[2].startswith("img #5:") and "not a PNG" in problems[2]
    assert problems[3].startswith("img #6:") and "self-contained" in problems[3]
    assert problems[4] == "img #7: no src"
    assert check_html(tmp_path / "absent.html") == [
        f"{tmp_path / 'absent.html'}: file does not exist"
    ]
