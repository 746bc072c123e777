"""The run verdict: encoders built to be known, and a trajectory worked out by hand."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_tiny_shards, run_pretrain, says
from torch import nn

from pipeline.evaluate import verdict as vd
from pipeline.moco.backbones import build_backbone
from pipeline.train.monitor import LabelFreeProbe

# improves (epochs 0-3), plateaus (3-6), then gets worse (7-8)
EPOCHS = list(range(9))
VALUES = [10.0, 30.0, 50.0, 60.0, 61.0, 60.5, 61.0, 55.0, 50.0]


@pytest.mark.parametrize(("last", "expected"), [
    # epochs 0..3: best 60 at the last point; gain 50, tol 0.1 * 50 = 5; epoch 2 (50) is
    # below 55, so only the last point is in the best band: still improving
    (3, (vd.IMPROVING, vd.NO_EPOCH)),
    # 0..4: best 61, tol 5.1: epoch 3 (60) >= 55.9, epoch 2 (50) not: plateau from 3
    (4, (vd.PLATEAU, 3)),
    # 0..6: best 61 (first at epoch 4), tol 5.1: 60, 61, 60.5, 61 all >= 55.9: plateau from 3
    (6, (vd.PLATEAU, 3)),
    # 0..7: last 55 < 61 - 5.1 = 55.9: worse after epoch 4, the first holding 61
    (7, (vd.WORSE, 4)),
    (8, (vd.WORSE, 4)),
])
def test_trend__improves_plateaus_then_gets_worse__by_hand(last, expected):
    assert vd.trend(EPOCHS[:last + 1], VALUES[:last + 1], fraction=0.1) == expected
    # the same curve of a lower-is-better number: the same verdicts
    assert vd.trend(EPOCHS[:last + 1], [-x for x in VALUES[:last + 1]],
                    higher_is_better=False, fraction=0.1) == expected


def test_trend__monitor_every_two_epochs_names_the_monitor_epoch():
    # points at epochs 0, 2, 4, 6: 0, 10, 10.5, 10.2; gain 10.5, tol 1.05: 10 and 10.2 are in
    # the band from epoch 2 on
    assert vd.trend([0, 2, 4, 6], [0.0, 10.0, 10.5, 10.2], fraction=0.1) == (vd.PLATEAU, 2)
    with pytest.raises(ValueError) as e:
        vd.trend([0, 2, 2], [1.0, 2.0, 3.0])
    says(str(e.value), "epochs must increase", "[0, 2, 2]")
    with pytest.raises(ValueError) as e:
        vd.trend([0], [1.0])
    says(str(e.value), ">= 2", "1 epochs")


def test_describe__codes_and_epochs():
    assert [vd.describe(c, e) for c, e in ((0, -1), (1, 3), (2, 4), (3, -1), (4, -1))] == [
        "still improving", "plateaued since epoch 3", "got worse after epoch 4",
        "no better than random init", "collapsed"]
    with pytest.raises(ValueError) as e:
        vd.describe(vd.PLATEAU)
    says(str(e.value), "verdict_code 1", "verdict_epoch", "-1")
    with pytest.raises(ValueError) as e:
        vd.describe(7)
    says(str(e.value), "verdict_code", "[0, 1, 2, 3, 4]", "7")


def test_report_sentence__names_the_number_as_the_report_does():
    # the default run's verdict, as eval/metrics/pretrain.json stores it
    from pipeline.report.labelfree_findings import report_sentence

    text = report_sentence({"verdict_code": vd.PLATEAU, "verdict_epoch": 5})
    assert text.startswith("Verdict without labels: plateaued since epoch 5. ")
    assert "its view top-1 has stayed within 10% of its whole gain since epoch 5" in text
    # a plateau of the label-free number is not evidence that more epochs would not help
    assert "unlikely to help" not in text
    says(text, "levelled off 1-2 epochs after the kNN monitor", "25 epochs: 14 and 15")
    assert report_sentence({"rankme": 92.1}) is None  # a run without a verdict


def test_noise__binomial_standard_error_by_hand():
    # q = 0.5 of 100 images: sqrt(0.25 / 100) = 0.05, i.e. 5 points
    assert vd.standard_error(50.0, 100) == pytest.approx(5.0)
    assert vd.noise(50.0, 50.0, 100) == pytest.approx(2 * (2 * 25.0) ** 0.5)  # 14.142
    # a share of 0 is held at 1/N: sqrt((1/100) (99/100) / 100) = 0.99499 points
    assert vd.standard_error(0.0, 100) == pytest.approx(100 * (0.01 * 0.99 / 100) ** 0.5)
    with pytest.raises(ValueError):
        vd.standard_error(50.0, 0)


def test_verdict__a_gain_within_the_noise_is_no_gain():
    # the CI preset's run: view top-1 2.25 % -> 3.52 % on 512 images. Noise: 2 sqrt(se1^2 +
    # se2^2), se = 100 sqrt(q (1 - q) / 512): 0.6554 and 0.8144 -> 2.091 points > the 1.27 gain
    rows = [{"epoch": 0, "rankme": 30.0, "view_top1": 2.25},
            {"epoch": 2, "rankme": 40.0, "view_top1": 3.52}]
    v = vd.verdict(rows, 64, 512)
    assert v.code == vd.NO_BETTER
    says(v.why, "3.52 % at the end", "2.25 % at random init", "2.1 points at 512 images")
    # the same two values on 20,000 images: noise 0.335 < 1.27, and two points: improving
    assert vd.verdict(rows, 64, 20000).code == vd.IMPROVING


def test_trend__the_noise_floor_widens_the_band():
    # gain 39, 10 % = 3.9: the last point (38) is below 44 - 3.9 = 40.1, worse after epoch 2
    epochs, values = [0, 1, 2, 3], [5.0, 40.0, 44.0, 38.0]
    assert vd.trend(epochs, values) == (vd.WORSE, 2)
    # on 100 images, a difference of two points at 44 %: 2 sqrt(2) 100 sqrt(0.44 0.56 / 100)
    # = 14.04 points; 38 and 40 lie within 44 - 14.04: plateaued since epoch 1
    floor = vd.noise(44.0, 44.0, 100)
    assert floor == pytest.approx(2 * 2 ** 0.5 * 100 * (0.44 * 0.56 / 100) ** 0.5)
    assert vd.trend(epochs, values, noise_floor=floor) == (vd.PLATEAU, 1)
    rows = [{"epoch": e, "rankme": 50.0, "view_top1": x} for e, x in zip(epochs, values)]
    assert (vd.verdict(rows, 64, 100).code, vd.verdict(rows, 64, 100).epoch) == (vd.PLATEAU, 1)
    v = vd.verdict(rows, 64, 100_000)  # noise 0.44 < 3.9: the fraction decides
    assert (v.code, v.epoch) == (vd.WORSE, 2)
    says(v.why, "epoch 0 5 %", "epoch 3 38 %")  # every point named by its epoch


def test_verdict__the_default_run_plateaued_since_epoch_5():
    # the committed default run's monitor (plots/labelfree.tsv, 2,048 images, D = 256): view
    # top-1 4.96 -> 63.0 at epoch 7, gain 58.0, tol max(5.80, 2 sqrt(2) 100 sqrt(0.63 0.37 /
    # 2048) = 3.02) = 5.80; epoch 5 (57.4) is within 63.0 - 5.80 = 57.2, epoch 4 (50.9) is not
    from pipeline.codegraph import REPO

    lines = (REPO / "plots/labelfree.tsv").read_text().splitlines()
    head = lines[0].split("\t")
    rows = [dict(zip(head, map(float, r.split("\t")))) for r in lines[1:]]
    assert [r["epoch"] for r in rows] == list(range(8))
    assert rows[5]["view_top1"] > rows[-1]["view_top1"] - 5.80 > rows[4]["view_top1"]
    v = vd.verdict(rows, 256, 2048)
    assert (v.code, v.epoch, v.text) == (vd.PLATEAU, 5, "plateaued since epoch 5")


def test_collapse_threshold__absolute_floor_and_share_of_the_rank():
    assert vd.collapse_threshold(32) == 2.0  # 0.03 * 32 = 0.96 < 2
    assert vd.collapse_threshold(256) == pytest.approx(7.68)  # 0.03 * 256
    assert vd.collapse_reason({"rankme": 7.0}, 256) is not None
    assert vd.collapse_reason({"rankme": 8.0}, 256) is None


class Constant(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.arange(1.0, d + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v.expand(x.shape[0], -1)


class RankOne(nn.Module):
    """The backbone's features projected onto one direction: every output on one line."""

    def __init__(self, backbone: nn.Module, d: int) -> None:
        super().__init__()
        self.backbone, self.u = backbone, nn.Parameter(torch.ones(d) / d ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.backbone(x) @ self.u)[:, None] * self.u


@pytest.fixture(scope="module")
def probe_and_init(tmp_path_factory):
    shards = build_tiny_shards(tmp_path_factory.mktemp("v") / "s")
    probe = LabelFreeProbe(shards / "pretrain", image_size=16, mean=[0.4], std=[0.3],
                           preset="v2_grey", crop_min_scale=0.2, device=torch.device("cpu"),
                           n=64)
    torch.manual_seed(0)
    init = build_backbone("resnet18", width=4, in_channels=1, small_stem=True, stem_stride=2)
    init.fc = nn.Identity()
    return shards, probe, init


def test_verdict__encoders_known_by_construction(probe_and_init):
    _, probe, init = probe_and_init
    d = 32  # width 4: 8 x 4 channels in the last stage
    max_rank = min(len(probe), d)
    init_row = {"epoch": 0, **probe(init)}
    assert init_row["rankme"] > vd.collapse_threshold(max_rank)  # a random init is no collapse
    for name, net in (("constant", Constant(d)), ("rank-1", RankOne(init, d))):
        end = {"epoch": 2, **probe(net)}
        v = vd.verdict([init_row, end], max_rank, len(probe))
        assert (v.code, v.text) == (vd.COLLAPSED, "collapsed"), name
        says(v.why, "RankMe 1.00", "< 2", "of at most 32")
    # the random init itself at the end: no gain at all
    v = vd.verdict([init_row, {**init_row, "epoch": 2}], max_rank, len(probe))
    assert (v.code, v.metrics()) == (vd.NO_BETTER, {"verdict_code": 3, "verdict_epoch": -1})
    assert vd.verdict([init_row], max_rank, len(probe)) is None  # one point: nothing to compare
    assert vd.verdict([{**init_row, "epoch": 1}, init_row], max_rank, len(probe)) is None


def test_pretrain__trained_encoder_verdict_in_metrics_encoder_json_and_log(probe_and_init,
                                                                         tmp_path, caplog):
    shards, _, _ = probe_and_init
    over = {"pretrain": {"epochs": 3, "knn_every_epochs": 1, "knn_monitor_train_images": 32,
                         "knn_monitor_test_images": 16, "labelfree_images": 64}}
    with caplog.at_level("INFO", logger="pipeline.train.engine"):
        m = run_pretrain(shards, tmp_path, over, details_path=tmp_path / "details.json")
    lines = (tmp_path / "labelfree.tsv").read_text().splitlines()
    head = lines[0].split("\t")
    rows = [dict(zip(head, map(float, r.split("\t")))) for r in lines[1:]]
    # trained: its RankMe is above the random init's and far from a collapse
    assert rows[-1]["rankme"] > rows[0]["rankme"] > vd.collapse_threshold(32)
    # 3 tiny epochs move view top-1 by a view or two of 64 images: whatever the verdict (within
    # the noise: no better than random init), every place says the same
    expected = vd.verdict(rows, 32, 64)
    assert expected is not None
    assert (m["verdict_code"], m["verdict_epoch"]) == (expected.code, expected.epoch)
    # every number in eval/metrics/pretrain.json; the headline (metrics/pretrain.json) stays
    # small: the verdict is words in the log, encoder.json, MLflow and the report
    on_disk = json.loads((tmp_path / "details.json").read_text())
    assert (on_disk["verdict_code"], on_disk["verdict_epoch"]) == (expected.code, expected.epoch)
    assert "verdict_code" not in json.loads((tmp_path / "metrics.json").read_text())
    assert json.loads((tmp_path / "encoder.json").read_text())["verdict"] == expected.text
    says(caplog.text, f"pretrain verdict: {expected.text}")


def test_pretrain__changed_monitor_params_drop_the_rows_no_stale_verdict(probe_and_init, tmp_path,
                                                                        caplog):
    # a finished checkpoint reused with another labelfree_images: its rows measured 64 images,
    # so they are dropped, and the run says why it has no verdict instead of the old one
    shards, _, _ = probe_and_init
    over = {"pretrain": {"epochs": 1, "knn_every_epochs": 1, "knn_monitor_train_images": 32,
                         "knn_monitor_test_images": 16, "labelfree_images": 64}}
    first = run_pretrain(shards, tmp_path, over)
    assert "verdict_code" in first
    over["pretrain"]["labelfree_images"] = 96
    with caplog.at_level("INFO"):
        again = run_pretrain(shards, tmp_path, over)
    says(caplog.text, "finished training", "pretrain.labelfree_images: 64 -> 96", "dropped",
         "clean-checkpoints", "pretrain verdict: none")
    assert "verdict_code" not in again
    assert "verdict" not in json.loads((tmp_path / "encoder.json").read_text())
    lines = (tmp_path / "labelfree.tsv").read_text().splitlines()
    assert len(lines) <= 1  # the header at most: no row of the other definition


def test_pretrain__no_monitor_says_why_there_is_no_verdict(probe_and_init, tmp_path, caplog):
    shards, _, _ = probe_and_init
    with caplog.at_level("INFO", logger="pipeline.train.engine"):
        m = run_pretrain(shards, tmp_path, {"pretrain": {"epochs": 1, "knn_every_epochs": 0}})
    says(caplog.text, "pretrain verdict: none", "pretrain.knn_every_epochs is 0")
    assert "verdict_code" not in m


def test_pretrain__collapse_is_a_warning_at_the_monitor_point(probe_and_init, tmp_path, caplog,
                                                              monkeypatch):
    # a threshold no encoder can pass stands for a collapsed encoder: the warning names the
    # epoch at each monitor point, and the verdict is "collapsed"
    shards, _, _ = probe_and_init
    monkeypatch.setattr(vd, "COLLAPSE_MIN_RANKME", 1e9)
    over = {"pretrain": {"epochs": 1, "knn_every_epochs": 1, "knn_monitor_train_images": 32,
                         "knn_monitor_test_images": 16, "labelfree_images": 64}}
    with caplog.at_level("INFO", logger="pipeline.train.engine"):
        m = run_pretrain(shards, tmp_path, over)
    says(caplog.text, "looks collapsed after epoch 0", "looks collapsed after epoch 1",
         "pretrain verdict: collapsed")
    assert m["verdict_code"] == vd.COLLAPSED
