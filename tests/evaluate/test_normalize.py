"""The one L2 normalisation of the evaluation code: overflow-safe, direction kept."""

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.evaluate.knn import knn_classify, knn_neighbours
from pipeline.evaluate.linear import _normalize
from pipeline.evaluate.normalize import l2_normalize


def test_l2_normalize__1e20_row__unit_not_zeros():
    # (3e20, 4e20) has norm 5e20: its squares (1.6e41) overflow fp32, so F.normalize gives 0s
    x = torch.tensor([[3e20, 4e20], [0.0, 0.0], [3e-30, 4e-30]])
    assert F.normalize(x, dim=1)[0].tolist() == [0.0, 0.0]
    out = l2_normalize(x)
    assert out.dtype == torch.float32
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8]))  # 3/5, 4/5
    assert out[1].tolist() == [0.0, 0.0]  # zero row stays zero
    assert torch.allclose(out[2], torch.tensor([0.6, 0.8]))  # and a tiny row is unit too


def test_l2_normalize__nan_or_inf_row__nan_so_checks_see_it():
    out = l2_normalize(torch.tensor([[float("nan"), 1.0], [float("inf"), 1.0], [1.0, 0.0]]))
    assert torch.isnan(out[0]).any() and torch.isnan(out[1]).any()
    assert out[2].tolist() == [1.0, 0.0]


def test_knn_neighbours__1e20_norm_neighbour__found():
    # bank row 0 = (1e20, 0): the direction (1, 0), norm 1e20; row 1 = (0.6, 0.8).
    # query (1, 0.1): cos with row 0 = 1 / sqrt(1.01) = 0.99504, with row 1
    # = (0.6 + 0.08) / sqrt(1.01) = 0.67663. Row 0 is the nearest; an fp32 norm of row 0
    # overflows (1e40 > 3.4e38), turns it into zeros (cosine 0) and row 1 would win.
    bank = torch.tensor([[1e20, 0.0], [0.6, 0.8]])
    sim, idx = knn_neighbours(bank, torch.tensor([[1.0, 0.1]]), k=2)
    assert idx.tolist() == [[0, 1]]
    assert math.isclose(sim[0, 0].item(), 1 / math.sqrt(1.01), rel_tol=1e-6)
    assert math.isclose(sim[0, 1].item(), 0.68 / math.sqrt(1.01), rel_tol=1e-6)
    res = knn_classify(bank, torch.tensor([7, 3]), torch.tensor([[1.0, 0.1]]),
                       torch.tensor([7]), k=1)
    assert res.top1 == 100.0  # the 1e20 neighbour's label 7 is predicted


def test_linear_feature_norm_l2__shares_the_overflow_safe_normalisation():
    x = torch.tensor([[3e20, 4e20]])
    assert torch.allclose(_normalize(x, "l2"), torch.tensor([[0.6, 0.8]]))
    assert _normalize(x, "none") is x


@pytest.mark.parametrize("n, d, rows", [(11, 7, 4), (3000, 512, 1000)])
def test_l2_normalize_rows__blocks_give_the_whole_matrix_bits(n, d, rows):
    from pipeline.evaluate.normalize import l2_normalize_rows

    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    x[0] *= 1e20  # overflow-safe like the whole-matrix call
    x[1] = 0.0  # a zero row stays zero
    want = l2_normalize(x.float())
    got = l2_normalize_rows(x, "cpu", rows=rows)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.allclose(got[2:].double().norm(dim=1), torch.ones(n - 2, dtype=torch.float64))


def test_l2_normalize_rows__gathers_checks_and_fills_a_file_backed_output(tmp_path, monkeypatch):
    import tempfile

    from pipeline.evaluate.features import file_backed
    from pipeline.evaluate.normalize import l2_normalize_rows

    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(3))
    index = torch.tensor([7, 2, 2, 9, 0])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # TMPDIR for the scratch file
    out = file_backed(None, len(index), 6)
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing left behind
    assert torch.equal(out, torch.zeros(5, 6))  # zeroed
    got = l2_normalize_rows(x, "cpu", rows=2, index=index, error="bad", out=out)
    assert got is out
    assert torch.equal(got, l2_normalize(x[index]))  # the gathered rows, normalised one by one
    x[9, 3] = float("nan")  # row 9 is taken (4th): named by the caller's message
    with pytest.raises(ValueError, match="bad"):
        l2_normalize_rows(x, "cpu", rows=2, index=index, error="bad")
    assert torch.isnan(l2_normalize_rows(x, "cpu", index=index)[3]).all()  # no check asked
