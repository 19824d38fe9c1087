"""Small test helpers built on public Keras APIs only.

Keras's own `keras.src.testing` is private, so kmix's tests use these:

- `assert_config_round_trip(obj)`: `get_config` -> `from_config` -> same config.
- `assert_model_round_trip(model, x)`: `model.save(".keras")` ->
  `keras.models.load_model` with no `custom_objects`, same predictions.
- `assert_placement_survives_reload(model, x)`: the model in memory and
  after `.keras` save / `load_model` predict bitwise the same and list the
  same placement (`placement_listing`).
- `assert_layer_dtypes(make_layer, input_shape)`: builds the layer under
  several policies and checks the output dtype against `compute_output_spec`.
"""

import collections
import contextlib
import os
import re
import tempfile

import keras
import numpy as np

from kmix import _compat

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# `KMIX_FULL_TESTS=1`: the larger cases too (more architectures, builders and real models), which
# would take the default run past its 12 minutes on 2 cores; `full_only` marks them.
FULL = os.environ.get("KMIX_FULL_TESTS") == "1"


def full_only(why):
    """A pytest mark skipping a case unless `KMIX_FULL_TESTS=1`; `why` says what it costs."""
    import pytest

    return pytest.mark.skipif(not FULL, reason=f"{why}; set KMIX_FULL_TESTS=1 to run it")


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


def placement_listing(model):
    """Where each layer inside `model` computes and keeps its state, nested layers included.

    Returns:
        A dict from the layer's path (names joined by `/` from `model` down)
        to `(class name, compute dtype, variable dtype, (weight dtype, ...),
        ((constant name, dtype), ...))`: the weights are the layer's own (not
        those of the layers inside it), in order, non-trainable ones
        (batch-norm statistics) included; the constants are the tensors it
        holds as attributes (a `Normalization`'s `mean` and `variance` given
        to its constructor). Weight names are left out: Keras numbers unnamed
        ones (`variable_36`) by a global counter, so a reloaded copy's differ.
    """
    listing = {}
    seen = {id(model)}

    def visit(layer, prefix):
        # `model.layers` is public; a custom layer's or a block's sub-layers have no public
        # accessor (kmix._compat.sublayers says why).
        children = layer.layers if isinstance(layer, keras.Model) else _compat.sublayers(layer)
        counts = collections.Counter()
        for child in children:
            if id(child) in seen or isinstance(child, keras.layers.InputLayer):
                continue
            seen.add(id(child))
            path = prefix + _stable_name(child, counts)
            inner = {id(v) for sub in _compat.sublayers(child) for v in sub.weights}
            own = tuple(keras.backend.standardize_dtype(v.dtype) for v in child.weights if id(v) not in inner)
            constants = tuple(
                (name, keras.backend.standardize_dtype(value.dtype))
                for name, value in sorted(vars(child).items())
                if hasattr(value, "dtype") and hasattr(value, "shape")  # cheap first: is_tensor is slow on all
                and keras.ops.is_tensor(value) and not isinstance(value, keras.Variable)
            )
            listing[path] = (type(child).__name__, child.compute_dtype, child.variable_dtype, own, constants)
            visit(child, path + "/")

    visit(model, "")
    return listing


def _stable_name(layer, counts):
    """The layer's name, or `softmax[1]` for one Keras named by its global counter (`softmax_6`).

    A block creates its unnamed sub-layers anew in a reloaded model, where the
    counter has moved on; their order among their siblings stays.
    """
    base = re.sub("([a-z])([A-Z])", r"\1_\2", re.sub("(.)([A-Z][a-z]+)", r"\1_\2", type(layer).__name__)).lower()
    if not re.fullmatch(re.escape(base) + r"(_\d+)?", layer.name):
        return layer.name
    counts[base] += 1
    return f"{base}[{counts[base] - 1}]"


def assert_placement_survives_reload(model, x, outputs=None):
    """Asserts a placed model is the same model after `.keras` save and `load_model`.

    The invariant of every model kmix places: the copy in memory and the one
    `keras.models.load_model` (no `custom_objects`) gives back predict
    bitwise the same (`model(x, training=False)`, output dtypes included),
    have the same class, and list the same placement (`placement_listing`:
    each layer's compute and variable dtype and the dtype of each of its
    weights).

    Args:
        model: a built Keras model (an `autocast` copy, say).
        x: an input batch.
        outputs: `model(x, training=False)` if already computed (it is
            computed otherwise).

    Returns:
        The loaded model.
    """
    if outputs is None:
        outputs = model(x, training=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    assert type(loaded) is type(model), (type(loaded), type(model))
    before, after = placement_listing(model), placement_listing(loaded)
    differences = {
        path: (before.get(path), after.get(path))
        for path in sorted(set(before) | set(after))
        if before.get(path) != after.get(path)
    }
    assert not differences, f"placement (in memory, reloaded) differs for {len(differences)} layers: {differences}"
    expected = keras.tree.flatten(outputs)
    got = keras.tree.flatten(loaded(x, training=False))
    assert len(got) == len(expected), (len(got), len(expected))
    for i, (e, g) in enumerate(zip(expected, got)):
        e, g = keras.ops.convert_to_numpy(e), keras.ops.convert_to_numpy(g)
        assert g.dtype == e.dtype, f"output {i}: dtype {g.dtype} after the reload, {e.dtype} in memory"
        np.testing.assert_array_equal(g, e, err_msg=f"output {i}: in memory vs reloaded")
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


@contextlib.contextmanager
def created_variables():
    """Every TensorFlow variable created inside the block, autocast's own included, in a list it yields.

    Counting what a call creates is how the tests hold kmix's calls to no second copy of the
    user's weights, whatever the machine (issue 38).
    """
    import tensorflow as tf

    created = []

    def creator(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        created.append(variable)
        return variable

    with tf.variable_creator_scope(creator):
        yield created
