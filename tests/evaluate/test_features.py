import pytest
import torch
from torch import nn

from pipeline.evaluate.features import (
    FeatureSet,
    extract_features,
    file_backed,
    load_features,
    save_features,
)


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )  # (B, 1, 6, 6) -> (B, 4)


def _batches(sizes=(3, 1, 2)):
    g = torch.Generator().manual_seed(1)
    out, start = [], 0
    for b in sizes:
        x = torch.randn(b, 1, 6, 6, generator=g)
        y = torch.arange(start, start + b) % 3
        out.append((x, y, [f"img{i:03d}" for i in range(start, start + b)]))
        start += b
    return out


def test_extract_features__shapes_order_keys_and_eval_mode():
    model, batches = _tiny_model(), _batches()
    model.train()
    model[1].eval()  # a mixed-mode model: the BN alone is in eval mode
    bn_before = model[1].running_mean.clone()
    fs = extract_features(model, batches, device="cpu", progress=False)
    assert fs.features.shape == (6, 4) and fs.features.dtype == torch.float32
    assert fs.labels.dtype == torch.int64 and fs.labels.tolist() == [0, 1, 2, 0, 1, 2]
    assert fs.keys == [f"img{i:03d}" for i in range(6)]
    # independent: eval-mode forward of each batch, concatenated in order
    model.eval()
    with torch.no_grad():
        expected = torch.cat([model(x) for x, _, _ in batches])
    torch.testing.assert_close(fs.features, expected)
    assert torch.equal(model[1].running_mean, bn_before)  # eval mode: BN stats untouched


def test_extract_features__rows_in_place_and_file_backed(tmp_path):
    model, batches = _tiny_model(), _batches()
    listed = extract_features(model, batches, device="cpu", progress=False)
    in_place = extract_features(model, batches, device="cpu", progress=False, rows=6)
    assert torch.equal(in_place.features, listed.features) and in_place.keys == listed.keys
    made = []

    def allocate(n, d):
        made.append((n, d))
        return file_backed(tmp_path / "f.rows", n, d)

    backed = extract_features(model, batches, device="cpu", progress=False, rows=6,
                              allocate=allocate)
    assert made == [(6, 4)] and torch.equal(backed.features, listed.features)
    # the file holds the rows, fp32 little-endian, row after row
    raw = torch.frombuffer(bytearray((tmp_path / "f.rows").read_bytes()), dtype=torch.float32)
    assert torch.equal(raw.view(6, 4), listed.features)
    save_features(backed, tmp_path / "f.pt")  # saved from the mapping: the same file as ever
    save_features(listed, tmp_path / "g.pt")
    assert (tmp_path / "f.pt").read_bytes() == (tmp_path / "g.pt").read_bytes()
    for rows, msg in ((5, "more than the 5"), (7, "6 images, 7 expected")):
        with pytest.raises(ValueError, match=msg):
            extract_features(model, batches, device="cpu", progress=False, rows=rows)


def test_extract_features__restores_each_submodule_mode():
    model = _tiny_model().train()
    model[1].eval()
    extract_features(model, _batches(), device="cpu", progress=False)
    assert [m.training for m in model] == [True, False, True, True, True]
    assert model.training


def test_extract_features__head_applied_and_output_cast_to_fp32():
    model, head = _tiny_model(), nn.Linear(4, 2).double()
    model.double()
    batches = [(x.double(), y, k) for x, y, k in _batches()]
    fs = extract_features(model, batches, device="cpu", head=head, progress=False)
    assert fs.features.shape == (6, 2) and fs.features.dtype == torch.float32
    with torch.no_grad():
        expected = head(model.eval()(batches[0][0])).float()
    torch.testing.assert_close(fs.features[:3], expected)


def test_extract_features__bad_output_or_batch_raises_and_restores_mode():
    model = nn.Sequential(nn.Conv2d(1, 2, 3)).train()  # (B, 2, 4, 4): not (B, D)
    with pytest.raises(ValueError, match=r"expected \(B, D\)"):
        extract_features(model, _batches(), device="cpu", progress=False)
    assert model.training and model[0].training
    x, y, k = _batches()[0]
    with pytest.raises(ValueError, match="2 keys"):
        extract_features(_tiny_model(), [(x, y, k[:2])], device="cpu", progress=False)
    with pytest.raises(ValueError, match="no batches"):
        extract_features(_tiny_model(), [], device="cpu", progress=False)


def test_save_features__roundtrip_atomic_and_byte_identical(tmp_path):
    fs = FeatureSet(torch.randn(5, 3), torch.tensor([4, 0, 1, 1, 9]), list("abcde"))
    save_features(fs, tmp_path / "f.pt")
    first = (tmp_path / "f.pt").read_bytes()
    save_features(fs, tmp_path / "f.pt")  # overwrite in place
    assert (tmp_path / "f.pt").read_bytes() == first  # reproducible bytes (DVC-friendly)
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"]  # no temporary file left behind
    back = load_features(tmp_path / "f.pt")
    assert torch.equal(back.features, fs.features) and torch.equal(back.labels, fs.labels)
    assert back.keys == fs.keys


def test_load_features__invalid_files_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_features(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    torch.save({"format_version": 1, "features": torch.zeros(3, 2),
                "labels": torch.zeros(4, dtype=torch.long), "keys": list("abc")}, bad)
    with pytest.raises(ValueError, match=r"bad\.pt: 'labels' must be an \(N,\) = \(3,\)"):
        load_features(bad)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="junk.pt"):
        load_features(junk)


def test_feature_set__validates_and_subsets():
    with pytest.raises(ValueError, match="float32"):
        FeatureSet(torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.long),
                   ["a", "b"])
    with pytest.raises(ValueError, match="keys"):
        FeatureSet(torch.zeros(2, 2), torch.zeros(2, dtype=torch.long), ["a"])
    fs = FeatureSet(torch.arange(6.0).reshape(3, 2), torch.tensor([5, 6, 7]), ["a", "b", "c"])
    sub = fs.subset([2, 0])
    assert sub.keys == ["c", "a"] and sub.labels.tolist() == [7, 5]
    assert sub.features.tolist() == [[4.0, 5.0], [0.0, 1.0]]
