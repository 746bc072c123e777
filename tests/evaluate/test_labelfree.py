"""Label-free numbers: RankMe, alignment, uniformity against values worked out by hand."""

from __future__ import annotations

import itertools
import math
import shutil

import numpy as np
import pytest
import torch
from helpers import build_tiny_shards, run_pretrain, says

from pipeline.evaluate.labelfree import alignment, effective_rank, uniformity
from pipeline.evaluate.labelfree import view_top1 as lf_view_top1
from pipeline.evaluate.run.embed import load_encoder
from pipeline.train.monitor import LabelFreeProbe


def test_effective_rank__equal_singular_values_give_their_count():
    # 5 orthonormal rows (and 3 zero rows): singular values 1,1,1,1,1 -> p = 1/5 each,
    # exp(entropy) = exp(ln 5) = 5 (the epsilon moves it by ~1e-6)
    z = torch.zeros(8, 6)
    z[:5, :5] = torch.eye(5) * 3.0
    assert effective_rank(z) == pytest.approx(5.0, abs=1e-4)
    assert effective_rank(torch.ones(10, 4)) == pytest.approx(1.0, abs=1e-4)  # rank 1


def test_effective_rank__two_singular_values_by_hand():
    # singular values 3 and 1: p = (0.75, 0.25), H = -(0.75 ln 0.75 + 0.25 ln 0.25)
    z = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert effective_rank(z) == pytest.approx(math.exp(h), abs=1e-5)
    with pytest.raises(ValueError, match="NaN or an infinity"):
        effective_rank(torch.tensor([[float("nan"), 1.0]]))


def test_alignment__identical_orthogonal_antipodal_views():
    a = torch.eye(3) * 5.0  # rows normalised to unit vectors first
    assert alignment(a, a) == 0.0
    assert alignment(a, -a) == pytest.approx(4.0)  # |u - (-u)|^2 = 4
    b = torch.roll(torch.eye(3), 1, dims=1)  # each row orthogonal to a's: |u - v|^2 = 2
    assert alignment(a, b) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="one shape"):
        alignment(a, torch.eye(2))


def test_uniformity__against_a_double_loop_reference():
    z = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    zd = z.double()
    u = (zd / zd.norm(dim=1, keepdim=True)).numpy()
    terms = [math.exp(-2.0 * float(np.sum((u[i] - u[j]) ** 2)))
             for i, j in itertools.combinations(range(12), 2)]
    assert uniformity(z) == pytest.approx(math.log(sum(terms) / len(terms)), abs=1e-12)
    # two antipodal points: one pair at squared distance 4 -> log exp(-8) = -8
    assert uniformity(torch.tensor([[1.0, 0.0], [-2.0, 0.0]])) == pytest.approx(-8.0)
    assert uniformity(torch.ones(4, 3)) == pytest.approx(0.0)  # collapsed: every distance 0


def test_probe__fixed_sample_and_views__same_numbers_no_rng_or_mode_change(tiny_shards,
                                                                           tmp_path):
    run_pretrain(tiny_shards, tmp_path, {"pretrain": {"epochs": 1}})
    backbone, _ = load_encoder(tmp_path / "encoder.pt")
    backbone.train()
    probe = LabelFreeProbe(tiny_shards / "pretrain", image_size=16, mean=[0.4], std=[0.3],
                           preset="v2_grey", crop_min_scale=0.2, device=torch.device("cpu"),
                           n=100)
    assert len(probe) == 100 and probe.images.dtype == torch.uint8
    rng = torch.get_rng_state()
    first = probe(backbone)
    assert torch.equal(torch.get_rng_state(), rng)  # the views use a forked, seeded RNG
    assert backbone.training  # restored after the eval-mode forward
    assert probe(backbone) == first
    d = backbone.num_features
    assert 1.0 <= first["rankme"] <= min(100, d)
    assert 0.0 < first["alignment"] < 4.0 and -4.0 <= first["uniformity"] < 0.0
    # the plain features recomputed without the probe: the same RankMe
    x = (probe.images.float() / 255 - 0.4) / 0.3
    with torch.no_grad():
        assert effective_rank(backbone.eval()(x)) == pytest.approx(first["rankme"], rel=1e-6)


def test_pretrain__labelfree_curve_in_plots_metrics_and_resume(tmp_path):
    shards = build_tiny_shards(tmp_path / "s")
    over = {"pretrain": {"knn_every_epochs": 1, "knn_monitor_train_images": 32,
                         "knn_monitor_test_images": 16, "labelfree_images": 64}}
    m = run_pretrain(shards, tmp_path / "full", over)
    rows = [r.split("\t") for r in (tmp_path / "full/labelfree.tsv").read_text().splitlines()]
    assert rows[0] == ["epoch", "step", "rankme", "alignment", "uniformity", "view_top1"]
    assert [r[:2] for r in rows[1:]] == [["0", "0"], ["1", "12"], ["2", "24"]]
    assert float(rows[-1][2]) == pytest.approx(m["rankme"], rel=1e-5)
    assert float(rows[1][3]) == pytest.approx(m["alignment_init"], rel=1e-5)
    # interrupted after step 7, resumed: the same encoder and the same label-free rows
    run_pretrain(shards, tmp_path / "part", over, max_steps=7)
    run_pretrain(shards, tmp_path / "part", over)
    assert (tmp_path / "part/labelfree.tsv").read_text() == (
        tmp_path / "full/labelfree.tsv").read_text()
    assert (tmp_path / "part/encoder.pt").read_bytes() == (tmp_path / "full/encoder.pt"
                                                           ).read_bytes()


def test_pretrain__end_values_are_taken_after_the_last_epoch_whatever_the_cadence(tmp_path):
    # every 2 epochs of 3: the monitor runs after epochs 0 and 2, and after the last one, so
    # metrics/pretrain.json's end values are epoch 3's (they were epoch 2's)
    shards = build_tiny_shards(tmp_path / "s")
    over = {"pretrain": {"epochs": 3, "knn_every_epochs": 2, "knn_monitor_train_images": 32,
                         "knn_monitor_test_images": 16, "labelfree_images": 64}}
    m = run_pretrain(shards, tmp_path / "out", over)
    for name in ("labelfree.tsv", "knn.tsv"):
        rows = [r.split("\t") for r in (tmp_path / "out" / name).read_text().splitlines()[1:]]
        assert [r[:2] for r in rows] == [["0", "0"], ["2", "24"], ["3", "36"]], name
    last = (tmp_path / "out/labelfree.tsv").read_text().splitlines()[-1].split("\t")
    assert float(last[2]) == pytest.approx(m["rankme"], rel=1e-5)


def test_pretrain__labelfree_without_labels(tmp_path):
    # data.source none: no labelled train/test images, so no kNN; the label-free curve stays
    from pipeline.data.build import empty_split

    shards = build_tiny_shards(tmp_path / "s")
    for split in ("train", "test"):
        shutil.rmtree(shards / split)
        empty_split(shards / split, split=split, source="synthetic", class_names=[], mode="L",
                    build={})
    run_pretrain(shards, tmp_path / "out", {"pretrain": {
        "knn_every_epochs": 1, "labelfree_images": 64, "epochs": 1}})
    knn = (tmp_path / "out/knn.tsv").read_text().splitlines()
    lf = (tmp_path / "out/labelfree.tsv").read_text().splitlines()
    assert knn == ["epoch\tstep\tknn_top1\tknn_top5"] and len(lf) == 3


def test_study__constants_are_the_results_files():
    import json

    from pipeline.codegraph import REPO
    from pipeline.evaluate.labelfree import METRICS
    from pipeline.report import labelfree_findings as lf

    study = json.loads((REPO / lf.STUDY_FILE).read_text())
    found = {k: (v["spearman_rho"], v["encoders"])
             for k, v in study["spearman_with_knn_top1"].items() if k in METRICS}
    assert lf.STUDY == found
    assert len(study["encoders"]) >= 8  # the floor: at least 8 encoders
    runs = json.loads((REPO / lf.VERDICTS_FILE).read_text())["full_length_runs"]
    assert len(runs) >= 3  # the floor: three full-length runs
    within = {k: (round(sum(r["within_run_spearman"][k]["all_epochs"]["rho"]
                            for r in runs.values()) / len(runs), 4), len(runs))
              for k in METRICS}
    assert lf.WITHIN_RUN == within
    # by hand from the file: RankMe 0.7143 (default), 0.9848 (long), 1.0 (width16): 0.8997
    rho = [runs[n]["within_run_spearman"]["rankme"]["all_epochs"]["rho"]
           for n in ("default", "long", "width16")]
    assert lf.WITHIN_RUN["rankme"] == (round(sum(rho) / 3, 4), 3)


def test_view_top1__known_embeddings():
    a = torch.eye(4, dtype=torch.float64) + 0.1
    assert lf_view_top1(a, a) == 100.0  # each view's nearest is its own image's other view
    assert lf_view_top1(a, a.flip(0)) == 0.0  # every pair swapped: no image finds its own
    const = torch.ones(8, 3)
    assert lf_view_top1(const, const) == 100.0 / 8  # ties -> index 0: chance, only image 0
    # two of four images swap their second views: half the images find their own, both ways
    b = a[[1, 0, 2, 3]]
    assert lf_view_top1(a, b, chunk=3) == 50.0
    with pytest.raises(ValueError) as e:
        lf_view_top1(a, a[:3])
    says(str(e.value), "view_top1", "(4, 4)", "(3, 4)")
