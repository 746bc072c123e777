"""``python -m pipeline compare`` on ``dvc exp show --json`` rows built here (the real command on
a repo with experiments: tests/e2e/test_experiments.py)."""

from pipeline.compare import METRICS, experiments, render, table


def rev(name: str, params: dict, knn_top1: float | None, le: dict | None = None) -> dict:
    metrics = {} if knn_top1 is None else {"metrics/knn.json": {"data": {"top1": knn_top1}}}
    if le is not None:
        metrics["metrics/label_efficiency.json"] = {"data": le}
    return {"rev": f"{name}-sha", "name": name,
            "data": {"params": {"params.yaml": {"data": params}}, "metrics": metrics}}


def shown(*exps: dict) -> list[dict]:
    """The shape of `dvc exp show --json`: the workspace, then a commit with its experiments."""
    base = {"knn": {"k": 200, "select": "val"}, "linear": {"lr": 30.0, "milestones": [60, 80]},
            "seed": 0}
    commit = rev("main", base, 81.0, {"knn": {"1": 40.0, "10": 60.5}})
    commit["rev"] = "0123456789abcdef"
    commit["experiments"] = [{"name": e["name"], "revs": [e]} for e in exps]
    return [{"rev": "workspace", "name": None, **{"data": commit["data"]}}, commit]


EXPS = (rev("fast-lr", {"knn": {"k": 200, "select": "val"},
                        "linear": {"lr": 10, "milestones": [60, 80]}, "seed": 0}, 80.5),
        rev("k20", {"knn": {"k": 20, "select": "fixed"},
                    "linear": {"lr": 30.0, "milestones": [50]}, "seed": 0}, None))


def test_experiments__workspace_commit_then_its_experiments():
    assert [label for label, _ in experiments(shown(*EXPS))] == [
        "workspace", "main", "  fast-lr", "  k20"]


def test_table__changed_params_then_the_headline_metrics():
    frame = table(shown(*EXPS))
    # seed is the same everywhere; the four others differ between some rows
    assert list(frame.columns) == ["knn.k", "knn.select", "linear.lr", "linear.milestones",
                                   *METRICS]
    assert frame.loc["  k20", "linear.milestones"] == "[50]"
    assert frame.loc["  fast-lr", "linear.lr"] == "10"
    assert frame["knn.top1"].tolist()[:3] == [81.0, 81.0, 80.5]
    assert frame["knn.top1"].isna().tolist() == [False] * 3 + [True]  # k20: not run yet
    assert frame.loc["main", "knn@10"] == 60.5 and frame["linear@1"].isna().all()


def test_render__no_line_wider_than_asked_every_column_kept():
    for width in (160, 90, 60):
        text = render(shown(*EXPS), width)
        assert max(len(ln) for ln in text.splitlines()) <= width, (width, text)
        for column in ("knn.k", "linear.milestones", *METRICS):
            assert column in text
    assert len(render(shown(*EXPS), 160).splitlines()[0]) > 90  # one block at 160


def test_render__metrics_to_their_precision():
    # the files keep every digit (RankMe 92.1225, 885.182 s of pretraining); the table shows
    # RankMe to 0.1, seconds whole and top-1s to 0.01 point
    ws = shown(*EXPS)
    ws[0]["data"]["metrics"]["metrics/pretrain.json"] = {
        "data": {"rankme": 92.1225, "wall_time_s": 885.182}}
    ws[0]["data"]["metrics"]["metrics/selection.json"] = {"data": {"at_20": {"knn": 63.2714}}}
    text = render(ws, 160)
    workspace = next(ln for ln in text.splitlines() if ln.startswith("workspace"))
    assert workspace.split()[-9:] == ["81.00", "-", "40.00", "60.50", "-", "-", "63.27", "92.1",
                                      "885"]
    assert "92.1225" not in text and "885.182" not in text
