"""What `kmix.recommend` receives, checked at the call, naming the argument: the batch, the loss, the optimizer."""

import keras
import numpy as np
import tensorflow as tf

from kmix import _checks
from kmix.diagnose.data import first_line, float_values

BATCH_SIZE = 32  # rows timed when `batch_size` is not given, as `fit`'s default


def first_batch(x, y, sample, batch_size):
    """One batch `(x, y, description)` of tensors from `recommend`'s `x`, `y` (or a dataset) or `sample`."""
    if sample is not None:
        if x is not None or y is not None:
            raise ValueError("Pass the data as `x=`, `y=` or as `sample=`, not both. "
                             f"Received: sample and x={type(x).__name__}, y={type(y).__name__}.")
        if isinstance(sample, tf.data.Dataset):
            return _dataset_batch(sample, "sample")
        if isinstance(sample, (tuple, list)) and len(sample) in (2, 3):
            _check_rows(sample[0], sample[1], "sample's x", "sample's y")
            return _tensors(sample[0]), _tensors(sample[1]), "the batch given"
        raise TypeError("`sample` must be a batch `(x, y)` or a `tf.data.Dataset` of batches. "
                        f"Received: sample of type {type(sample).__name__}.")
    if isinstance(x, tf.data.Dataset):
        return _dataset_batch(x, "x")
    if x is None or y is None:
        raise ValueError("`kmix.recommend(model, ...)` times your training step on your data: pass `x=` and `y=`, "
                         f"`sample=(x, y)` or a dataset. Received: x={type(x).__name__}, y={type(y).__name__}.")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise ValueError(f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}")
    _check_rows(x, y, "x", "y")  # on the arrays as given: only the rows timed are converted
    rows = BATCH_SIZE if batch_size is None else int(batch_size)
    x, y = [_tensors(keras.tree.map_structure(lambda t: t[:rows], data)) for data in (x, y)]
    return x, y, f"a batch of {_rows(x, 'x')} rows"


def _dataset_batch(dataset, name):
    batch = next(iter(dataset), None)
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError("The dataset must yield batches `(x, y)` (or `(x, y, sample_weight)`). "
                         f"Received: {name}=a dataset whose first element is of type {type(batch).__name__}.")
    _check_rows(batch[0], batch[1], f"{name}'s first batch's x", f"{name}'s first batch's y")
    return _tensors(batch[0]), _tensors(batch[1]), "the dataset's first batch"


def _check_rows(x, y, x_name, y_name):
    """A ValueError naming the argument where `x` has no rows, or `y`'s rows differ from `x`'s."""
    rows = _rows(x, x_name)
    if rows == 0:
        raise ValueError(f"`{x_name}` holds 0 rows: kmix.recommend times a training step on at least one. "
                         f"Received: {x_name} with {_shapes(x)}.")
    if _rows(y, y_name) != rows:
        raise ValueError(f"`{y_name}` must have one row per row of `{x_name}` ({rows}). Received: {y_name} with "
                         f"{_shapes(y)}, {x_name} with {_shapes(x)}.")


def _rows(data, name):
    """The rows every array of `data` has; a ValueError naming `name` where they differ or one has no axis."""
    shapes = [_shape(t) for t in keras.tree.flatten(data)]
    rows = {shape[0] if shape else None for shape in shapes}
    if None in rows or len(rows) != 1:
        raise ValueError(f"`{name}` must hold arrays of one row per example, the same rows in each. "
                         f"Received: {name} with {_shapes(data)}.")
    return rows.pop()


def _shape(array):
    return tuple(np.shape(array) if getattr(array, "shape", None) is None else array.shape)


def _tensors(data):
    return keras.tree.map_structure(tf.convert_to_tensor, data)


def check_optimizer(optimizer):
    """`optimizer` unchanged where it is None, a Keras optimizer, its name or its config dict; else an error."""
    if optimizer is not None:
        _checks.optimizer(optimizer)
    return optimizer


def training_setup(model, loss, optimizer):
    """The loss and optimizer each route compiles with: the arguments, else the model's compile."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model of type {type(model).__name__}.")
    loss = loss if loss is not None else getattr(model, "loss", None)
    if loss is None:
        raise ValueError(f"kmix.recommend times the training step of model {model.name!r}, which needs its "
                         "loss: compile the model first, or pass `loss=`. Received: loss=None.")
    optimizer = check_optimizer(optimizer) if optimizer is not None else getattr(model, "optimizer", None)
    return loss, optimizer if optimizer is not None else "adam"


def fresh_optimizer(optimizer, learning_rate=None):
    """A new optimizer with `optimizer`'s settings (a loss-scale one's inner), `learning_rate` replacing its own."""
    optimizer = keras.optimizers.get(optimizer) if isinstance(optimizer, (str, dict)) else optimizer
    optimizer = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    config = optimizer.get_config()
    if learning_rate is not None:
        config["learning_rate"] = learning_rate
    return type(optimizer).from_config(config)


def still_at_zero(optimizer):
    """Whether `optimizer`'s kind, at learning rate 0, leaves a scratch variable bit for bit as it was (two steps)."""
    try:
        probe = fresh_optimizer(optimizer, learning_rate=0.0)
        rng = np.random.default_rng(0)
        start = rng.standard_normal((4, 3)).astype("float32")
        variable = tf.Variable(start)
        for _ in range(2):
            probe.apply_gradients([(tf.constant(rng.standard_normal((4, 3)).astype("float32")), variable)])
        return bool(np.array_equal(variable.numpy(), start))
    except Exception:  # noqa: BLE001  any failure of a user's optimizer on a scratch variable: keep the copy
        return False


def check_fits(model, x, name):
    """Calls `model` on one row of `x`; a ValueError naming `name` (`"x"` or `"sample"`) when it cannot take it."""
    one = keras.tree.map_structure(lambda t: t[:1], x)
    try:
        model(one, training=False)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, NotImplementedError,
            tf.errors.OpError) as e:  # a shape or dtype error, as Keras or TensorFlow raises it
        raise ValueError(f"`{name}` does not fit model {model.name!r}, which takes {_expected(model)}. Received: "
                         f"{name} with {_shapes(x)}. ({type(e).__name__}: {first_line(e, 300)})") from None


def nonfinite_notes(batch, name=None):
    """One line per argument of `batch` `(x, y, description)` holding NaN or inf; `name`: where both came from."""
    notes = []
    for part, label in zip(batch[:2], ("x", "y")):
        values = [v for v in map(float_values, keras.tree.flatten(part)) if v is not None]
        count = sum(int(v.size - np.count_nonzero(np.isfinite(v))) for v in values)
        if count:
            where = f"{name}'s {label}" if name else label
            notes.append(f"`{where}` holds {count} NaN or inf value(s) in the batch timed: the timings stand "
                         "(kmix.wrap skips a non-finite step at a step's cost), but a model trained on such data "
                         "learns nothing from those steps: clean or mask the data first.")
    return notes


def _shapes(x):
    shapes = [_shape(t) for t in keras.tree.flatten(x)]
    return f"shape {shapes[0]}" if len(shapes) == 1 else f"shapes {shapes}"


def _expected(model):
    """The model's input shapes as its graph knows them, else what its layers say."""
    try:
        inputs = keras.tree.flatten(model.inputs)
    except (AttributeError, ValueError):
        inputs = []
    return f"input {_shapes(inputs)}" if inputs else "inputs it was built for"
