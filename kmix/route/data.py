"""The batch `kmix.recommend` times, checked at the call: it fits the model, and what it holds.

A batch that does not fit the model is refused before anything is timed,
naming the argument; one holding NaN or inf is timed (a skipped step costs
what a step costs), and the recommendation says so.

    >>> check_fits(model, x, "x")          # ValueError naming `x` when the model cannot take it
    >>> nonfinite_notes((x, y, "a batch"))  # [] or one line per argument holding NaN / inf
"""

import numpy as np


def check_fits(model, x, name):
    """Calls `model` on one row of `x`; a ValueError naming `name` when it cannot take it.

    Args:
        model: the user's model.
        x: the batch's inputs (tensors, or a list / dict of them).
        name: the argument they came from (`"x"` or `"sample"`).
    """
    import keras

    one = keras.tree.map_structure(lambda t: t[:1], x)
    try:
        model(one, training=False)
    except Exception as e:  # noqa: BLE001  a shape or dtype error comes as many error types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"`{name}` does not fit model {model.name!r}, which takes {_expected(model)}. Received: {name} "
            f"with {_shapes(x)}. ({type(e).__name__}: {first[:300]})"
        ) from None


def nonfinite_notes(batch, name=None):
    """One line per argument of `batch` `(x, y, description)` that holds NaN or inf (an empty list when none).

    `name` names the argument both came from (`"sample"`), else `x` and `y`.
    """
    import keras

    notes = []
    for part, label in zip(batch[:2], ("x", "y")):
        counts = [_nonfinite(t) for t in keras.tree.flatten(part)]
        if sum(counts):
            where = f"{name}'s {label}" if name else label
            notes.append(
                f"`{where}` holds {sum(counts)} NaN or inf value(s) in the batch timed: the timings stand "
                "(kmix.wrap skips a non-finite step at a step's cost), but a model trained on such data "
                "learns nothing from those steps: clean or mask the data first."
            )
    return notes


def _nonfinite(tensor):
    value = np.asarray(tensor)
    if value.dtype.name in ("bfloat16", "float16"):
        value = value.astype("float32")
    if not np.issubdtype(value.dtype, np.floating):
        return 0
    return int(value.size - np.count_nonzero(np.isfinite(value)))


def _shapes(x):
    import keras

    shapes = [tuple(t.shape) for t in keras.tree.flatten(x)]
    return f"shape {shapes[0]}" if len(shapes) == 1 else f"shapes {shapes}"


def _expected(model):
    """The model's input shapes as its graph knows them, else what its layers say."""
    import keras

    try:
        shapes = [tuple(t.shape) for t in keras.tree.flatten(model.inputs)]
    except (AttributeError, ValueError):
        shapes = []
    if not shapes:
        return "inputs it was built for"
    return f"input shape {shapes[0]}" if len(shapes) == 1 else f"input shapes {shapes}"
