import json
import math

import pytest

from pipeline.atomic import headline, round_metric, round_metrics, write_metrics


@pytest.mark.parametrize(("name", "value", "want"), [
    ("top1", 79.32000000000001, 79.32),  # 100 * 7932 / 10000 in floating point
    ("random_encoder_top5", 99.03999999999999, 99.04),
    ("knn_top1", 76.44999999999999, 76.45),
    ("train_acc", 12.345678, 12.35),
    ("accuracy", 50.0, 50.0),
    ("wall_time_s", 1239.4556381702423, 1239.46),
    ("loss", 5.058260361353557, 5.05826),
    ("data_wait_fraction", 0.00602977543141, 0.00602978),
    ("images_per_s", 217.61588418581437, 217.616),
    ("stop_factor", 0.123456789, 0.123457),  # "top" inside a word is not an accuracy
])
def test_round_metric__precision_it_carries(name, value, want):
    assert round_metric(name, value) == want
    assert repr(round_metric(name, value)) == repr(want)


@pytest.mark.parametrize("value", [936, True, "x", None, float("inf")])
def test_round_metric__non_floats_and_inf_unchanged(value):
    assert round_metric("top1", value) is value


def test_round_metric__nan_stays_nan():
    assert math.isnan(round_metric("loss", float("nan")))


def test_round_metrics__nested_by_key():
    got = round_metrics({"a": {"top1": 1 / 3}, "rows": [{"loss": 2 / 3}], "steps": 4})
    assert got == {"a": {"top1": 0.33}, "rows": [{"loss": 0.666667}], "steps": 4}


def test_write_metrics__file_holds_rounded_text(tmp_path):
    path = tmp_path / "m.json"
    back = write_metrics(path, {"top1": 79.32000000000001, "top5": 99.03999999999999, "k": 200})
    text = path.read_text()
    assert "79.32," in text and "99.04" in text and "0000000" not in text and "99999" not in text
    assert json.loads(text) == back == {"k": 200, "top1": 79.32, "top5": 99.04}


def test_headline__kept_keys_in_order_renamed_absent_left_out():
    every = {"top1": 81.5, "top5": 99.0, "k": 20, "wall_time_s": 3.5}
    assert list(headline(every, ("wall_time_s", "val_top1", "top1"))) == ["wall_time_s", "top1"]
    assert headline(every, {"knn": "top1", "seconds": "wall_time_s"}) == {"knn": 81.5,
                                                                         "seconds": 3.5}


def test_write_tsv__missing_value_nan_not_an_empty_cell(tmp_path):
    # `dvc plots show` draws an empty cell at 0; a NaN point is left out
    from pipeline.atomic import write_tsv

    write_tsv(tmp_path / "t.tsv", ["epoch", "acc"], [{"epoch": 1}, {"epoch": 2, "acc": 65.5}])
    assert (tmp_path / "t.tsv").read_text() == "epoch\tacc\n1\tNaN\n2\t65.5\n"
