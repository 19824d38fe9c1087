"""Placing a plan on the model itself: each layer's own policy, the safe classes, the variables' dtype.

Keras 3 layers take a new `dtype_policy` in place (a settable property). For
policies whose variables stay float32 (O1, `mixed_float16`, `mixed_bfloat16`)
only the compute dtype changes: the variables, the optimizer's references to
them and the user's handles on the layers are untouched, as with Apex's
`amp.initialize`. Under half-parameter policies (O2, O3) a layer's float
variables are recast to the half dtype in place (the same `keras.Variable`
objects, new storage), which is safe while no optimizer holds state for them
and they were not made under a `tf.distribute` strategy (`recast_blocker`).
"""

import warnings

import keras
import tensorflow as tf

from kmix import _compat
from kmix._tree import own_weights, resolved_policy
from kmix.ops import float32_out
from kmix.placing.rules import Kind, safe_replacements


def place(plan):
    """Sets the policy `plan` gives each layer on the layer itself; swaps in kmix's safe classes.

    Args:
        plan: a `rules.Plan`; parents come before the layers inside them.
    """
    swaps = safe_replacements()
    for row in plan:
        if row.dtype is None:
            continue
        if row.kind is Kind.SAFE_CLASS and type(row.layer) in swaps:
            swap_class(row.layer, swaps[type(row.layer)])
        set_output_dtype(row.layer, float32=row.kind is Kind.HALF_OUT)
        set_policy(row.layer, row.dtype)


def set_policy(layer, dtype):
    """Gives `layer` the Keras policy `dtype`: its compute dtype, its float variables and constants.

    A float variable in the layer's old variable dtype takes the new one (a
    variable the layer made in a fixed dtype of its own keeps it); a float
    tensor the layer holds as an attribute in its old compute dtype (a
    `Normalization`'s mean, made when it was built) is cast to the new one,
    as building the layer under the new policy would have made it.
    """
    old, new = resolved_policy(layer), keras.DTypePolicy(dtype)
    if old.name == new.name:
        return
    if old.variable_dtype != new.variable_dtype:
        fixed = fixed_dtype_variables(layer, new)
        for variable in own_weights(layer):
            if keras.backend.standardize_dtype(variable.dtype) == old.variable_dtype and id(variable) not in fixed:
                _compat.recast_variable(variable, new.variable_dtype)
    layer.dtype_policy = new
    if old.compute_dtype != new.compute_dtype:
        for name, value in list(vars(layer).items()):
            if is_constant(value) and keras.backend.standardize_dtype(value.dtype) == old.compute_dtype:
                setattr(layer, name, keras.ops.cast(value, new.compute_dtype))


def fixed_dtype_variables(layer, policy):
    """The ids of `layer`'s own variables that it makes in a dtype of its own whatever its policy.

    Keras makes LoRA adapters (`lora_kernel_a`, ...) with `dtype="float32"`,
    and its own half policies keep them so; a custom layer may do the same.
    The layer is made again from its config under `policy` and built without
    weights (`keras.StatelessScope`): a variable it makes in another dtype
    than `policy`'s is one of these, and a reload makes it so too. Where the
    layer cannot be made so, the variables named `lora_*` are.
    """
    weights = own_weights(layer)
    try:
        with _compat.stateless(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin = type(layer).from_config({**layer.get_config(), "dtype": policy})
            twin.build_from_config(layer.get_build_config())
        theirs = own_weights(twin)
    except Exception:  # noqa: BLE001  a layer that cannot be rebuilt alone: read the names
        theirs = None
    if theirs is None or [v.name for v in theirs] != [v.name for v in weights]:
        return {id(v) for v in weights if v.name.startswith("lora_")}
    return {id(v) for v, t in zip(weights, theirs)
            if keras.backend.standardize_dtype(t.dtype) != policy.variable_dtype}


def set_output_dtype(layer, float32):
    """Gives `layer` its activation's float32-out form (`kmix.ops.float32_out`), or takes it back.

    A layer producing a model output computes its matmul in half and hands
    float32 out; placed otherwise (float32, or inside the model), it gets its
    plain activation back. The activation is in the layer's config: a reload
    rebuilds it.
    """
    activation = getattr(layer, "activation", None)
    if float32 and not float32_out.is_wrapped(activation):
        layer.activation = float32_out.wrap(activation)
    elif not float32 and float32_out.is_wrapped(activation):
        layer.activation = float32_out.unwrap(activation)


def swap_class(layer, new_cls):
    """Makes a Keras `Softmax` / `MultiHeadAttention` a kmix one: the same object, weights and config.

    kmix's classes subclass Keras's and add no state but `Softmax`'s
    `output_dtype` (None: the compute dtype) and its `autocast=False` (its
    float32 arithmetic reads half inputs as they are).
    """
    layer.__class__ = new_cls
    if isinstance(layer, keras.layers.Softmax):
        layer.output_dtype, layer.autocast = None, False


def recast_blocker(model, plan):
    """Why `plan` cannot recast `model`'s variables in place, or None when it can (or needs not).

    A built optimizer holds slots made for the old dtype, and variables made
    under a `tf.distribute` strategy are mirrored per replica: replacing
    their storage would leave those behind.
    """
    changes = [
        row.layer for row in plan
        if row.dtype is not None and own_weights(row.layer)
        and keras.DTypePolicy(row.dtype).variable_dtype != resolved_policy(row.layer).variable_dtype
    ]
    if not changes:
        return None
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False) and optimizer.variables:
        return f"its optimizer {type(optimizer).__name__} is built and holds state for the float32 variables"
    if _compat.model_distribute_strategy(model) is not None:
        return "its variables were made under a tf.distribute strategy (one copy per replica)"
    return None


def reset_compiled_functions(model):
    """Drops the train / test / predict functions Keras compiled for the old placement."""
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)


def is_constant(value):
    """A float tensor (not a variable): what a layer may hold as an attribute, computed when built."""
    return (
        hasattr(value, "dtype")  # quick: most attributes are no tensor
        and keras.ops.is_tensor(value)
        and not isinstance(value, keras.Variable)
        and not isinstance(value, tf.Variable)
        and keras.backend.is_float_dtype(keras.backend.standardize_dtype(value.dtype))
    )
