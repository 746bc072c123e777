"""Near-duplicates and outliers: the blocked self-search against an (N, N) brute force, the
outlier views worked out by hand, and planted odd rows that must come first."""

import math

import pytest
import torch

from pipeline.evaluate.insights import (
    channel_statistics,
    duplicate_pairs,
    find_neighbourhoods,
    pixel_statistics,
    robust_z,
)
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
    torch.testing.assert_close(nb.mean_cosine.double(), ref_score, atol=1e-6, rtol=0)
    # the embedding view alone: its z-score falls as the mean cosine rises, so the order is the
    # mean cosine's, lowest first
    assert nb.view_names == ("embedding",)
    assert nb.outliers(10).tolist() == ref_score.argsort()[:10].tolist()
    assert nb.images_in_pairs() == len({r for _, i, j in ref_pairs for r in (i, j)})


def test_find_neighbourhoods__hand_example():
    # x0 = (1, 0), x1 = (0.8, 0.6), x2 = (0, 1), x3 = (-1, 0); cosines by hand:
    # c01 = 0.8, c02 = 0, c03 = -1, c12 = 0.6, c13 = -0.8, c23 = 0.
    # k = 1: nearest of x0 is x1 (0.8), of x1 is x0 (0.8), of x2 is x1 (0.6), of x3 is x2 (0).
    # Threshold 0.7: only {0, 1}. Mean cosines [0.8, 0.8, 0.6, 0.0]: x3 first, then x2.
    # Embedding z of 1 - cosine = [0.2, 0.2, 0.4, 1.0]: median 0.2 (the lower middle value),
    # deviations [0, 0, 0.2, 0.8], MAD 0 -> mean deviation 0.25 x 1.2533 = 0.313325:
    # z = [0, 0, 0.2 / 0.313325, 0.8 / 0.313325] = [0, 0, 0.63831, 2.55326].
    x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]])
    nb = find_neighbourhoods(x, duplicate_cosine=0.7, k=1, block_size=3)
    assert nb.pairs.tolist() == [[0, 1]]
    torch.testing.assert_close(nb.pair_cosine, torch.tensor([0.8]))
    torch.testing.assert_close(nb.mean_cosine, torch.tensor([0.8, 0.8, 0.6, 0.0]))
    torch.testing.assert_close(nb.outlier_score, torch.tensor([0.0, 0.0, 0.63831, 2.55326]),
                               atol=1e-5, rtol=0)
    assert nb.outliers(2).tolist() == [3, 2] and nb.outliers(99).tolist() == [3, 2, 0, 1]
    assert nb.reasons(torch.tensor([3, 0])) == ["embedding", "embedding"]


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


def test_robust_z__by_hand():
    # [1, 2, 3, 4, 100]: median 3, deviations [2, 1, 0, 1, 97], MAD 1 -> scale 1.4826
    z = robust_z(torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0]))
    torch.testing.assert_close(z, torch.tensor([-2, -1, 0, 1, 97]) / 1.4826)
    # more than half equal: MAD 0, mean deviation (0 + 0 + 0 + 4) / 4 = 1 -> scale 1.2533
    z = robust_z(torch.tensor([5.0, 5.0, 5.0, 9.0]))
    torch.testing.assert_close(z, torch.tensor([0, 0, 0, 4 / 1.2533]))
    assert robust_z(torch.full((3,), 7.0)).tolist() == [0.0, 0.0, 0.0]  # no spread: no outlier


def test_pixel_statistics__by_hand():
    # grey 2 x 2 [[0, 1], [0, 1]]: pixels 0, 1, 0, 1 -> std 0.5; right neighbours (1, 1) vs
    # (0, 0): constant, correlation 0; lower neighbours (0, 1) vs (0, 1): 1; mean 0.5. Bins of
    # 0.05: 0 and 20, two pixels each: share 0.5.
    # 2 x 2 checkerboard [[0, 1], [1, 0]]: both neighbour correlations -1. Constant: 0, 1, 1.
    # RGB [[0, 1], [0, 1]] in every channel: the grey image is the same as the first one.
    stripes = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    checker = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    grey = torch.stack([stripes, checker, torch.full((2, 2), 0.3)])[:, None]  # (3, 1, 2, 2)
    torch.testing.assert_close(pixel_statistics(grey), torch.tensor(
        [[0.5, 0.5, 0.5], [0.5, -1.0, 0.5], [0.0, 1.0, 1.0]]))
    torch.testing.assert_close(pixel_statistics(stripes.expand(1, 3, 2, 2)),
                               torch.tensor([[0.5, 0.5, 0.5]]))
    with pytest.raises(ValueError, match=r"H, W >= 2, got \(1, 1, 1, 5\)"):
        pixel_statistics(torch.zeros(1, 1, 1, 5))


def test_channel_statistics__by_hand():
    maps = torch.tensor([[[[1.0, 3.0]], [[2.0, 2.0]]]])  # (1, 2, 1, 2)
    assert channel_statistics(maps).tolist() == [[2.0, 2.0, 1.0, 0.0]]  # means, then stds


def _clusters(seed: int) -> torch.Tensor:
    """60 rows in 3 tight clusters of 20 around orthogonal directions of 8-d space."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.eye(8)[:3] * 10
    return centres.repeat_interleave(20, dim=0) + 0.1 * torch.randn(60, 8, generator=g)


def test_outliers__isolated_rows_of_each_view_rank_first():
    # Rows 0-59: three tight clusters in both the embedding and the first-stage statistics.
    # Row 60 sits in the middle of cluster 0 in the embedding but alone in the first-stage
    # statistics (direction 7); row 61 the other way round (direction 6 in the embedding);
    # row 62 is in cluster 1 in both. Mean cosine to 5 neighbours: ~1 inside a cluster, ~0 for
    # the isolated rows (nothing else points along 6 or 7), so each isolated row is the only
    # one far out in its view and both lead, each with its view as the reason; with the
    # embedding alone (the score before the other views) row 60 is a cluster member.
    emb = torch.cat([_clusters(0), torch.eye(8)[[0, 6, 1]] * 10])
    low = torch.cat([_clusters(1), torch.eye(8)[[7, 2, 1]] * 10])
    nb = find_neighbourhoods(emb, duplicate_cosine=0.9999, k=5, low_level=low)
    assert nb.view_names == ("embedding", "low_level")
    assert sorted(nb.outliers(2).tolist()) == [60, 61]
    assert nb.reasons(torch.tensor([60, 61])) == ["low_level", "embedding"]
    alone = find_neighbourhoods(emb, duplicate_cosine=0.9999, k=5)
    assert alone.outliers(1).tolist() == [61] and 60 not in alone.outliers(10).tolist()


def _natural(n: int, seed: int) -> torch.Tensor:
    """(n, 1, 16, 16) smooth random images: 4 x 4 random levels, bilinearly upsampled."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand(n, 1, 4, 4, generator=g) * 2 - 1
    return torch.nn.functional.interpolate(small, size=16, mode="bilinear", align_corners=True)


def test_outliers__constant_and_noise_images_rank_first_by_their_pixels():
    # 40 smooth images (spread ~0.3, neighbour correlation ~0.95, no flat area) plus a constant
    # image (row 40: spread 0) and pixel noise (row 41: correlation ~0). Their embeddings sit
    # in the middle of a cluster of the others (a weakly trained encoder), so only the pixel
    # views can find them: near-constant (or its full flat area) and noise-like.
    g = torch.Generator().manual_seed(3)
    images = torch.cat([_natural(40, 2), torch.full((1, 1, 16, 16), 0.2),
                        torch.rand(1, 1, 16, 16, generator=g) * 2 - 1])
    emb = torch.ones(42, 4) + 0.05 * torch.randn(42, 4, generator=g)
    emb[40:] = 1.0  # the mean of the cloud: the densest place
    nb = find_neighbourhoods(emb, duplicate_cosine=0.9999, k=5, pixels=pixel_statistics(images))
    assert sorted(nb.outliers(2).tolist()) == [40, 41]
    why = dict(zip([40, 41], nb.reasons(torch.tensor([40, 41]))))
    assert why[40] in ("near_constant", "flat_area") and why[41] == "noise_like"
    by_embedding = torch.argsort(-nb.views[:, 0], stable=True).tolist()
    assert by_embedding.index(40) >= 30 and by_embedding.index(41) >= 30  # hidden there


def test_find_neighbourhoods__views_must_have_a_row_per_image():
    x = _random(5, 3, 0)
    with pytest.raises(ValueError, match=r"pixels must be \(5, \*\) like features, got \(4, 3\)"):
        find_neighbourhoods(x, duplicate_cosine=0.9, k=2, pixels=torch.zeros(4, 3))
