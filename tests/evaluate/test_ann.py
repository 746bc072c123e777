"""The approximate (HNSW) all-pairs searches: against an (N, N) float64 brute force, the own-row
rule worked out by hand, the thread count that must not matter, and the searches that must stay
exact."""

import math

import pytest
import torch

import pipeline.evaluate.ann as ann
from pipeline.evaluate.insights import duplicate_pairs
from pipeline.evaluate.knn import knn_neighbours, select_k_T, self_neighbours


def _clustered(n: int, d: int, seed: int) -> torch.Tensor:
    """``n`` rows around 20 centres (a set with structure, like features) + 5 exact copies."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(20, d, generator=g)
    x = centres[torch.randint(0, 20, (n,), generator=g)] + 0.4 * torch.randn(n, d, generator=g)
    x[n - 5:] = x[:5]  # rows 0-4 and n-5..n-1: exact copies (cosine 1)
    return x


def _brute(x: torch.Tensor, k: int, queries: torch.Tensor | None = None):
    """Float64 cosines, full sort; own entry excluded when ``queries`` is None."""
    xn = x.double() / x.double().norm(dim=1, keepdim=True)
    q = xn if queries is None else queries.double() / queries.double().norm(dim=1, keepdim=True)
    cos = q @ xn.T
    if queries is None:
        cos.fill_diagonal_(-math.inf)
    sim, idx = cos.sort(dim=1, descending=True)
    return cos, sim[:, :k], idx[:, :k]


def _recall(ref: torch.Tensor, got: torch.Tensor) -> float:
    return sum(len(set(a) & set(b)) for a, b in zip(ref.tolist(), got.tolist())) / ref.numel()


@pytest.fixture
def approximate_everything(monkeypatch):
    monkeypatch.setattr(ann, "EXACT_SEARCH_MAX_PAIRS", 0)


def test_approximate__only_on_a_cpu_past_the_threshold(monkeypatch):
    monkeypatch.setattr(ann, "EXACT_SEARCH_MAX_PAIRS", 100)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not ann.approximate(10, 10, cpu)  # 100 pairs: not past it
    assert ann.approximate(10, 11, cpu)
    assert not ann.approximate(10**6, 10**6, gpu)  # a GPU stays exact


def test_self_neighbours__hnsw_against_brute_force(approximate_everything):
    x = _clustered(1500, 16, 0)
    cos, ref_sim, ref_idx = _brute(x, 10)
    sim, idx = self_neighbours(x, k=10)
    assert sim.shape == idx.shape == (1500, 10) and idx.dtype == torch.long
    assert not (idx == torch.arange(1500)[:, None]).any()  # never the row itself
    assert _recall(ref_idx, idx) >= 0.98
    # the similarities are the true cosines of the rows returned, sorted descending
    torch.testing.assert_close(sim.double(), cos.gather(1, idx), atol=1e-5, rtol=0)
    assert (sim[:, :-1] >= sim[:, 1:]).all()
    # each planted exact copy is its twin's nearest other (cosine 1)
    for a, b in zip(range(5), range(1495, 1500)):
        assert idx[a, 0] == b and idx[b, 0] == a
        assert sim[a, 0] == pytest.approx(1.0, abs=1e-6)
    pairs, _ = duplicate_pairs(sim, idx, 0.9999)
    assert {tuple(p) for p in pairs.tolist()} >= {(a, b) for a, b in zip(range(5),
                                                                         range(1495, 1500))}


def test_self_neighbours__same_result_on_one_or_two_threads(approximate_everything):
    x = _clustered(3000, 16, 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = self_neighbours(x, k=10)
        torch.set_num_threads(2)
        two = self_neighbours(x, k=10)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[1], two[1]) and torch.equal(one[0], two[0])


def test_drop_self__worked_by_hand():
    # row 0 finds itself first; row 1's exact copy (row 2) ties and comes first; row 2 is
    # missed by the graph: its last (worst) hit goes
    sim = torch.tensor([[1.0, 0.9, 0.8], [1.0, 1.0, 0.7], [0.95, 0.9, 0.6]])
    idx = torch.tensor([[0, 5, 6], [2, 1, 7], [3, 4, 8]])
    s, i = ann._drop_self(sim, idx)
    assert i.tolist() == [[5, 6], [2, 7], [3, 4]]
    assert torch.equal(s, torch.tensor([[0.9, 0.8], [1.0, 0.7], [0.95, 0.9]]))


def test_exact_fallback__equals_brute_force():
    x = torch.nn.functional.normalize(_clustered(600, 8, 2), dim=1)
    rows = torch.tensor([3, 17, 599])
    s, i = ann._exact(x.numpy(), x[rows].numpy(), 4, exclude=rows)
    _, ref_sim, ref_idx = _brute(x, 4)
    assert i.tolist() == ref_idx[rows].tolist()
    torch.testing.assert_close(s.double(), ref_sim[rows], atol=1e-5, rtol=0)


def test_knn_neighbours__the_classifier_search_stays_exact(approximate_everything):
    bank, queries = _clustered(800, 8, 3), _clustered(50, 8, 4)
    _, ref_sim, ref_idx = _brute(bank, 7, queries)
    sim, idx = knn_neighbours(bank, queries, k=7)  # no graph below any threshold
    assert idx.tolist() == ref_idx.tolist()


def test_knn_neighbours__bank_rows_read_in_place_equal_the_copied_subset():
    bank, queries = _clustered(900, 8, 6), _clustered(40, 8, 7)
    rows = torch.randperm(900, generator=torch.Generator().manual_seed(1))[:700].sort().values
    want = knn_neighbours(bank[rows], queries, k=9, bank_chunk_size=128)
    got = knn_neighbours(bank, queries, k=9, bank_chunk_size=128, bank_rows=rows)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])  # the same bits
    _, _, ref_idx = _brute(bank[rows], 9, queries)
    assert _recall(ref_idx, got[1]) == 1.0


def test_select_on_heldout__scores_at_most_KNN_SELECT_MAX_VAL_held_out_rows(monkeypatch):
    import pipeline.evaluate.knn as knn
    from pipeline.evaluate.heldout import split_train_val

    seen = {}

    def spy(bank, bank_labels, val, val_labels, **kw):
        seen.update(val=val, bank_rows=kw["bank_rows"])
        return "selection"

    monkeypatch.setattr(knn, "select_k_T", spy)
    monkeypatch.setattr(knn, "KNN_SELECT_MAX_VAL", 40)
    x = torch.arange(1500.0)[:, None].repeat(1, 3)  # row i holds i: the rows scored are seen
    labels = torch.zeros(1500, dtype=torch.long)
    tr, va = split_train_val(1500, 0.1, 9)  # 150 held out
    assert knn.select_on_heldout(x, labels, seed=9) == ("selection", 40)
    scored = seen["val"][:, 0].long()
    assert len(scored) == 40 and len(set(scored.tolist())) == 40
    assert set(scored.tolist()) <= set(va.tolist())  # held-out rows only ...
    assert torch.equal(seen["bank_rows"], tr)  # ... and the bank is every row not held out
    monkeypatch.setattr(knn, "KNN_SELECT_MAX_VAL", 150)  # at the cap: all of them, in order
    knn.select_on_heldout(x, labels, seed=9)
    assert torch.equal(seen["val"][:, 0].long(), va)


def test_select_k_T__bank_rows_with_unlabelled_rows_equal_the_copied_labelled_bank():
    from pipeline.evaluate.heldout import split_train_val
    from pipeline.evaluate.knn import select_on_heldout

    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 4, (1500,), generator=g)
    x = torch.randn(4, 12, generator=g)[labels] * 2 + torch.randn(1500, 12, generator=g)
    labels[::7] = -1  # unlabelled rows: in neither bank
    rows = torch.arange(1500)[::2]
    labelled = rows[labels[rows] >= 0]
    want = select_k_T(x[labelled], labels[labelled], x[1:400:2], labels[1:400:2])
    got = select_k_T(x, labels, x[1:400:2], labels[1:400:2], bank_rows=rows)
    assert (got.k, got.T, got.grid) == (want.k, want.T, want.grid)
    tr, va = split_train_val(1500, 0.1, 9)  # select_on_heldout: the same as the copies
    sel, n_val = select_on_heldout(x, labels, seed=9)
    ref = select_k_T(x[tr], labels[tr], x[va], labels[va])
    assert n_val == len(va) and (sel.k, sel.T, sel.grid) == (ref.k, ref.T, ref.grid)
