import numpy as np
import pytest
import torch
from PIL import Image
from reporthelpers import CLASS_NAMES, features

from pipeline.report import figures as fg


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
    # query (1, 1, 1) against (1, 0, 0), (1, 1, 0), (1, 1, 1): cosines 1/sqrt(3), 2/sqrt(6), 1;
    # k = 10 clipped to the 3 bank rows, most similar first
    bank = torch.tensor([[1.0, 0, 0], [1, 1, 0], [1, 1, 1]])
    idx, sim = fg.nearest_neighbours(torch.ones(2, 3), bank, 10)
    assert idx.tolist() == [[2, 1, 0]] * 2
    want = [1.0, 2 / 6**0.5, 1 / 3**0.5]
    assert np.allclose(sim.numpy(), [want, want], atol=1e-6)
    with pytest.raises(ValueError, match="k must be"):
        fg.nearest_neighbours(torch.ones(2, 3), torch.eye(3), 0)


def test_seeded_subsample__distinct_sorted_reproducible():
    a = fg.seeded_subsample(100, 10, seed=5)
    assert len(set(a.tolist())) == 10 and a.tolist() == sorted(a.tolist())
    assert a.tolist() == fg.seeded_subsample(100, 10, seed=5).tolist()
    assert fg.seeded_subsample(4, 10, seed=5).tolist() == [0, 1, 2, 3]


def test_plot_tsne__skipped_below_minimum(tmp_path):
    feats, labels = features(30, 0)
    assert (
        fg.plot_tsne(feats, labels, CLASS_NAMES, tmp_path / "t.png", num_points=0, seed=0) is None
    )
    assert (
        fg.plot_tsne(feats, labels, CLASS_NAMES, tmp_path / "t.png", num_points=9, seed=0) is None
    )
    assert not (tmp_path / "t.png").exists()


def test_plot_per_class_accuracy__class_absent_from_test_set(tmp_path):
    # a class absent from the test set has no accuracy (NaN): no bar, still a valid PNG
    path = fg.plot_per_class_accuracy(
        CLASS_NAMES, {"kNN": [70.0, float("nan"), 60.0]}, tmp_path / "p.png"
    )
    with Image.open(path) as png:
        png.load()  # decodes every byte: a truncated or broken file raises here
        # 3 classes: width max(6, 0.6 * 3 + 2) = 6 in, height 4 in, at the module's DPI
        assert (png.format, png.size) == ("PNG", (6 * fg.DPI, 4 * fg.DPI))
