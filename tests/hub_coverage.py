"""One keras-hub architecture in float32, under plain Keras mixed precision, and under kmix.

`check(name, half)` builds `tests.hub_zoo.ZOO[name]` three times from the same
float32 weights and compares:

1. float32 (the reference): global policy `"float32"`, outputs `y32`;
2. plain Keras: global policy `mixed_<half>` while building, outputs, error
   against `y32`, and whether a `.keras` save -> `keras.models.load_model`
   predicts bitwise what the model predicted;
3. kmix: built in float32, `kmix.autocast(model, "O1-bfloat16" | "O1")`
   (warnings kept), outputs, error, and the same reload check;
4. with `fit=True`, two epochs of `fit` (one batch of the two rows) of the
   kmix model with a head (the mean of the backbone's first float output,
   in float32) under `kmix.wrap(SGD)`, against the same two SGD steps run
   by hand on the float32 model (a tape's gradients; plain Keras's `fit`
   is recorded too, with `record=True`).

Error = max over float outputs of `max|y - y32| / max|y32|` (float64; integer
outputs ignored; a non-finite output gives `inf`). The returned `Row` holds
every figure and `Row.failures()` lists the criteria kmix misses.

    row = check("GemmaBackbone", "bfloat16")
    row.kmix_error, row.kmix_reload, row.fit_losses   # the figures
    row.failures()                                    # [] when kmix meets every criterion

`record=False` (the tests) leaves out what no criterion reads: plain Keras's
`fit`, and plain Keras's reload where kmix's is exact.

The float32 weights are drawn after `keras.utils.set_random_seed(0)`, so a
row's figures are the same from run to run on one machine.
"""

import os
import tempfile
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix._tree import walk
from tests.hub_row import KEPT_TO_KERAS, TOLERANCE, Reload, Row, first_line  # noqa: F401  (re-exported)
from tests.hub_zoo import ZOO

MAX_SKIPPED = 16
"""Steps a dynamic loss scale may skip (halving the scale each time: from 2^15 down to 1) before the two applied ones."""

STEP_SHARE = 0.25
"""The float32 step moves the head an eighth of the way to the target (the loss falls ~23%)."""


def _floats(outputs):
    """The float outputs of a call, flattened, as float64 numpy arrays."""
    flat = []
    for tensor in keras.tree.flatten(outputs):
        if keras.backend.is_float_dtype(keras.backend.standardize_dtype(tensor.dtype)):
            flat.append(np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(tensor, "float32")), np.float64))
    return flat


def _error(outputs, reference):
    """max over outputs of max|y - y32| / max|y32|; `inf` for a non-finite output."""
    worst = 0.0
    for y, y32 in zip(outputs, reference, strict=True):
        if not np.all(np.isfinite(y)):
            return float("inf")
        scale = max(np.max(np.abs(y32)), np.finfo(np.float32).tiny) if y32.size else 1.0
        worst = max(worst, float(np.max(np.abs(y - y32), initial=0.0) / scale))
    return worst


def _reload(model, x, predicted, load=keras.models.load_model):
    """Saves `model` to a temporary `.keras` file, `load`s it under float32 and compares its outputs."""
    previous = keras.config.dtype_policy()
    try:
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "model.keras")
            model.save(path)
            keras.config.set_dtype_policy("float32")
            again = _floats(load(path)(x, training=False))
    except Exception as error:  # noqa: BLE001  (any crash is an outcome to record)
        return Reload("crash", message=first_line(error))
    finally:
        keras.config.set_dtype_policy(previous)
    if all(np.array_equal(a, b, equal_nan=True) for a, b in zip(again, predicted, strict=True)):
        return Reload("exact")
    diff = max(float(np.nanmax(np.abs(a - b), initial=0.0)) for a, b in zip(again, predicted, strict=True))
    return Reload("differs", diff=diff if np.isfinite(diff) else float("inf"))


def _reload_as_advised(model, x, predicted, policy, messages):
    """The reload kmix's warning tells the user to do, or None where no warning says how.

    `with kmix.policy_scope(P): keras.models.load_model(path)` where a warning
    names `P`; `kmix.autocast(keras.models.load_model(path), policy)` where it
    says to autocast the reloaded model again.
    """
    scope = next((m.split("kmix.policy_scope('")[1].split("'")[0] for m in messages
                  if "kmix.autocast" in m and "kmix.policy_scope('" in m), None)
    again = any("kmix.autocast" in m and "call `kmix.autocast` on it again" in m for m in messages)
    if scope is None and not again:
        return None

    def load(path):
        if scope is not None:
            with kmix.policy_scope(scope):
                return keras.models.load_model(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kmix.autocast(keras.models.load_model(path), policy)

    return _reload(model, x, predicted, load)


def _distinct(caught):
    """The distinct messages of recorded warnings, in order; a category other than UserWarning named."""
    messages = []
    for warning in caught:
        message = str(warning.message)
        if warning.category is not UserWarning:
            message = f"{warning.category.__name__}: {message}"
        if message not in messages:
            messages.append(message)
    return messages


def _build(name, policy):
    """`ZOO[name]()` under the global `policy`, restored afterwards, in a fresh session."""
    previous = keras.config.dtype_policy()
    keras.backend.clear_session(free_memory=False)
    keras.config.set_dtype_policy(policy)
    try:
        return ZOO[name]()
    finally:
        keras.config.set_dtype_policy(previous)


def _with_head(backbone):
    """`keras.Model(backbone.input, mean of its first float output in float32)`, its dropouts off.

    A block may hard-code its dropout (SegFormer's attention: 0.1) where a
    builder cannot set it: training steps compare only without it.
    """
    for _, layer, _ in walk(backbone):
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    inputs = backbone.input
    outputs = [
        y for y in keras.tree.flatten(backbone(inputs))
        if keras.backend.is_float_dtype(keras.backend.standardize_dtype(y.dtype))
    ]
    head = keras.ops.cast(outputs[0], "float32")
    head = keras.ops.mean(head, axis=tuple(range(1, len(head.shape))))
    return keras.Model(inputs, head)


def _training_loss(model, x, target):
    """`mean((model(x, training=True) - target)^2)` plus the model's own losses (a router's)."""
    loss = keras.ops.mean(keras.ops.square(model(x, training=True) - target))
    if model.losses:
        loss = loss + keras.ops.sum(keras.ops.stack([keras.ops.cast(v, "float32") for v in model.losses]))
    return loss


def _reference_steps(model32, x, scale):
    """float32's two losses, by hand: the loss, one SGD step moving the head 1/8 of the way, the loss.

    The target is `scale` away from float32's head and the loss `(head - target)^2`
    (plus the model's own losses), so a step of `STEP_SHARE * loss / |grad|^2`
    moves the head about `STEP_SHARE / 2` of the way: every model's loss visibly
    falls, whatever its gradients' scale. The step is `keras.optimizers.SGD`'s
    without momentum, `w -= rate * grad`, applied to `model32`'s variables.

    Returns:
        `(target, rate, [loss before, loss after the step])`.

    Raises:
        ValueError: where two calls in training give two losses (dropout):
            no other run could then be compared with this one.
    """
    head = keras.ops.convert_to_numpy(model32(x, training=False)).astype(np.float64)
    target = (head + scale).astype(np.float32)
    variables = model32.trainable_variables
    with tf.GradientTape() as tape:
        loss = _training_loss(model32, x, target)
    grads = [None if g is None else tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
    again = _training_loss(model32, x, target)
    if float(again) != float(loss):
        raise ValueError(
            f"the model trains at random: two calls in training give the losses {float(loss):.6g} and "
            f"{float(again):.6g}; build it without dropout (dropout=0) so that runs compare"
        )
    norm2 = float(sum(keras.ops.convert_to_numpy(keras.ops.sum(keras.ops.square(
        keras.ops.cast(g, "float32")))) for g in grads if g is not None))
    rate = STEP_SHARE * float(loss) / norm2 if norm2 > 0 and np.isfinite(norm2) else 1e-3
    for variable, grad in zip(variables, grads):
        if grad is not None:
            variable.assign_sub(keras.ops.cast(rate, variable.dtype) * keras.ops.cast(grad, variable.dtype))
    return target, rate, [float(loss), float(_training_loss(model32, x, target))]


def _fit(model, x, target, rate, policy=None):
    """Two applied steps of `fit` on the one batch: `(losses, steps skipped)`. `policy`: kmix's.

    A loss-scale optimizer skips a step whose scaled gradients overflow (and
    halves its scale), without advancing `iterations`: the losses are those
    seen before the first and the second applied update, skipped steps left
    out (at most `MAX_SKIPPED` of them), as float32 applies every step.
    """
    model.trainable = True
    if policy is None:
        model.compile(optimizer=keras.optimizers.SGD(rate), loss="mse", jit_compile=False)
    else:
        with kmix.policy_scope(policy):
            model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(rate)), loss="mse", jit_compile=False)
    # Built before `fit`, as Keras builds it under a distribution strategy: built in the first
    # trace of the train step instead, a loss scale's counters make TensorFlow trace it twice.
    model.optimizer.build(model.trainable_variables)
    losses, skipped = {}, 0
    for _ in range(2 + MAX_SKIPPED):
        applied = int(model.optimizer.iterations)
        history = model.fit(x, target, batch_size=2, epochs=1, shuffle=False, verbose=0)
        losses.setdefault(applied, float(history.history["loss"][0]))
        if int(model.optimizer.iterations) == applied:
            skipped += 1
        if len(losses) == 2 and 1 in losses:
            break
    return [losses[k] for k in sorted(losses)][:2], skipped


def _fit_keras(backbone, x, target, rate, half):
    """Plain Keras's two epochs: the head built under `mixed_<half>` (Keras then scales float16 losses)."""
    previous = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy(f"mixed_{half}")
        model = _with_head(backbone)
        return _fit(model, x, target, rate)[0], None
    except Exception as error:  # noqa: BLE001
        return None, first_line(error)
    finally:
        keras.config.set_dtype_policy(previous)


def check(name, half, fit=True, record=True):
    """Compares `ZOO[name]` in float32, under plain Keras `mixed_<half>` and under kmix.

    Args:
        name: a key of `tests.hub_zoo.ZOO` (`"GemmaBackbone"`).
        half: `"bfloat16"` or `"float16"`.
        fit: also compare two epochs of `fit` (kmix's against float32's).
        record: also measure what only the record reads (`tools/hub_matrix.py`'s
            table), no criterion of `Row.failures()`: plain Keras's `fit`, and
            plain Keras's reload where kmix's is exact. `Row.failures()` is the
            same either way.

    Returns:
        A `Row`. The global dtype policy is as it was, afterwards.
    """
    if half not in TOLERANCE:
        raise ValueError(f"`half` must be 'bfloat16' or 'float16'. Received: half={half!r}.")
    entry = keras.config.dtype_policy()
    try:
        return _check(name, half, fit, record)
    finally:
        keras.config.set_dtype_policy(entry)
        keras.backend.clear_session(free_memory=False)


def _check(name, half, fit, record):
    row = Row(name, half)
    policy = "O1-bfloat16" if half == "bfloat16" else "O1"
    started = time.perf_counter()

    def lap(part):
        nonlocal started
        row.seconds[part] = round(time.perf_counter() - started, 2)
        started = time.perf_counter()

    try:  # 1. float32, the reference (seeded: the same weights from run to run)
        keras.utils.set_random_seed(0)
        model32, x = _build(name, "float32")
        y32 = _floats(model32(x, training=False))
        weights = model32.get_weights()
    except Exception as error:  # noqa: BLE001
        row.reference_crash = first_line(error)
        return row
    finally:
        lap("float32")

    mixed = y_mixed = None
    try:  # 2. plain Keras mixed precision (its reload: below, where kmix's is not exact or `record`)
        previous = keras.config.dtype_policy()
        try:
            keras.backend.clear_session(free_memory=False)
            keras.config.set_dtype_policy(f"mixed_{half}")
            mixed, _ = ZOO[name]()
            mixed.set_weights(weights)
            y_mixed = _floats(mixed(x, training=False))
        finally:
            keras.config.set_dtype_policy(previous)
        row.keras_error = _error(y_mixed, y32)
        if record:
            row.keras_reload = _reload(mixed, x, y_mixed)
    except Exception as error:  # noqa: BLE001
        row.keras_crash = first_line(error)
    finally:
        lap("keras")

    try:  # 3. kmix
        placed, _ = _build(name, "float32")
        placed.set_weights(weights)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                began = time.perf_counter()
                _, placements = kmix.autocast(placed, policy, return_table=True)
                row.seconds["autocast"] = round(time.perf_counter() - began, 2)
            finally:
                row.kmix_warnings = _distinct(caught)
        row.kmix_layers = (sum("16" in placement.after for placement in placements), len(placements))
        y = _floats(placed(x, training=False))
        row.kmix_error = _error(y, y32)
        row.kmix_reload = _reload(placed, x, y)
        if row.kmix_reload.status != "exact":
            row.kmix_reload_advised = _reload_as_advised(placed, x, y, policy, row.kmix_warnings)
            if row.keras_reload is None and not row.keras_crash:  # what `Row.reload_as_advised` reads
                row.keras_reload = _reload(mixed, x, y_mixed)
    except Exception as error:  # noqa: BLE001
        row.kmix_crash = first_line(error)
    finally:
        lap("kmix")

    if fit and not row.kmix_crash:  # 4. two epochs of fit, against float32's two steps by hand
        try:
            head32 = _with_head(model32)
            target, rate, row.fit_losses32 = _reference_steps(head32, x, max(float(np.max(np.abs(y32[0]))), 1e-3))
        except Exception as error:  # noqa: BLE001
            row.fit_reference = first_line(error)
        if not row.fit_reference:
            try:
                row.fit_losses, row.fit_skipped = _fit(_with_head(placed), x, target, rate, policy)
            except Exception as error:  # noqa: BLE001
                row.fit_crash = first_line(error)
            if record and not row.keras_crash:
                row.keras_fit_losses, row.keras_fit_crash = _fit_keras(mixed, x, target, rate, half)
            # The first loss is (scale - d)^2 with |d| <= error * scale: within (2t + t^2) of
            # float32's; the second also carries the update's error (at most t of a ~23% step).
            t = row.tolerance
            row.fit_tolerance = (2 * t + t * t + STEP_SHARE * t) * row.fit_losses32[0]
        lap("fit")
    return row
