"""The augment-mode linear probe on real shards: a new order every epoch, workers decode."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipeline.config import LinearParams
from pipeline.evaluate.features import load_features
from pipeline.evaluate.heldout import split_train_val
from pipeline.evaluate.run import linear as run
from pipeline.evaluate.run.embed import embed
from pipeline.moco.backbones import build_backbone


@pytest.fixture(scope="module")
def probe_inputs(tiny_shards, tmp_path_factory) -> tuple[Path, Path]:
    """A random width-4 ResNet-18 exported like the pretrain stage, and its embed features."""
    out = tmp_path_factory.mktemp("probe")
    torch.manual_seed(0)
    bb = build_backbone("resnet18", width=4, in_channels=1, small_stem=True)
    sd = {k: v for k, v in bb.state_dict().items() if not k.startswith("fc.")}
    torch.save(sd, out / "encoder.pt")
    (out / "encoder.json").write_text(json.dumps({
        "backbone": "resnet18", "width": 4, "in_channels": 1, "small_stem": True,
        "image_size": 16, "num_features": bb.num_features}))
    embed(encoder_path=out / "encoder.pt", shards_dir=tiny_shards, out_dir=out / "features",
          batch_size=32)
    return out, out / "features"


def _capture(monkeypatch) -> dict:
    """Replace the training loop by one that keeps its data callables (and the loader calls)."""
    got: dict = {"loader_kwargs": []}
    real_loader = run.train_loader

    def spy_loader(*a, **kw):
        got["loader_kwargs"].append(kw)
        return real_loader(*a, **kw)

    def fake_train(backbone, train_batches, test, **kw):
        got["train_batches"], got["val_batches"] = train_batches, kw["val_batches"]
        raise StopIteration  # nothing else to run

    monkeypatch.setattr(run, "train_loader", spy_loader)
    monkeypatch.setattr(run, "train_linear_augment", fake_train)
    return got


def test_linear_augment__reshuffles_every_epoch_in_workers_and_holds_out_val(
        tiny_shards, probe_inputs, monkeypatch):
    enc_dir, feat_dir = probe_inputs
    got = _capture(monkeypatch)
    lin = LinearParams(mode="augment", epochs=2, batch_size=32, val_fraction=0.25)
    with pytest.raises(StopIteration):
        run._linear_augment(shards_dir=tiny_shards, encoder_path=enc_dir / "encoder.pt",
                            features_dir=feat_dir, linear=lin, num_classes=4, settings={},
                            seed=3)
    feats = load_features(feat_dir / "train.pt")
    _, val = split_train_val(96, 0.25, 3)  # the features mode's split: 24 of 96 held out
    val_keys = {feats.keys[i] for i in val.tolist()}
    train_labels = Counter(y for k, y in zip(feats.keys, feats.labels.tolist())
                           if k not in val_keys)
    epochs = [list(got["train_batches"](e)) for e in (0, 1)]
    for batches in epochs:
        ys = torch.cat([y for _, y in batches]).tolist()
        # 96 // 32 = 3 loader batches = every image once; the 24 validation rows are dropped
        assert len(ys) == 72 and Counter(ys) == train_labels
        assert all(x.shape[1:] == (1, 16, 16) and x.dtype == torch.float32 for x, _ in batches)
    labels = [torch.cat([y for _, y in b]).tolist() for b in epochs]
    assert labels[0] != labels[1]  # a new order each epoch
    again = list(got["train_batches"](0))  # and the same order for the same (seed, epoch)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(epochs[0], again))
    assert {kw["num_workers"] for kw in got["loader_kwargs"]} == {run.AUGMENT_NUM_WORKERS}
    assert run.AUGMENT_NUM_WORKERS >= 1  # decoding happens in worker processes
    assert [kw["epoch"] for kw in got["loader_kwargs"]] == [0, 1, 0]
    val_rows = sum(len(y) for _, y in got["val_batches"]())
    assert val_rows == 24


def _top1_by_hand(state: dict, fs) -> float:
    """Accuracy of a trained ``nn.Linear`` state on L2-normalised features, worked out here."""
    logits = torch.nn.functional.normalize(fs.features, dim=1) @ state["weight"].T + state["bias"]
    return 100.0 * (logits.argmax(1) == fs.labels).double().mean().item()


def test_linear_probe__augment_mode_end_to_end(tiny_shards, probe_inputs, tmp_path, monkeypatch):
    enc_dir, feat_dir = probe_inputs
    real, trained = run.train_linear_augment, []
    monkeypatch.setattr(run, "train_linear_augment",
                        lambda *a, **kw: trained.append(real(*a, **kw)) or trained[-1])
    lin = LinearParams(mode="augment", epochs=2, batch_size=32, val_fraction=0.25,
                       lr_milestones=[1])
    out = run.linear_probe(features_dir=feat_dir, shards_dir=tiny_shards,
                           encoder_path=enc_dir / "encoder.pt", linear=lin, seed=0,
                           details_path=tmp_path / "d.json", plots_path=tmp_path / "p.tsv")
    assert out["mode_augment"] == 1
    assert len((tmp_path / "p.tsv").read_text().splitlines()) == 3  # header + 2 epochs
    # the reported numbers are the FINAL classifier on the test split and on the held-out 24
    # train rows: recomputed from its weights on the embed features (the same frozen backbone
    # through the same eval transform that augment mode scores with)
    (state,) = [r.classifier_state for r in trained]
    test, train = load_features(feat_dir / "test.pt"), load_features(feat_dir / "train.pt")
    assert out["top1"] == pytest.approx(_top1_by_hand(state, test))
    _, val = split_train_val(96, 0.25, 0)
    assert out["val_top1"] == pytest.approx(_top1_by_hand(state, train.subset(val)))
    confusion = json.loads((tmp_path / "d.json").read_text())["confusion_matrix"]
    assert [sum(row) for row in confusion] == [12] * 4  # 48 test images, 12 per class
