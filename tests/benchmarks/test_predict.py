"""`python -m kmix bench predict`: a quick end-to-end run, and the routes' models against float32."""

import numpy as np
import pytest
import tensorflow as tf

from kmix.benchmarks import predict, routes


def test_quick_run_prints_every_route(capsys):
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
