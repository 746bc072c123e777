"""Near-duplicates and outliers: the blocked self-search against an (N, N) brute force."""

import math

import pytest
import torch

from pipeline.evaluate.insights import duplicate_pairs, find_neighbourhoods
from pipeline.evaluate.knn import self_neighbours


def _brute_force(x: torch.Tensor, k: int):
    """Float64 cosine matrix, own entry excluded, full sort: neighbours, pairs, scores."""
    xn = x.double() / x.double().norm(dim=1, keepdim=True)
    cos = xn @ xn.T  # N x N: the matrix the blocked search never builds
    cos.fill_diagonal_(-math.inf)
    sim, idx = cos.sort(dim=1, descending=True)
    return cos, sim[:, :k], idx[:, :k]


def _random(n, d, seed):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block_size", [16, 1, 103, 500])  # 103 rows: 16 divides nothing
def test_self_neighbours__equals_brute_force(block_size):
    x = _random(103, 6, 0) * torch.rand(103, 1, generator=torch.Generator().manual_seed(1)) * 9
    _, ref_sim, ref_idx = _brute_force(x, 5)
    sim, idx = self_neighbours(x, k=5, block_size=block_size)
    assert idx.tolist() == ref_idx.tolist()
    torch.testing.assert_close(sim.double(), ref_sim, atol=1e-6, rtol=0)
    assert not (idx == torch.arange(103)[:, None]).any()  # never the row itself


def test_find_neighbourhoods__same_pairs_and_outliers_as_brute_force():
    # 4-d directions: many close pairs. The reference takes EVERY pair above the threshold
    # from the full matrix; that equals the top-k definition while no row has more than k
    # such pairs, which the test checks first.
    x, k, thr = _random(211, 4, 2), 6, 0.97
    cos, ref_sim, _ = _brute_force(x, k)
    above = torch.triu(cos >= thr, diagonal=1)
    assert (above | above.T).sum(dim=1).max() <= k and int(above.sum()) >= 20
    ref_pairs = sorted(((float(cos[i, j]), i, j) for i, j in above.nonzero().tolist()),
                       key=lambda t: (-t[0], t[1], t[2]))
    ref_score = ref_sim.mean(dim=1)
    nb = find_neighbourhoods(x, duplicate_cosine=thr, k=k, block_size=50)  # 50 ∤ 211
    assert nb.pairs.tolist() == [[i, j] for _, i, j in ref_pairs]
    torch.testing.assert_close(nb.pair_cosine.double(), torch.tensor([c for c, _, _ in ref_pairs],
                                                                      dtype=torch.float64),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(nb.outlier_score.double(), ref_score, atol=1e-6, rtol=0)
    assert nb.outliers(10).tolist() == ref_score.argsort()[:10].tolist()
    assert nb.images_in_pairs() == len({r for _, i, j in ref_pairs for r in (i, j)})


def test_find_neighbourhoods__hand_example():
    # x0 = (1, 0), x1 = (0.8, 0.6), x2 = (0, 1), x3 = (-1, 0); cosines by hand:
    # c01 = 0.8, c02 = 0, c03 = -1, c12 = 0.6, c13 = -0.8, c23 = 0.
    # k = 1: nearest of x0 is x1 (0.8), of x1 is x0 (0.8), of x2 is x1 (0.6), of x3 is x2 (0).
    # Threshold 0.7: only {0, 1}. Outlier scores [0.8, 0.8, 0.6, 0.0]: x3 first, then x2.
    x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]])
    nb = find_neighbourhoods(x, duplicate_cosine=0.7, k=1, block_size=3)
    assert nb.pairs.tolist() == [[0, 1]]
    torch.testing.assert_close(nb.pair_cosine, torch.tensor([0.8]))
    torch.testing.assert_close(nb.outlier_score, torch.tensor([0.8, 0.8, 0.6, 0.0]))
    assert nb.outliers(2).tolist() == [3, 2] and nb.outliers(99).tolist() == [3, 2, 0, 1]


def test_duplicate_pairs__each_pair_once_and_copies_grouped():
    # three identical rows (0, 1, 2) and one elsewhere: the group gives its 3 pairs, each once,
    # though every pair is seen from both of its rows; ties ordered by (i, j)
    x = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [1.0, -1.0]])
    sim, idx = self_neighbours(x, k=2, block_size=2)
    pairs, cos = duplicate_pairs(sim, idx, 0.99)
    assert pairs.tolist() == [[0, 1], [0, 2], [1, 2]]
    torch.testing.assert_close(cos, torch.ones(3))


def test_find_neighbourhoods__k_capped_and_bad_input():
    x = _random(5, 3, 0)
    assert find_neighbourhoods(x, duplicate_cosine=0.9, k=50).k == 4  # N - 1 others
    with pytest.raises(ValueError, match="N >= 2"):
        find_neighbourhoods(x[:1], duplicate_cosine=0.9, k=1)
    with pytest.raises(ValueError, match="duplicate_cosine"):
        find_neighbourhoods(x, duplicate_cosine=1.5, k=1)
    with pytest.raises(ValueError, match="cannot give k = 5"):
        self_neighbours(x, k=5)
    x[2, 1] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        find_neighbourhoods(x, duplicate_cosine=0.9, k=2)
