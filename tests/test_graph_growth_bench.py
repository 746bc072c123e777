"""benchmarks/graph_growth.py's data, slopes and recall, on sizes that take a second."""

import pytest
import torch
from helpers import load_script


@pytest.fixture(scope="module")
def gg():
    return load_script("benchmarks/graph_growth.py")


def test_slopes__log_ratio_of_times_over_log_ratio_of_rows(gg):
    # 4x the rows: build 8x (b = 1.5), search 4x (b = 1); a 0 s time gives no slope
    runs = [{"rows": 1000, "build_s": 2.0, "search_s": 3.0},
            {"rows": 4000, "build_s": 16.0, "search_s": 12.0},
            {"rows": 16000, "build_s": 0.0, "search_s": 48.0}]
    out = gg.slopes(runs)
    assert out["1000->4000"] == {"build": 1.5, "search": 1.0}
    assert out["4000->16000"] == {"build": None, "search": 1.0}


def test_rows_and_copies__unit_rows_and_copies_nearer_than_distinct_neighbours(gg):
    base = gg.rows(500, 32, seed=0)
    assert torch.allclose(base.norm(dim=1), torch.ones(500), atol=1e-5)
    assert torch.equal(base, gg.rows(500, 32, seed=0))  # seeded
    x = gg.copies(1500, base, 0.1)  # 3 copies of each base row, row i from base[i % 500]
    assert x.shape == (1500, 32)
    own = (x[:500] * x[500:1000]).sum(dim=1)  # a row and its copy
    sim = base @ base.T
    sim.fill_diagonal_(-2)
    # each copy moved by noise of norm ~0.1: two copies ~0.14 apart, cosine ~1 - 0.14^2 / 2
    assert own.median() == pytest.approx(0.99, abs=0.005)
    assert own.median() > sim.max(dim=1).values.median()  # nearer than any distinct row


@pytest.mark.parametrize("index", ["hnsw", "ivf"])
def test_time_graph__finds_the_exact_neighbours_of_a_small_set(gg, index):
    # 2,000 rows, IVF of 2 lists both probed: the exact search; the graph at this size too
    x = gg.rows(2000, 16, seed=1)
    out = gg.time_graph(x, 10, index, list_rows=1000)
    assert out["rows"] == 2000
    assert out["recall_at_10"] >= (1.0 if index == "ivf" else 0.99)
