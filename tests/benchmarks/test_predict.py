"""`python -m kmix bench predict`: a quick end-to-end run, and the routes' models against float32."""

import functools

import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix.benchmarks import predict, routes


def test_quick_run_prints_every_route(capsys, monkeypatch):
    """Every route of the quick run, against the float32 Keras outputs; the served rows' bytes and outputs.

    The device probe leaves XLA out (its `limit_s`): its three XLA compiles are not what this test checks, and
    the table keeps an XLA row of its own (float32, keras, XLA)."""
    monkeypatch.setattr(kmix.device, "probe", functools.partial(kmix.device.probe, limit_s=0.0))
    out = predict.main(["--quick", "--models", "gpt"])
    text = capsys.readouterr().out
    rec = out["recommendation"]
    expected = predict.routes(rec)
    assert [(r["policy"], r["stack"]) for r in out["results"]] == [(p, s) for p, s, _ in expected]
    base = out["results"][0]
    assert base["max_abs_diff"] == 0.0 and base["top1_agreement"] == 1.0
    for r in out["results"]:
        assert r["items_per_second"] == pytest.approx(2 * 16 / r["batch_seconds"])
        assert np.isfinite(r["max_abs_diff"]) and 0.0 <= r["top1_agreement"] <= 1.0
    # The half routes differ from float32 by rounding, not by more (untrained logits of order 1).
    bf16 = next(r for r in out["results"] if r["policy"] == "mixed_bfloat16")
    assert 0.0 < bf16["max_abs_diff"] < 0.1
    assert "top-1 = f32" in text and str(rec) in text
    # The served rows: Keras's float32 SavedModel computes the float32 model; kmix.export's artifact
    # rounds as bfloat16 does, in fewer bytes (at --quick sizes the graph, the same in both, weighs
    # as much as the weights; tests/serving/test_export.py checks 0.55x where the weights dominate).
    by_stack = {r["stack"]: r for r in out["results"]}
    keras_export, half = by_stack["keras-export"], by_stack["kmix.export"]
    assert keras_export["max_abs_diff"] < 1e-5 and 0.0 < half["max_abs_diff"] < 0.1
    assert half["bytes"] < 0.7 * keras_export["bytes"]
    assert half["load_seconds"] > 0 and by_stack["keras"]["bytes"] is None
    assert "gpt: fastest route here:" in text and "kmix.export's artifact at" in text


def test_fastest_lines_name_the_fastest_route_and_the_artifact_against_keras():
    rows = [dict(model="gpt", policy=p, stack=s, jit_compile=j, batch_seconds=t)
            for p, s, j, t in [("float32", "keras", False, 4.0), ("float32", "keras", True, 2.0),
                               ("float32", "keras-export", False, 1.0), ("bfloat16", "kmix.export", False, 2.5)]]
    lines = predict.fastest_lines(rows)
    assert lines == ["gpt: fastest route here: float32, keras-export, SavedModel",
                     "gpt: kmix.export's artifact at 0.80x the speed of the fastest Keras route (float32, keras, XLA)"]


def test_the_resnet_route_is_keras_resnet50():
    size = {"image": 32, "classes": 10, "batch": 2}
    model, data, items = routes.build("resnet50", size, "keras")
    assert model.name == "resnet50" and model.output_shape == (None, 10) and items == 2
    x, y = next(iter(data))
    assert x.shape == (2, 32, 32, 3) and y.shape == (2,)
    with pytest.raises(ValueError, match="model_name"):
        routes.build("vgg", size, "keras")


def test_grappler_rewrite_is_scoped():
    key = routes.rewrite_option()
    assert not tf.config.optimizer.get_experimental_options().get(key, False)
    with routes.grappler_rewrite():
        assert tf.config.optimizer.get_experimental_options()[key] is True
    assert not tf.config.optimizer.get_experimental_options().get(key, False)
    with pytest.raises(ValueError, match="stack"):
        routes.Route("gpt", {}, "float32", "torch", False)


@pytest.mark.parametrize("policy,exported", [("O1", "float16"), ("O1-bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                             (None, "bfloat16")])
def test_the_export_row_takes_the_recommended_half_dtype(policy, exported):
    """The recommendation's policy is its name: the export row's dtype is the half it computes in (else bfloat16)."""
    import types

    rec = None if policy is None else types.SimpleNamespace(policy=policy, jit_compile=False)
    assert predict.routes(rec)[-1] == (exported, "kmix.export", False)
