import re
from pathlib import Path

import pytest
import yaml
from helpers import load_script, says, shipped_versions

from pipeline.__main__ import main as cli_main
from pipeline.config import (
    Params,
    ParamsError,
    check_params_file,
    flatten,
    from_dict,
    load_params,
    read_yaml,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[1]


def check_params_stage(argv):
    """``stages/check_params.py``'s main (the DVC stage), imported from its file."""
    return load_script("stages/check_params.py").main(argv)


def test_params_yaml__equals_schema_defaults(tmp_path):
    # one set of defaults: the shipped params.yaml and the dataclass defaults agree (the
    # workspace copy or the committed one: a preset copied in does not change what ships)
    seen = []
    for i, text in enumerate(shipped_versions("params.yaml")):
        (f := tmp_path / f"params{i}.yaml").write_text(text)
        seen.append(to_dict(load_params(f)))
    assert to_dict(Params()) in seen, seen[0]


@pytest.mark.parametrize("preset", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_presets__validate_and_are_whole_files(preset):
    p = load_params(preset)
    raw = yaml.safe_load(preset.read_text())
    # whole params files: every key of the schema is present (dvc repro needs every key)
    assert _leaf_keys(raw) == _leaf_keys(to_dict(p))


def _leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in tree.items():
        keys |= _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return keys


def test_leaf_keys__dotted_paths_of_leaves():
    assert _leaf_keys({"a": 1, "b": {"c": 2, "d": {"e": 3}}}) == {"a", "b.c", "b.d.e"}


def test_presets__required_ones_exist():
    names = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert {"ci.yaml", "cifar10-r18.yaml", "imagenet-r50-v2.yaml"} <= names


def test_cifar_preset__matches_moco_demo_recipe():
    p = load_params(ROOT / "configs/cifar10-r18.yaml")
    assert (p.moco.K, p.moco.m, p.moco.T, p.moco.bn_splits) == (4096, 0.99, 0.1, 8)
    # demo: lr 0.06 for batch 512 == 0.03 per 256
    assert p.pretrain.lr * p.pretrain.batch_size / 256 == pytest.approx(0.06)
    assert (p.pretrain.epochs, p.pretrain.weight_decay) == (200, 5e-4)
    # demo: RandomResizedCrop(32) with torchvision's default scale (0.08, 1), no blur
    assert (p.augment.preset, p.augment.crop_min_scale) == ("v2_small", 0.08)
    # demo: kNN on the 128-d output of the encoder's fc, a linear projection
    assert (p.model.head, p.model.dim, p.embed.use_head) == ("linear", 128, True)


def test_imagenet_preset__matches_moco_v2():
    p = load_params(ROOT / "configs/imagenet-r50-v2.yaml")
    got = (p.moco.K, p.moco.m, p.moco.T, p.model.head, p.model.dim)
    assert got == (65536, 0.999, 0.2, "mlp", 128)
    assert (p.pretrain.lr, p.pretrain.batch_size, p.pretrain.weight_decay) == (0.03, 256, 1e-4)
    assert (p.linear.lr, p.linear.lr_milestones, p.linear.epochs) == (30.0, [60, 80], 100)


@pytest.mark.parametrize("tree, key", [
    ({"moco": {"KK": 5}}, "moco.KK"),                      # typo key
    ({"mocco": {"K": 5}}, "mocco"),                        # typo section
    ({"moco": {"K": "many"}}, "moco.K"),                   # wrong type
    ({"pretrain": {"lr": -0.1}}, "pretrain.lr"),           # negative lr
    ({"moco": {"K": 0}}, "moco.K"),                        # K < 1
    ({"moco": {"m": 1.01}}, "moco.m"),                     # m outside [0, 1]
    ({"moco": {"m": -0.5}}, "moco.m"),
    ({"moco": {"T": 0}}, "moco.T"),
    ({"data": {"source": "mnist"}}, "data.source"),        # unknown dataset
    ({"model": {"backbone": "vit"}}, "model.backbone"),    # unknown backbone
    ({"model": {"stem_stride": 4}}, "model.stem_stride"),
    ({"augment": {"preset": "v3"}}, "augment.preset"),
    ({"pretrain": {"batch_size": 0}}, "pretrain.batch_size"),
    ({"pretrain": {"batch_size": -16}}, "pretrain.batch_size"),
    ({"embed": {"batch_size": 0}}, "embed.batch_size"),
    ({"pretrain": {"batch_size": 16}, "moco": {"bn_splits": 3}}, "moco.bn_splits"),  # 16 % 3
    ({"pretrain": {"epochs": 0}}, "pretrain.epochs"),
    ({"pretrain": {"batch_size": 100}, "moco": {"bn_splits": 8}}, "moco.bn_splits"),
    ({"knn": {"k": 0}}, "knn.k"),
    ({"knn": {"select": "test"}}, "knn.select"),           # choosing on test is not offered
    ({"embed": {"pool_grid": 0}}, "embed.pool_grid"),
    ({"embed": {"layer": 4, "pool_grid": 2, "use_head": True}}, "embed.pool_grid"),  # (N, C)
    ({"embed": {"layer": 4, "pool_grid": 3}}, "embed.pool_grid"),  # 28 px: layer4 is 2 x 2
    ({"embed": {"layer": 3, "pool_grid": 5}}, "embed.pool_grid"),  # 28 px: layer3 is 4 x 4
    ({"data": {"image_size": 16}, "embed": {"layer": 4, "pool_grid": 2}},
     "embed.pool_grid"),                                    # 16 px: layer4 is 1 x 1
    ({"embed": {"layer": 0}}, "embed.layer"),
    ({"embed": {"layer": 5}}, "embed.layer"),              # a ResNet has layer1..layer4
    ({"embed": {"layer": 3, "pool_grid": 1, "use_head": True}}, "embed.layer"),
    ({"embed": {"layer": 3, "pool_grid": 4, "use_head": True}}, "embed.use_head"),  # both
    ({"embed": {"layer": "3"}}, "embed.layer"),            # quoted: dvc.lock would record '3'
    ({"mlflow": {"enabled": "false"}}, "mlflow.enabled"),
    ({"model": {"small_stem": "true"}}, "model.small_stem"),  # true and "true": two spellings
    ({"pretrain": {"compile": "False"}}, "pretrain.compile"),
    ({"pretrain": {"compile": "Auto"}}, "pretrain.compile"),  # DVC records 'Auto': reruns
    ({"linear": {"val_fraction": 1.0}}, "linear.val_fraction"),
    ({"data": {"size": 3}}, "data.size"),                  # DVC run-cache-ignored name
    ({"pretrain": {"lr": float("nan")}}, "pretrain.lr"),
    # own images
    ({"data": {"source": "none"}}, "data.pretrain_labelled"),  # nothing to pretrain on
    ({"data": {"pretrain_labelled": False}}, "data.pretrain_labelled"),
    ({"data": {"source": "webdataset"}}, "data.root"),  # the shards must be named
    ({"data": {"unlabelled_root": "https://host/photos"}}, "data.unlabelled_root"),
    ({"data": {"max_broken_fraction": 1.0}}, "data.max_broken_fraction"),
    ({"data": {"label_field": " "}}, "data.label_field"),
    ({"data": {"max_side": 64, "image_size": 32}}, "data.max_side"),  # fixed-size source
    ({"moco": {"K": 60000}}, "moco.K"),  # Fashion-MNIST: 60,000 pretraining images
    ({"seed": 2**32}, "seed"),  # numpy, torch.manual_seed and scikit-learn take < 2**32
    ({"seed": -1}, "seed"),
    ({"mlflow": {"experiment": ""}}, "mlflow.experiment"),  # MLflow refuses it in the stage
    ({"mlflow": {"experiment": "   "}}, "mlflow.experiment"),
])
def test_from_dict__error_names_the_key(tree, key):
    with pytest.raises(ParamsError) as e:
        from_dict(tree)
    assert f"'{key}'" in str(e.value)
    assert len(str(e.value).splitlines()) == 1  # ONE clear message


@pytest.mark.parametrize("side, layer, largest", [
    (28, 4, 2), (28, 3, 4), (28, 2, 7), (28, 1, 14), (16, 3, 2), (32, 3, 4)])
def test_validate__pool_grid_bound_is_the_map_of_embed_layer(side, layer, largest):
    # stride-2 small stem: 28 -> 14 (layer1), 7, 4, 2; 16 -> 8, 4, 2, 1; 32 -> 16, 8, 4, 2
    from_dict({"data": {"image_size": side}, "embed": {"layer": layer, "pool_grid": largest}})
    with pytest.raises(ParamsError, match=rf"'embed.pool_grid' = {largest + 1} is invalid; "
                                          rf"allowed: <= {largest}: .* after layer{layer} "):
        from_dict({"data": {"image_size": side},
                   "embed": {"layer": layer, "pool_grid": largest + 1}})


def test_from_dict__interpolation_rejected():
    with pytest.raises(ParamsError, match="interpolation"):
        from_dict({"seed": 1, "pretrain": {"lr": "${seed}"}})


def test_from_dict__valid_override_keeps_other_defaults():
    p = from_dict({"moco": {"K": 1024}})
    assert p.moco.K == 1024 and p.moco.m == Params().moco.m


def test_flatten__dotted_dvc_names():
    flat = flatten(to_dict(Params()))
    assert flat["moco.K"] == 4096
    assert flat["linear.lr_milestones"] == [60, 80]
    assert "moco" not in flat


def test_check_params_cli__one_ok_line__config_only_with_show(tmp_path, capsys):
    tree = to_dict(Params())
    tree["moco"]["K"] = 1024
    (good := tmp_path / "good.yaml").write_text(yaml.safe_dump(tree))  # every key: check-params
    assert cli_main(["check-params", "--params", str(good)]) == 0
    out = capsys.readouterr().out
    leaves = sum(len(v) if isinstance(v, dict) else 1 for v in tree.values())  # 2 levels deep
    assert leaves > 80 and not any(isinstance(x, dict) for v in tree.values()
                                   if isinstance(v, dict) for x in v.values())
    assert out.splitlines() == [f"ok  {good}: {leaves} params, every key present, typed and in "
                                "range (--show prints them resolved)"]
    assert cli_main(["check-params", "--params", str(good), "--show"]) == 0
    out = capsys.readouterr().out
    assert "  K: 1024\n" in out and "  m: 0.99\n" in out  # the file's value and a default
    assert yaml.safe_load(out.rsplit("\nok  ", 1)[0]) == tree  # the YAML, then the ok line
    bad = tmp_path / "p.yaml"
    bad.write_text("moco:\n  m: 2\n")
    assert cli_main(["check-params", "--params", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'moco.m'" in err and "0 <= m <= 1" in err


def test_load_params__missing_file_named(tmp_path):
    with pytest.raises(ParamsError, match="nope.yaml"):
        load_params(tmp_path / "nope.yaml")


def test_load_params__a_directory_is_named_as_one(tmp_path):
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path)
    assert str(e.value) == f"{tmp_path}: is a directory, not a params file"


def test_check_params_cli__incomplete_file_names_missing_keys(tmp_path, capsys):
    part = tmp_path / "p.yaml"
    part.write_text("seed: 1\nmoco:\n  K: 16\n")  # valid values, but DVC needs every key
    assert cli_main(["check-params", "--params", str(part)]) == 2
    err = capsys.readouterr().err
    assert "missing keys" in err and "report.tsne_points" in err and "moco.m," in err
    assert "moco.K," not in err and "seed," not in err


def test_check_params_file__a_deleted_key_is_named_missing_not_its_default_refused(tmp_path):
    # configs/ci.yaml caps pretraining at 2,048 images: without moco.K the default 4,096 would
    # fail the queue check, but the user never wrote 4,096; the missing key is the error
    text = (ROOT / "configs/ci.yaml").read_text()
    lines = [ln for ln in text.splitlines() if not ln.startswith("  K: ")]
    assert len(lines) == len(text.splitlines()) - 1
    f = tmp_path / "p.yaml"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ParamsError) as e:
        check_params_file(f)
    assert str(e.value) == (f"{f}: missing keys moco.K (dvc repro needs every key; copy them "
                            "from `git show HEAD:params.yaml` or configs/)")
    # a refused value the user did write is still named first
    f.write_text("\n".join(lines).replace("  m: 0.99", "  m: 2") + "\n")
    with pytest.raises(ParamsError, match=r"'moco.m' = 2 is invalid; allowed: 0 <= m <= 1"):
        check_params_file(f)


def test_check_params_file__a_mapping_where_a_value_belongs_is_refused_not_missing(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text((ROOT / "configs/ci.yaml").read_text().replace("  epochs: 2\n",
                                                                 "  epochs: {a: 1}\n", 1))
    with pytest.raises(ParamsError) as e:
        check_params_file(f)
    assert e.value.key == "pretrain.epochs" and "missing" not in str(e.value)


@pytest.mark.parametrize(("section", "key", "value"), [
    ("pretrain", "num_threads", 2**40), ("model", "width", 10**20),
    ("pretrain", "num_workers", 2**31), ("pretrain", "lr_milestones", [1, 2**63]),
    ("label_efficiency", "per_class", [1, 2**40]), ("knn", "chunk_size", 2**31),
])
def test_validate__counts_beyond_a_c_int_refused(section, key, value):
    # 2**31 - 1 is the largest int torch.set_num_threads and the DataLoader take
    with pytest.raises(ParamsError) as e:
        from_dict({section: {key: value}})
    assert e.value.key == f"{section}.{key}"
    from_dict({"pretrain": {"num_threads": 2**31 - 1}})  # the largest passes


@pytest.mark.parametrize("spelling", ["0x" + "f" * 3700, "9" * 5000])
def test_load_params__an_integer_past_pythons_digit_limit_is_one_error(tmp_path, spelling):
    # hex reads past the 4300-digit limit and then cannot be printed; decimal fails in the reader
    f = tmp_path / "p.yaml"
    f.write_text(f"pretrain:\n  epochs: {spelling}\n")
    with pytest.raises(ParamsError) as e:
        load_params(f)
    says(str(e.value), str(f), "4300 digits")


def test_from_dict__a_mapping_with_odd_keys_where_a_value_belongs_is_that_value():
    with pytest.raises(ParamsError) as e:
        from_dict({"pretrain": {"epochs": {None: 1}}})
    assert e.value.key == "pretrain.epochs" and "allowed: an integer" in str(e.value)


@pytest.mark.parametrize(("tree", "where"), [
    ({"report": {None: 5}}, "section 'report'"), ({"report": {True: 1}}, "section 'report'"),
    ({"report": {1.5: 1}}, "section 'report'"), ({5: 1}, "the top level"),
])
def test_from_dict__a_key_that_is_not_a_name_is_named(tree, where):
    bad = next(k for sec in (tree, *[v for v in tree.values() if isinstance(v, dict)])
               for k in sec if not isinstance(k, str))
    with pytest.raises(ParamsError) as e:
        from_dict(tree)
    says(str(e.value), where, f"the key {bad!r}, not a name")


@pytest.mark.parametrize("tree, key, rule", [
    ({"pretrain": {"lr_milestones": 5}}, "pretrain.lr_milestones",
     "= 5 is invalid; allowed: a list of integers, e.g. [120, 160]"),
    ({"linear": {"lr_milestones": "60,80"}}, "linear.lr_milestones",
     "= '60,80' is invalid; allowed: a list of integers, e.g. [60, 80]"),
    ({"linear": {"lr_milestones": ["6", 8]}}, "linear.lr_milestones",
     "= ['6', 8] is invalid; allowed: a list of integers, e.g. [60, 80]"),
    ({"linear": {"lr_milestones": [80, 60]}}, "linear.lr_milestones",
     "= [80, 60] is invalid; allowed: increasing positive epochs"),
    ({"seed": 1, "pretrain": {"lr": "${seed}"}}, "pretrain.lr",
     "= '${seed}': '${...}' interpolation is not allowed"),
    ({"knn": {"T": "0.1"}}, "knn.T", "= '0.1' is invalid; allowed: a number, without quotes"),
    ({"knn": {"k": 2.0}}, "knn.k", "= 2.0 is invalid; allowed: an integer"),
    ({"knn": {"k": True}}, "knn.k", "= True is invalid; allowed: an integer"),
    ({"embed": {"use_head": 1}}, "embed.use_head", "= 1 is invalid; allowed: true or false"),
    ({"data": {"root": 5}}, "data.root", "= 5 is invalid; allowed: text"),
    ({"embed": {"layer": 3, "pool_grid": 4, "use_head": True}}, "embed.use_head",
     "= True is invalid; allowed: embed.use_head true needs embed.layer 4 and embed.pool_grid 1"),
    ({"moco": 4096}, "moco", "= 4096 is invalid; allowed: a section (a mapping of K, m, "
     "m_schedule, T, symmetric, bn, bn_splits)"),
    ({"pretrain": {"num_workers": -1}}, "pretrain.num_workers",
     "= -1 is invalid; allowed: auto or an integer >= 0"),
])
def test_from_dict__messages_state_the_rule(tree, key, rule):
    with pytest.raises(ParamsError) as e:
        from_dict(tree)
    assert e.value.key == key
    assert str(e.value).startswith(f"params: '{key}' {rule}")
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("written", ["yes", "off", "on", "True"])
def test_load_params__yaml11_boolean_word_is_text_and_refused_for_a_boolean(tmp_path, written):
    # read as DVC reads it (YAML 1.2): yes/off/on are text, as dvc.lock records them; a boolean
    # key refuses text (True, a YAML 1.2 boolean, passes)
    f = tmp_path / "p.yaml"
    f.write_text(f"mlflow:\n  enabled: {written}\n")
    if written == "True":
        assert load_params(f).mlflow.enabled is True
        return
    with pytest.raises(ParamsError) as e:
        load_params(f)
    assert e.value.key == "mlflow.enabled"
    assert str(e.value).startswith(f"{f}: 'mlflow.enabled' = '{written}' is invalid; allowed: "
                                   "true or false")


def test_load_params__leading_zero_number_reads_as_dvc_reads(tmp_path):
    # YAML 1.1 read 010 as octal 8; DVC (YAML 1.2) reads 10, and so do we now
    f = tmp_path / "p.yaml"
    f.write_text("pretrain:\n  epochs: 010\n")
    assert load_params(f).pretrain.epochs == 10


@pytest.mark.parametrize("text", [
    "pretrain:\n  epochs: 010\n  weight_decay: 1e-4\n",
    "mlflow:\n  experiment: off\n  enabled: true\naugment:\n  preset: v2\n",
    "data:\n  root: 0x10\n  label_field: yes\n",
])
def test_read_yaml__equals_dvc_reading(tmp_path, text):
    from dvc.utils.serialize import load_yaml

    f = tmp_path / "p.yaml"
    f.write_text(text)
    assert read_yaml(f) == load_yaml(f)
    for path in [ROOT / "params.yaml", *sorted((ROOT / "configs").glob("*.yaml"))]:
        assert read_yaml(path) == load_yaml(path), path


def test_load_params__switch_spelled_as_yaml_boolean_or_auto_is_accepted(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("model:\n  small_stem: true\npretrain:\n  compile: False\n"
                 "  channels_last: auto\nmlflow:\n  enabled: True\n")
    p = load_params(f)
    assert (p.model.small_stem, p.pretrain.compile, p.pretrain.channels_last,
            p.mlflow.enabled) == ("true", "false", "auto", True)


def test_check_params_cli__stamp_is_content_stable(tmp_path, capsys):
    # the check_params DVC stage: the same stamp bytes for any valid file, so downstream stages
    # (which depend on the stamp) rerun only for their own params
    other = tmp_path / "other.yaml"
    text = (ROOT / "params.yaml").read_text()
    assert len(re.findall(r"^  k: \d+ ", text, flags=re.M)) == 1  # knn.k, the only `k:`
    other.write_text(re.sub(r"^  k: \d+ ", "  k: 23 ", text, flags=re.M))
    assert other.read_text() != (ROOT / "params.yaml").read_text()
    stamps = []
    for i, params in enumerate((ROOT / "params.yaml", other)):
        stamp = tmp_path / f"runs{i}/check_params.json"
        assert check_params_stage(["--params", str(params), "--stamp", str(stamp)]) == 0
        stamps.append(stamp.read_bytes())
    assert stamps[0] == stamps[1]
    assert capsys.readouterr().out == ""  # the stage prints nothing on success
    bad = tmp_path / "bad.yaml"
    bad.write_text(other.read_text().replace("  k: 23", "  k: 2O"))
    stamp = tmp_path / "runs-bad/check_params.json"
    assert check_params_stage(["--params", str(bad), "--stamp", str(stamp)]) == 2
    assert not stamp.exists()
    assert "'knn.k'" in capsys.readouterr().err


@pytest.mark.parametrize("shards_dir, dvc, ok", [
    ("data/shards", True, True),
    ("../elsewhere/shards", True, False),  # DVC 3 refuses it only after build_shards ran
    ("OUTSIDE", True, False),  # an absolute path outside the repository
    ("OUTSIDE", False, True),  # by hand (no DVC_ROOT): any path
    ("https://host/shards", True, True),  # read in place, never built
])
def test_check_params_stage__shards_dir_inside_the_repo_under_dvc(shards_dir, dvc, ok, tmp_path,
                                                                 monkeypatch, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    shards_dir = str(tmp_path / "elsewhere") if shards_dir == "OUTSIDE" else shards_dir
    params = repo / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text().replace(
        "  shards_dir: data/shards", f"  shards_dir: {shards_dir}", 1))
    assert f"shards_dir: {shards_dir}" in params.read_text()
    monkeypatch.chdir(repo)
    if dvc:
        monkeypatch.setenv("DVC_ROOT", str(repo))
    else:
        monkeypatch.delenv("DVC_ROOT", raising=False)
    assert check_params_stage(["--params", str(params)]) == (0 if ok else 2)
    assert (repo / "runs/check_params.json").is_file() == ok
    err = capsys.readouterr().err
    assert ok or err.startswith("error: params: 'data.shards_dir' = ") and "outside" in err


@pytest.mark.parametrize(("pretrain", "key"), [
    ({"steps_per_epoch": 100000, "batch_size": 64}, "pretrain.steps_per_epoch"),
    ({"batch_size": 4096}, "pretrain.batch_size"),
])
def test_validate__epoch_longer_than_capped_data__names_key(pretrain, key):
    # data.max_pretrain_images bounds the data: an epoch of more images is refused up front
    with pytest.raises(ParamsError, match=rf"'{key}'"):
        from_dict({"data": {"max_pretrain_images": 2048}, "pretrain": pretrain,
                   "moco": {"bn_splits": 8}})


def test_load_params__yaml_syntax_error__one_line(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("seed: 0\nknn:\n\tk: 3\n")
    with pytest.raises(ParamsError) as e:
        load_params(f)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{f}: not valid YAML: ")


@pytest.mark.parametrize("tree, expected", [
    ({"moco": {"KK": 5}}, "'moco.KK': unknown key; did you mean 'K'? (section 'moco' has: K, m,"),
    ({"mocco": {"K": 5}}, "'mocco': unknown key; did you mean 'moco'? (the top level has: seed,"),
    ({"knn": {"zzz": 5}}, "'knn.zzz': unknown key (section 'knn' has: k, T, chunk_size,"),
])
def test_from_dict__typo_key_names_the_close_keys(tree, expected):
    with pytest.raises(ParamsError) as e:
        from_dict(tree)
    assert str(e.value).startswith(f"params: {expected}")


def test_load_params__error_names_the_file_once(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("knn:\n  k: -3\n")
    with pytest.raises(ParamsError) as e:
        load_params(f)
    assert str(e.value).startswith(f"{f}: 'knn.k' = -3 is invalid; allowed: > 0")  # one name


@pytest.mark.parametrize(("data", "K", "bound"), [
    ({}, 60000, "60000, the number of pretraining images (data.source fashion_mnist)"),
    ({"source": "stl10"}, 105000, "105000, the number of pretraining images (data.source stl10)"),
    ({"max_pretrain_images": 2048}, 2048,
     "2048, the number of pretraining images (at most, data.max_pretrain_images)"),
    ({"source": "imagefolder", "root": "x", "max_pretrain_images": 500,
      "unlabelled_root": "y"}, 600,
     "500, the number of pretraining images (at most, data.max_pretrain_images)"),
])
def test_validate__queue_as_long_as_the_known_data_refused(data, K, bound):
    with pytest.raises(ParamsError) as e:
        from_dict({"data": data, "moco": {"K": K}})
    msg = str(e.value)
    assert msg.startswith(f"params: 'moco.K' = {K} is invalid; allowed: < {bound}: ")
    assert "moco#146" in msg and len(msg.splitlines()) == 1
    from_dict({"data": data, "moco": {"K": int(bound.split(",")[0]) - 1}})  # one less is fine


@pytest.mark.parametrize("data", [
    {"source": "imagefolder", "root": "x"},  # unknown until the folder is read
    {"unlabelled_root": "photos"},  # the tree adds an unknown number
    {"pretrain_shards": "https://host/{000..009}.tar", "max_pretrain_images": 100},  # read whole
])
def test_validate__unknown_count__queue_left_to_the_pretrain_stage(data):
    assert from_dict({"data": data, "moco": {"K": 10**6}}).moco.K == 10**6


@pytest.mark.parametrize("preset", ["v1", "v2", "v2_small"])
def test_validate__colour_preset_on_grey_fashion_mnist_refused_by_the_params(preset):
    with pytest.raises(ParamsError) as e:
        from_dict({"augment": {"preset": preset}})
    assert e.value.key == "augment.preset"
    says(str(e.value), f"'augment.preset' = '{preset}'", "allowed: v2_grey", "1-channel",
         "mode L, data.source fashion_mnist")
    # an unlabelled tree may hold colour images (index_shards decides); colour sources pass,
    # v2_grey on them is index_shards' warning, not a refusal
    from_dict({"data": {"unlabelled_root": "photos"}, "augment": {"preset": preset}})
    from_dict({"data": {"source": "cifar10"}, "augment": {"preset": preset}})
    from_dict({"data": {"source": "cifar10"}, "augment": {"preset": "v2_grey"}})


def test_validate__imagefolder_needs_its_root():
    with pytest.raises(ParamsError) as e:
        from_dict({"data": {"source": "imagefolder"}})
    assert str(e.value) == ("params: 'data.root' = '' is invalid; allowed: the image directory "
                            "(class sub-folders) when data.source is imagefolder")


def test_validate__own_images_params_accepted():
    p = from_dict({"data": {"source": "none", "unlabelled_root": "photos", "max_side": 64,
                            "image_size": 32}})
    assert (p.data.source, p.data.max_side) == ("none", 64)
    p = from_dict({"data": {"source": "webdataset", "root": "s3://b/{0..9}.tar",
                            "label_field": "label", "pretrain_labelled": False,
                            "pretrain_shards": "s3://b/unl-{0..99}.tar"}})
    assert p.data.label_field == "label"


def test_unlabelled_preset__the_default_recipe_on_the_unlabelled_tree():
    # same model / moco / pretrain / evaluation params as params.yaml; only what the data is
    base = to_dict(Params())  # = params.yaml (test_params_yaml__equals_schema_defaults)
    p = to_dict(load_params(ROOT / "configs/fashion-mnist-unlabelled.yaml"))
    assert {k: v for k, v in p.items() if k != "data"} == {
        k: v for k, v in base.items() if k != "data"}
    changed = {k: v for k, v in p["data"].items() if base["data"][k] != v}
    assert changed == {"unlabelled_root": "data/raw/fmnist-unlabelled",
                       "pretrain_labelled": False, "max_train_images": 6000}


def test_load_params__yaml11_boolean_word_on_a_text_key__is_the_text(tmp_path):
    # `off` is the text 'off' to DVC and to us: a text key keeps it, a choice names its names
    f = tmp_path / "p.yaml"
    f.write_text("mlflow:\n  experiment: off\n")
    assert load_params(f).mlflow.experiment == "off"
    f.write_text("augment:\n  preset: off\n")
    with pytest.raises(ParamsError) as e:
        load_params(f)
    assert e.value.key == "augment.preset"
    assert str(e.value).endswith("'off' is invalid; allowed: one of v1, v2, v2_small, v2_grey")


def test_schema__no_key_that_dvc_run_cache_ignores():
    # DVC's run cache ignores params named size or nfiles: the schema has none, and a file's
    # `size` key is an unknown key, named
    assert not {k.rsplit(".", 1)[-1] for k in flatten(to_dict(Params()))} & {"size", "nfiles"}
    with pytest.raises(ParamsError, match=r"^params: 'data.size': unknown key"):
        from_dict({"data": {"size": 3}})


@pytest.mark.parametrize("value", ["auto", 0, 12])
def test_validate__num_workers_auto_or_count(value):
    assert from_dict({"pretrain": {"num_workers": value}}).pretrain.num_workers == value


@pytest.mark.parametrize("value", [-1, "many", 1.5, True, "2", "0"])  # "2": quoted, as K: "4096"
def test_validate__num_workers_other__names_key(value):
    with pytest.raises(ParamsError, match=r"'pretrain.num_workers'"):
        from_dict({"pretrain": {"num_workers": value}})


@pytest.mark.parametrize("value", ["auto", "probe", 1, 12])
def test_validate__num_threads_auto_probe_or_count(value):
    assert from_dict({"pretrain": {"num_threads": value}}).pretrain.num_threads == value
    assert Params().pretrain.num_threads == "auto"  # the default never depends on the load


# 0 meant "probe" before auto existed: refused, the message lists what to write
@pytest.mark.parametrize("value", [0, -1, "fast", 1.5, True, "2"])
def test_validate__num_threads_other__names_key_and_choices(value):
    with pytest.raises(ParamsError) as e:
        from_dict({"pretrain": {"num_threads": value}})
    says(str(e.value), "'pretrain.num_threads'", "auto, probe or an integer >= 1")


@pytest.mark.parametrize(("key", "value"), [("data.shard_format", "webp"),
                                            ("pretrain.decode", "gpu")])
def test_validate__shard_format_and_decode_choices__name_key(key, value):
    section, name = key.split(".")
    with pytest.raises(ParamsError, match=rf"'{key}'"):
        from_dict({section: {name: value}})


@pytest.mark.parametrize("section, key, value, allowed", [
    ("insights", "duplicate_cosine", 1.5, "a cosine similarity, -1 < x <= 1"),
    ("insights", "duplicate_cosine", -1.0, "a cosine similarity, -1 < x <= 1"),
    ("insights", "neighbours", 0, "> 0"),
    ("insights", "listed", -1, ">= 0"),
    ("report", "insight_images", -2, ">= 0"),
])
def test_validate__insights_out_of_range__names_key(section, key, value, allowed):
    with pytest.raises(ParamsError, match=rf"'{section}.{key}' = {value} is invalid; "
                                          rf"allowed: {re.escape(allowed)}"):
        from_dict({section: {key: value}})
    assert from_dict({"insights": {"duplicate_cosine": 1.0, "listed": 0}}).insights.listed == 0


def test_labelfree_images__off_or_at_least_the_verdicts_minimum():
    from pipeline.config import LABELFREE_MIN_IMAGES

    assert LABELFREE_MIN_IMAGES == 64
    for n in (0, 64, 2048):
        assert from_dict({"pretrain": {"labelfree_images": n}}).pretrain.labelfree_images == n
    for n in (1, 2, 63):  # 1: uniformity needs two images; 2: RankMe <= 2 is always "collapsed"
        with pytest.raises(ParamsError) as e:
            from_dict({"pretrain": {"labelfree_images": n}})
        says(str(e.value), f"'pretrain.labelfree_images' = {n} is invalid", "0 (off)",
             "at least 64")


@pytest.mark.parametrize("value", [0, -1, "all", 1.5, True, "2"])
def test_validate__build_workers_auto_or_count_from_1__names_key(value):
    assert from_dict({"data": {"build_workers": 3}}).data.build_workers == 3
    with pytest.raises(ParamsError, match=r"'data.build_workers'.*auto or an integer >= 1"):
        from_dict({"data": {"build_workers": value}})
