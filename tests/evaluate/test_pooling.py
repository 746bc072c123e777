"""embed.layer / embed.pool_grid: a stage's map average-pooled to g x g cells, channel-major."""

import json

import pytest
import torch

from pipeline.config import LinearParams
from pipeline.evaluate.features import load_features
from pipeline.evaluate.pooling import GridPool, set_pool_grid
from pipeline.evaluate.run import baselines as run_baselines
from pipeline.evaluate.run import linear as run_linear
from pipeline.evaluate.run.embed import embed
from pipeline.evaluate.run.linear import linear_probe
from pipeline.moco.backbones import build_backbone


def test_grid_pool__cell_means_worked_by_hand():
    x = torch.arange(32, dtype=torch.float32).view(1, 2, 4, 4)  # channel 1 = channel 0 + 16
    out = GridPool(2)(x)
    # channel 0 cells: {0,1,4,5} {2,3,6,7} {8,9,12,13} {10,11,14,15}
    assert out.flatten(1).tolist() == [[2.5, 4.5, 10.5, 12.5, 18.5, 20.5, 26.5, 28.5]]


def test_grid_pool__rejects_a_map_smaller_than_the_grid_and_grid_below_1():
    with pytest.raises(ValueError, match=r"embed.pool_grid = 3 .* 2 x 2"):
        GridPool(3)(torch.zeros(1, 4, 2, 2))
    with pytest.raises(ValueError, match="embed.pool_grid must be >= 1"):
        GridPool(0)


@pytest.mark.parametrize("side,small_stem,stride", [
    (28, "auto", 2), (28, "auto", 1), (16, "auto", 2), (32, "auto", 1), (33, "auto", 2),
    (96, "auto", 1), (224, "auto", 1), (64, "true", 2), (40, "false", 1),
])
def test_last_stage_side__equals_the_real_backbone_map(side, small_stem, stride):
    from pipeline.moco.backbones import resolve_small_stem, resolve_stem_stride
    from pipeline.moco.geometry import last_stage_side

    small = resolve_small_stem(small_stem, side)
    bb = build_backbone("resnet18", width=2, in_channels=1, small_stem=small,
                        stem_stride=resolve_stem_stride(stride, small)).eval()
    with torch.no_grad():
        h = _layer4(bb, torch.zeros(1, 1, side, side)).shape[-1]
    assert last_stage_side(side, small_stem, stride) == h


def _layer4(bb, x, layer=4):
    """Slow reference: the backbone's layers by hand, up to ``layer``'s map."""
    x = bb.maxpool(bb.relu(bb.bn1(bb.conv1(x))))
    for i in range(1, layer + 1):
        x = getattr(bb, f"layer{i}")(x)
    return x


@pytest.mark.parametrize("side,stride,layer", [(28, 2, 3), (28, 2, 2), (28, 2, 1), (33, 2, 3),
                                               (96, 1, 3), (224, 1, 2)])
def test_last_stage_side__of_an_earlier_layer_equals_the_real_map(side, stride, layer):
    from pipeline.moco.backbones import resolve_small_stem, resolve_stem_stride
    from pipeline.moco.geometry import last_stage_side

    small = resolve_small_stem("auto", side)
    bb = build_backbone("resnet18", width=2, in_channels=1, small_stem=small,
                        stem_stride=resolve_stem_stride(stride, small)).eval()
    with torch.no_grad():
        h = _layer4(bb, torch.zeros(1, 1, side, side), layer).shape[-1]
    assert last_stage_side(side, "auto", stride, layer) == h


def test_set_pool_grid__layer3_at_28px_keeps_its_whole_4x4_map():
    torch.manual_seed(0)
    bb = build_backbone("resnet18", width=4, in_channels=1, small_stem=True, stem_stride=2).eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        ref = _layer4(bb, x, 3)
        # width 4: layer3 has 4 x 4 = 16 channels; a 4 x 4 grid keeps 16 cells: 256 features
        assert set_pool_grid(bb, 4, layer=3) == 16 * 16 == bb.num_features
        got = bb(x)
    assert ref.shape == (3, 16, 4, 4)  # 28 -> 14 (stem) -> 14, 7, 4
    torch.testing.assert_close(got, ref.flatten(1))
    assert "layer4" not in {k.split(".")[0] for k in bb.state_dict()}  # not run, not carried
    assert set_pool_grid(bb, 1, layer=3) == 16  # global pool of layer3
    with pytest.raises(ValueError, match="layer4..4 were already removed"):
        set_pool_grid(bb, 1, layer=4)
    with pytest.raises(ValueError, match="embed.layer must be one of"):
        set_pool_grid(bb, 1, layer=5)


def test_set_pool_grid__28px_stride2_gives_the_whole_2x2_map_and_cells_average_to_gap():
    torch.manual_seed(0)
    bb = build_backbone("resnet18", width=4, in_channels=1, small_stem=True, stem_stride=2).eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        gap = bb(x)
        assert set_pool_grid(bb, 2) == 32 * 4 == bb.num_features
        grid = bb(x)
        ref = _layer4(bb, x)
    assert ref.shape == (3, 32, 2, 2)  # 28 -> 14 (stem) -> 14, 7, 4, 2
    torch.testing.assert_close(grid, ref.flatten(1))  # 2x2 cells of a 2x2 map: no pooling
    # equal-size cells: the mean of the 4 cell means is the global mean
    torch.testing.assert_close(grid.view(3, 32, 4).mean(-1), gap)
    assert set_pool_grid(bb, 1) == 32  # back to global pooling, from the stored channels
    with torch.no_grad():
        torch.testing.assert_close(bb(x), gap)


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    """A random width-4 ResNet-18 exported like the pretrain stage (16 px -> 2x2 last map)."""
    out = tmp_path_factory.mktemp("pool")
    torch.manual_seed(0)
    bb = build_backbone("resnet18", width=4, in_channels=1, small_stem=True)
    torch.save({k: v for k, v in bb.state_dict().items() if not k.startswith("fc.")},
               out / "encoder.pt")
    (out / "encoder.json").write_text(json.dumps({
        "backbone": "resnet18", "width": 4, "in_channels": 1, "small_stem": True,
        "image_size": 16, "num_features": bb.num_features}))
    return out


def test_embed__pool_grid_2_writes_cells_whose_mean_is_the_global_feature(tiny_shards,
                                                                         encoder_dir):
    feats = {}
    for g in (1, 2):
        m = embed(encoder_path=encoder_dir / "encoder.pt", shards_dir=tiny_shards,
                      out_dir=encoder_dir / f"f{g}", batch_size=32, pool_grid=g)
        assert (m["dim"], m["pool_grid"]) == (32 * g * g, g)
        feats[g] = load_features(encoder_dir / f"f{g}" / "test.pt")
    assert feats[1].keys == feats[2].keys
    n = len(feats[2])
    torch.testing.assert_close(feats[2].features.view(n, 32, 4).mean(-1), feats[1].features,
                               rtol=1e-5, atol=1e-6)
    # the MoCo-protocol files hold the global pool whatever the grid: the mean of the 4 cells
    for g in (1, 2):
        glob = load_features(encoder_dir / f"f{g}" / "test_global.pt")
        assert glob.keys == feats[1].keys and torch.equal(glob.labels, feats[1].labels)
        torch.testing.assert_close(glob.features, feats[1].features, rtol=1e-5, atol=1e-6)


def test_embed__layer3_features_are_its_map_and_the_protocol_files_stay_the_last_stage(
        tiny_shards, encoder_dir):
    from pipeline.evaluate.run.embed import load_encoder

    enc = encoder_dir / "encoder.pt"
    m4 = embed(encoder_path=enc, shards_dir=tiny_shards, out_dir=encoder_dir / "l4",
               batch_size=32, pool_grid=1)
    m3 = embed(encoder_path=enc, shards_dir=tiny_shards, out_dir=encoder_dir / "l3",
               batch_size=32, pool_grid=4, layer=3)
    # 16 px, stride-1 small stem: layer3 is 16 channels x 4 x 4 (16, 16, 8, 4, 2)
    assert (m3["dim"], m3["layer"], m3["global_dim"]) == (16 * 16, 3, 32)
    f3 = load_features(encoder_dir / "l3" / "test.pt")
    bb, _ = load_encoder(enc)
    images = torch.stack([x for x, _, _ in _test_images(tiny_shards)])
    with torch.no_grad():
        ref = _layer4(bb.eval(), images, 3).flatten(1)
    torch.testing.assert_close(f3.features, ref, rtol=1e-5, atol=1e-6)
    # the MoCo-protocol files hold the last stage's global pool, whatever embed.layer is
    for split in ("train", "test"):
        g3, g4 = (load_features(encoder_dir / d / f"{split}_global.pt") for d in ("l3", "l4"))
        assert g3.keys == g4.keys
        torch.testing.assert_close(g3.features, g4.features, rtol=1e-5, atol=1e-6)
    assert m4["global_dim"] == m4["dim"] == 32


def _test_images(shards):
    """The test split's images, one by one, through the embed stage's own transform."""
    from pipeline.data.eval_loader import eval_loader
    from pipeline.data.shards import image_spec, read_manifest
    from pipeline.data.views import build_eval_transform

    spec = image_spec(read_manifest(shards / "test"), shards / "test")
    for x, y, k in eval_loader(shards / "test", batch_size=1,
                               transform=build_eval_transform(spec.size, spec.mean, spec.std)):
        yield x[0], y, k


def test_embed__grid_larger_than_the_map_or_with_the_head_fails_and_writes_nothing(
        tiny_shards, encoder_dir):
    out = encoder_dir / "f3"
    with pytest.raises(ValueError, match="embed.pool_grid = 3"):
        embed(encoder_path=encoder_dir / "encoder.pt", shards_dir=tiny_shards, out_dir=out,
                  batch_size=32, pool_grid=3)
    for grid, layer in ((2, 4), (1, 3)):
        with pytest.raises(ValueError, match="embed.use_head"):
            embed(encoder_path=encoder_dir / "encoder.pt", shards_dir=tiny_shards, out_dir=out,
                  batch_size=32, pool_grid=grid, layer=layer, use_head=True,
                  head_path=encoder_dir / "x.pt")
    assert not out.exists() or not any(out.iterdir())


def test_linear_probe__augment_mode_runs_the_backbone_with_the_same_grid(
        tiny_shards, encoder_dir, tmp_path, monkeypatch):
    embed(encoder_path=encoder_dir / "encoder.pt", shards_dir=tiny_shards,
              out_dir=tmp_path / "f", batch_size=32, pool_grid=2)
    got = {}

    def fake_train(backbone, train_batches, test, **kw):
        x, _ = next(iter(test))
        with torch.no_grad():
            got["dim"], got["num_features"] = backbone.eval()(x).shape[1], kw["num_features"]
        raise StopIteration

    monkeypatch.setattr(run_linear, "train_linear_augment", fake_train)
    with pytest.raises(StopIteration):
        linear_probe(features_dir=tmp_path / "f", shards_dir=tiny_shards,
                         encoder_path=encoder_dir / "encoder.pt",
                         linear=LinearParams(mode="augment", epochs=1, batch_size=32), seed=0,
                         details_path=tmp_path / "d.json", plots_path=tmp_path / "p.tsv",
                         pool_grid=2)
    assert got == {"dim": 128, "num_features": 128}
    with pytest.raises(StopIteration):
        linear_probe(features_dir=tmp_path / "f", shards_dir=tiny_shards,
                     encoder_path=encoder_dir / "encoder.pt",
                     linear=LinearParams(mode="augment", epochs=1, batch_size=32), seed=0,
                     details_path=tmp_path / "d.json", plots_path=tmp_path / "p.tsv",
                     pool_grid=2, layer=3)
    assert got == {"dim": 64, "num_features": 64}  # layer3: 16 channels x 2 x 2


def test_baselines__random_encoder_uses_the_embed_layout(tiny_shards, monkeypatch):
    from pipeline.config import ModelParams

    dims = []
    real = run_baselines.knn_classify

    def spy(train_f, *a, **kw):
        dims.append(train_f.shape[1])
        return real(train_f, *a, **kw)

    monkeypatch.setattr(run_baselines, "knn_classify", spy)
    model = ModelParams(width=4, stem_stride=1)
    run_baselines.baselines(shards_dir=tiny_shards, model=model, seed=0, batch_size=32, pool_grid=2)
    # raw pixels: 1 x 16 x 16; the random width-4 ResNet-18: 32 channels x 2 x 2 cells
    assert dims[0] == 256 and dims[-1] == 32 * 4
    run_baselines.baselines(shards_dir=tiny_shards, model=model, seed=0, batch_size=32, pool_grid=4,
                            layer=3)
    assert dims[-1] == 16 * 16  # layer3: 16 channels x 4 x 4 cells
