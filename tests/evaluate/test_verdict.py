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
    assert "unlikely to help" not in text and "provisional" in text
    assert report_sentence({"rankme": 92.1}) is None  # a run without a verdict


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
        v = vd.verdict([init_row, end], max_rank)
        assert (v.code, v.text) == (vd.COLLAPSED, "collapsed"), name
        says(v.why, "RankMe 1.00", "< 2", "of at most 32")
    # the random init itself at the end: no gain at all
    v = vd.verdict([init_row, {**init_row, "epoch": 2}], max_rank)
    assert (v.code, v.metrics()) == (vd.NO_BETTER, {"verdict_code": 3, "verdict_epoch": -1})
    assert vd.verdict([init_row], max_rank) is None  # one point: nothing to compare
    assert vd.verdict([{**init_row, "epoch": 1}, init_row], max_rank) is None  # no init row


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
    expected = vd.verdict(rows, 32)
    assert expected.code in (vd.IMPROVING, vd.PLATEAU, vd.WORSE)
    assert (m["verdict_code"], m["verdict_epoch"]) == (expected.code, expected.epoch)
    # every number in eval/metrics/pretrain.json; the headline (metrics/pretrain.json) stays
    # small: the verdict is words in the log, encoder.json, MLflow and the report
    on_disk = json.loads((tmp_path / "details.json").read_text())
    assert (on_disk["verdict_code"], on_disk["verdict_epoch"]) == (expected.code, expected.epoch)
    assert "verdict_code" not in json.loads((tmp_path / "metrics.json").read_text())
    assert json.loads((tmp_path / "encoder.json").read_text())["verdict"] == expected.text
    says(caplog.text, f"pretrain verdict: {expected.text}")


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
