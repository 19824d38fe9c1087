"""Small test helpers built on public Keras APIs only.

Keras's own `keras.src.testing` is private, so kmix's tests use these:

- `assert_config_round_trip(obj)`: `get_config` -> `from_config` -> same config.
- `assert_model_round_trip(model, x)`: `model.save(".keras")` ->
  `keras.models.load_model` with no `custom_objects`, same predictions.
- `assert_layer_dtypes(make_layer, input_shape)`: builds the layer under
  several policies and checks the output dtype against `compute_output_spec`.
"""

import os
import tempfile

import keras
import numpy as np

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


def assert_config_round_trip(obj):
    """Asserts `type(obj).from_config(obj.get_config())` has the same config.

    Also goes through `keras.saving.serialize_keras_object` and back, which is
    what `model.save` does, so a class that is not registered fails here.

    Returns:
        The re-created object.
    """
    config = obj.get_config()
    clone = type(obj).from_config(config)
    assert clone.get_config() == config, (clone.get_config(), config)
    serialized = keras.saving.serialize_keras_object(obj)
    revived = keras.saving.deserialize_keras_object(serialized)
    assert type(revived) is type(obj), (type(revived), type(obj))
    assert revived.get_config() == config
    return clone


def assert_model_round_trip(model, x, atol=0.0):
    """Saves `model` to `.keras`, loads it with no `custom_objects`, compares.

    Args:
        model: a built Keras model.
        x: an input batch for `model.predict`.
        atol: allowed absolute difference between the two predictions.

    Returns:
        The loaded model.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    expected = _as_list(model.predict(x, verbose=0))
    got = _as_list(loaded.predict(x, verbose=0))
    for e, g in zip(expected, got):
        np.testing.assert_allclose(
            np.asarray(g, np.float64), np.asarray(e, np.float64), atol=atol, rtol=0
        )
    if getattr(model, "optimizer", None) is not None and getattr(loaded, "optimizer", None) is not None:
        assert type(loaded.optimizer) is type(model.optimizer)
        assert loaded.optimizer.get_config() == model.optimizer.get_config()
    return loaded


def assert_layer_dtypes(make_layer, input_shape, policies=POLICIES, input_dtype=None, call_kwargs=None):
    """Builds `make_layer()` under each policy and checks its output dtypes.

    The layer is created while the policy is the global one, called on a
    random input of `input_shape` (batch included), and every output's
    dtype must equal the dtype `compute_output_spec` announces.

    Args:
        make_layer: a function of no arguments returning a new layer.
        input_shape: the input's shape, batch included.
        policies: the policy names to try.
        input_dtype: the input's dtype; the policy's compute dtype by default.
        call_kwargs: extra keyword arguments for the call.
    """
    call_kwargs = call_kwargs or {}
    previous = keras.config.dtype_policy()
    try:
        for name in policies:
            keras.config.set_dtype_policy(name)
            layer = make_layer()
            dtype = input_dtype or layer.compute_dtype
            x = keras.ops.convert_to_tensor(
                np.random.default_rng(0).normal(size=input_shape), dtype=dtype
            )
            spec = layer.compute_output_spec(
                keras.KerasTensor(input_shape, dtype=dtype), **call_kwargs
            )
            y = layer(x, **call_kwargs)
            for out, out_spec in zip(_as_list(y), _as_list(spec)):
                assert keras.backend.standardize_dtype(out.dtype) == out_spec.dtype, (
                    name,
                    out.dtype,
                    out_spec.dtype,
                )
                assert tuple(out.shape) == tuple(
                    d if d is not None else out.shape[i] for i, d in enumerate(out_spec.shape)
                ), (name, out.shape, out_spec.shape)
    finally:
        keras.config.set_dtype_policy(previous)


def _as_list(x):
    if isinstance(x, dict):
        return [x[k] for k in sorted(x)]
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]
