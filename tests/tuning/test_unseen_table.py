"""The `unseen` table (issue 25): held-out layers of real networks that measure how the tuned database
generalises.  It loads, covers every family the issue names, and none of its problems - in any direction, at any
precision's storage dtype - has an entry in the shipped database or is a problem of a table the tuner tunes.  Also
the 1D / 3D / per-dim layer forms it is written in, and the held-out flag the tuner must honour."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kernelgen.problem import DIRECTIONS, make_problem
from kernelgen.storage import PRECISIONS
from kernelgen.tuning import database, shapes

TUNED_TABLES = ("gpu_md", "gpu_md_retune", "gpu_md_strided", "resnet18_cifar", "winograd", "cks")
ODD_CHANNELS = (24, 40, 80, 112, 192)  # MobileNet / EfficientNet widths


@pytest.fixture(scope="module")
def unseen():
    return shapes.read_table("unseen")


def entry_keys(layers):
    """Every database key the layers' problems could have: each direction, each precision (its storage dtype)."""
    return {database.entry_key(layer.problem(d, shapes.storage_dtype(precision)), precision)
            for layer in layers for d in DIRECTIONS for precision in PRECISIONS}


def problems(layers):
    """Every problem of the layers, in each direction and storage dtype: equal problems are the same shape
    whatever the layers are called."""
    return {layer.problem(d, dtype) for layer in layers for d in DIRECTIONS for dtype in ("float32", "float16")}


def shipped_entries():
    entries = {}
    for path in sorted(database.SHIPPED.glob("*.json")):
        entries |= database.load(path)
    return entries


def tuned_table_problems():
    return set().union(*(problems(shapes.load_table(name)[1]) for name in TUNED_TABLES))


def test_the_table_loads_held_out_with_named_rows(unseen):
    assert unseen.name == "unseen" and unseen.held_out
    assert len(unseen.layers) >= 40
    assert len({layer.name for layer in unseen.layers}) == len(unseen.layers)
    for layer in unseen.layers:
        assert "." in layer.net, layer.name  # "network.layer", from the network's definition
        for d in DIRECTIONS:
            p = layer.problem(d)
            # a few GFLOP: each row runs in well under a second on an H100
            assert 0 < p.flops <= 3e10, (layer.name, p.flops)
            assert max(int(np.prod(s)) for s in (p.x_shape, p.w_shape, p.y_shape)) < 2 ** 31


def families(layer):
    """The issue's families a layer belongs to."""
    f = set()
    f |= {"1d"} if layer.dims == 1 and 3 <= layer.S <= 11 and not layer.transposed else set()
    f |= {"3d 3x3x3"} if layer.dims == 3 and layer.filter == (3, 3, 3) else set()
    f |= {"3d"} if layer.dims == 3 else set()
    f |= {"grouped 3x3"} if layer.groups > 1 and not layer.depthwise and layer.filter == (3, 3) else set()
    f |= {"depthwise"} if layer.depthwise else set()
    f |= {f"dilation {d}" for d in {layer.dilation} - {1} if isinstance(d, int)}
    f |= {"transposed 4x4 s2"} if layer.transposed and layer.filter == (4, 4) and layer.stride == 2 else set()
    f |= {"batch 1"} if layer.N == 1 else set()
    f |= {f"first layer C={layer.C}"} if layer.C in (1, 3) and not layer.transposed else set()
    if layer.filter in ((1,), (1, 1)):
        f |= {f"1x1 with {c} channels" for c in {layer.C, layer.K} & set(ODD_CHANNELS)}
    f |= {"1x7"} if layer.filter == (1, 7) else set()
    f |= {"7x1"} if layer.filter == (7, 1) else set()
    f |= {f"{layer.net.split('.')[0]} batch {layer.N}"} if layer.net.startswith("resnet50.") else set()
    f |= {layer.net.split(".")[0].split("_")[0]}  # the network
    return f


def test_every_family_of_the_issue_is_covered(unseen):
    covered = set().union(*map(families, unseen.layers))
    wanted = {"1d", "3d 3x3x3", "grouped 3x3", "dilation 2", "dilation 4", "dilation 8", "transposed 4x4 s2",
              "batch 1", "first layer C=1", "first layer C=3", "1x7", "7x1",
              "resnet50 batch 16", "resnet50 batch 64", "resnet50 batch 256",
              "vgg16", "unet", "resnet50", "mobilenet", "efficientnet", "resnext50", "deeplabv3", "inception",
              "dcgan", "pix2pix"}
    wanted |= {f"1x1 with {c} channels" for c in ODD_CHANNELS}
    assert not wanted - covered, sorted(wanted - covered)


def test_depthwise_rows_are_marked(unseen):
    """Depthwise rows belong to the next issue: they are in the table, recognisable (groups == C), and few."""
    depthwise = [layer for layer in unseen.layers if layer.depthwise]
    assert depthwise and all(layer.groups == layer.C == layer.K for layer in depthwise)
    assert len(unseen.layers) - len(depthwise) >= 40


def test_the_shipped_database_has_no_entry_for_any_unseen_problem(unseen):
    shipped = shipped_entries()
    # the keys are the database's own (entry_key): the tuned tables' problems are found with them
    assert entry_keys(shapes.load_table("gpu_md")[1]) & shipped.keys()
    assert not entry_keys(unseen.layers) & shipped.keys(), sorted(entry_keys(unseen.layers) & shipped.keys())
    # and every shipped entry's own problem: an entry whose key was made otherwise is caught too
    shipped_problems = {database._problem_of(e) for e in shipped.values()}
    assert not problems(unseen.layers) & shipped_problems


def test_no_unseen_layer_is_a_layer_of_a_tuned_table(unseen):
    tuned = tuned_table_problems()
    assert problems(shapes.load_table("gpu_md")[1]) <= tuned
    clash = problems(unseen.layers) & tuned
    assert not clash, sorted(p.key() for p in clash)


def test_the_checks_catch_a_tuned_layer_added_to_the_table(unseen, tmp_path):
    """The two checks above fail for a table that holds one gpu_md row, whatever it is named."""
    data = json.loads(shapes._table_path("unseen").read_text())
    gpu_md = json.loads(shapes._table_path("gpu_md").read_text())["layers"][0]
    data["layers"].append({**gpu_md, "name": "renamed", "net": "gpu_md.first"})
    (tmp_path / "t.json").write_text(json.dumps(data))
    spoiled = shapes.read_table(tmp_path / "t.json").layers
    assert entry_keys(spoiled) & shipped_entries().keys()
    assert problems(spoiled) & tuned_table_problems()


def test_the_tuner_may_not_tune_a_held_out_table(unseen, tmp_path):
    with pytest.raises(ValueError, match="'unseen' is held out"):
        shapes.check_tunable("unseen")
    assert shapes.check_tunable("gpu_md").name == "gpu_md"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "held_out": "yes", "layers": []}))
    with pytest.raises(ValueError, match="held_out must be true or false"):
        shapes.read_table(bad)


def test_1d_3d_and_per_dim_layers_make_their_problems():
    one = shapes.Layer.from_dict({"name": "a", "dims": 1, "N": 2, "W": 100, "C": 8, "K": 16, "S": 11, "stride": 2,
                                  "padding": 5})
    assert one.problem("fwd") == make_problem("fwd", (2, 100, 8), (16, 11, 8), stride=2, padding=5)
    assert one.label() == "1d 2,100,8->16, 11, s2 p5 d1"
    three = shapes.Layer.from_dict({"name": "b", "dims": 3, "N": 1, "D": 8, "H": 28, "W": 28, "C": 230, "K": 128,
                                    "T": 3, "R": 1, "stride": [2, 1, 1], "padding": [1, 0, 0]})
    assert three.filter == (3, 1, 1) and three.spatial == (8, 28, 28)
    assert three.problem("bwd_weight") == make_problem("bwd_weight", (1, 8, 28, 28, 230), (128, 3, 1, 1, 230),
                                                       stride=(2, 1, 1), padding=(1, 0, 0))
    assert three.label() == "3d 1,8,28,28,230->128, 3x1x1, s2x1x1 p1x0x0 d1"
    inception = shapes.Layer.from_dict({"name": "c", "N": 4, "H": 17, "W": 17, "C": 128, "K": 192, "R": 1, "S": 7,
                                        "padding": [0, 3]})
    assert inception.problem("fwd").y_shape == (4, 17, 17, 192)
    deconv = shapes.Layer.from_dict({"name": "d", "dims": 1, "N": 2, "W": 8, "C": 16, "K": 8, "S": 16, "stride": 8,
                                     "padding": 4, "transposed": True})
    assert deconv.problem("fwd").direction == "bwd_data" and deconv.problem("fwd").x_shape == (2, 64, 8)
    assert shapes.Layer("e", 2, 8, 8, 32, 32, 3, 3, padding=1).label() == "2,8,8,32->32, 3x3, s1 p1 d1"  # as before


@pytest.mark.parametrize("layer, match", [
    ({"dims": 1, "N": 1, "W": 8, "C": 2, "K": 2}, "needs its filter length S"),
    ({"N": 1, "H": 4, "W": 4, "C": 2, "K": 2, "R": 3, "D": 4}, r"\['D'\] must be 1"),
    ({"dims": 4, "N": 1, "H": 4, "W": 4, "C": 2, "K": 2, "R": 3}, "dims must be 1, 2 or 3"),
    ({"N": 1, "H": 4, "W": 4, "C": 2, "K": 2, "R": 3, "padding": [1, 1, 1]}, "padding must be an int or 2 ints"),
    ({"N": 1, "H": 4, "W": 4, "C": 2, "K": 2, "R": 3, "strides": 2}, r"unknown fields \['strides'\]"),
])
def test_bad_layers_are_refused_by_name(layer, match):
    with pytest.raises(ValueError, match=match):
        shapes.Layer.from_dict({"name": "x", **layer})


def test_the_tuner_refuses_the_held_out_table(capsys):
    """`python -m kernelgen tune unseen` is refused before anything is compiled or measured (exit 2, the table
    named), and tune() raises: a tuned unseen table would no longer measure unseen shapes."""
    from kernelgen.tuning import tuner
    assert tuner.main(["unseen"]) == 2
    assert "'unseen' is held out" in capsys.readouterr().err
    with pytest.raises(ValueError, match="held out"):
        tuner.tune("unseen")
