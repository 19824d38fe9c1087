"""`kmix.memory_report`: what training a model costs in memory under each policy.

Master-weight and optimizer-slot bytes are measured: the optimizer is built,
as `kmix.wrap` would build it, on a probe variable of the policy's parameter
dtype. docs/guide.md gives the bytes per parameter of each opt level.
"""

import math
import numbers

import keras
import numpy as np

from kmix import _checks as checks
from kmix.policy.policy import _OPT_LEVELS, Policy, parse

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_PARTS = ("params", "master_weights", "grads", "optimizer_slots", "activations")
_PROBE_SIZE = 64 * 64  # parameters of the probe variable the optimizer is built on


class MemoryReport(dict):
    """`{policy name: {part: bytes}}`; `str()` gives the table in decimal units (1 GB = 1e9 B).

    Each inner dict has `params`, `master_weights`, `grads`, `optimizer_slots`,
    `activations` (`None` when unknown) and `total` (the known parts).

    Attributes:
        num_params: trainable parameters.
        num_non_trainable: non-trainable parameters (batch-norm statistics).
        slots_per_param: optimizer variables per trainable parameter.
        batch_size: the batch size of the activation estimate, or `None`.
    """

    def __init__(self, rows, num_params, num_non_trainable, slots_per_param, batch_size):
        super().__init__(rows)
        self.num_params = num_params
        self.num_non_trainable = num_non_trainable
        self.slots_per_param = slots_per_param
        self.batch_size = batch_size

    def __str__(self):
        header = ["policy", "params", "master weights", "grads", "optimizer slots", "activations", "total"]
        rows = [header]
        for name, row in self.items():
            rows.append([name] + [_format_bytes(row[part]) for part in _PARTS + ("total",)])
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
            for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        batch = f", batch size {self.batch_size}" if self.batch_size is not None else ""
        lines.append(
            f"{self.num_params:,.0f} trainable parameters, {self.slots_per_param:g} optimizer "
            f"slot(s) per parameter{batch}; 1 GB = 1e9 bytes."
        )
        return "\n".join(lines)


def memory_report(model, policy=_OPT_LEVELS, optimizer="adam", batch_size=None, verbose=False,
                  master_weights=None):
    """Bytes for parameters, master weights, gradients, optimizer slots and activations.

    Args:
        model: a built `keras.Model` or layer, or a number of trainable
            parameters (so that `8e9` can be costed without allocating it).
        policy: one policy spec (anything `kmix.Policy` accepts) or a list of
            them; by default `"O0"`-`"O3"`, one row each.
        optimizer: a Keras optimizer (instance, name or config; a loss-scale optimizer counts as its
            inner one), an int number of slots per parameter, or None. Slots are measured on a copy built
            on a probe variable: exact for element-wise optimizers, an estimate for factored ones.
        batch_size: the batch size of the activation estimate (every layer's output, and
            `MultiHeadAttention`'s scores, in the compute dtype); None leaves it out.
        verbose: print the table.
        master_weights: None follows each policy; else `kmix.wrap`'s `master_weights` (True, False,
            `"kahan"`); a kmix `LossScaleOptimizer` passed as `optimizer` gives its own.

    Returns:
        A `MemoryReport`: a dict `{policy name: {part: bytes}}` whose `str()`
        is a table.

    Example:

    >>> report = kmix.memory_report(8e9, kmix.Policy("O2", half="bfloat16"), "adam")
    >>> report["O2-bfloat16"]["total"] / 1e9
    128.0
    >>> kahan = kmix.memory_report(8e9, kmix.Policy("O2", half="bfloat16"), "adam", master_weights="kahan")
    >>> kahan["O2-bfloat16"]["total"] / 1e9
    112.0
    >>> print(kmix.memory_report(model, batch_size=32))
    """
    if isinstance(policy, (str, Policy, keras.DTypePolicy)):
        policies = [parse(policy, "policy")]
    elif isinstance(policy, (list, tuple)):
        policies = [parse(p, "policy") for p in policy]
    else:
        raise TypeError(
            "`policy` must be a policy (anything `kmix.Policy` accepts, e.g. 'O1') or a list of them. "
            f"Received: policy={policy!r} (of type {type(policy).__name__})."
        )
    if verbose not in (True, False) or not isinstance(verbose, (bool, int)):  # 0 / 1 as Keras's verbose
        raise TypeError(f"`verbose` must be True or False (or 1 / 0). Received: verbose={verbose!r}.")
    if not policies:
        raise ValueError(f"`policy` must name at least one policy. Received: policy={policy!r}.")
    trainable, non_trainable, activation_elements = _count(model, batch_size)
    if master_weights is None:
        master_weights = getattr(optimizer, "master_weights", None)
    if master_weights == "auto":
        master_weights = None
    if master_weights not in (None, True, False, "kahan"):
        raise ValueError(
            "`master_weights` must be None, 'auto', True, False or 'kahan'. "
            f"Received: master_weights={master_weights!r}."
        )
    slots = _slots_per_param(optimizer)
    rows = {}
    for p in policies:
        param_size = _BYTES[p.params_dtype]
        mode = p.needs_master_weights if master_weights is None else master_weights
        copy_bytes, slot_bytes = _state_bytes(optimizer, slots, p.params_dtype, mode)
        row = {
            "params": (trainable + non_trainable) * param_size,
            "master_weights": trainable * copy_bytes,
            "grads": trainable * param_size,
            "optimizer_slots": trainable * slot_bytes,
            "activations": None
            if activation_elements is None
            else activation_elements * _BYTES[p.compute_dtype],
        }
        if not all(v is None or math.isfinite(v) for v in row.values()):
            raise ValueError(
                "`model` and `optimizer` give more bytes than a float can count. Received: "
                f"model={model!r}, optimizer={optimizer!r}; accepted: counts whose bytes stay below 1.8e308."
            )
        row = {k: (int(round(v)) if v is not None else None) for k, v in row.items()}
        row["total"] = sum(v for v in row.values() if v is not None)
        rows[p.name] = row
    report = MemoryReport(rows, trainable, non_trainable, slots, batch_size)
    if verbose:
        print(report)
    return report


def _count(model, batch_size):
    """`(trainable, non_trainable, activation elements or None)`."""
    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        count = float(model) if not isinstance(model, numbers.Integral) or abs(model) < 2**1000 else math.inf
        if not 0 <= count < math.inf:  # NaN fails both
            raise ValueError(
                "`model` must be a keras.Model (or layer) or a number of parameters, finite and >= 0. "
                f"Received: model={model!r}."
            )
        return count, 0.0, None
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "`model` must be a keras.Model (or layer) or a number of parameters. "
            f"Received: model={model!r} (of type {type(model).__name__})."
        )
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its parameters are not known. Build it "
            "(call it on data, start it with `keras.Input`, or `model.build(input_shape)`) first."
        )
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    non_trainable = sum(int(np.prod(v.shape)) for v in model.non_trainable_weights)
    if batch_size is None:
        return trainable, non_trainable, None
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(
            f"`batch_size` must be an int >= 1 or None. Received: batch_size={batch_size!r}."
        )
    per_sample = _activations_per_sample(model)
    return trainable, non_trainable, None if per_sample is None else per_sample * batch_size


def _activations_per_sample(model):
    """Elements per sample of every layer output in `model`'s graph, or `None` if unknown."""
    if not isinstance(model, keras.Model):
        return None
    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if isinstance(layer, keras.Model):
            inner = _activations_per_sample(layer)
            if inner is None:
                return None
            total += inner
            continue
        try:
            outputs = keras.tree.flatten(layer.output)
        except (AttributeError, ValueError):  # no output known for this layer
            return None
        for out in outputs:
            size = _per_sample(out.shape)
            if size is None:
                return None
            total += size
        if isinstance(layer, keras.layers.MultiHeadAttention):
            scores = _attention_scores_per_sample(layer)
            if scores is None:
                return None
            total += scores
    return total


def _attention_scores_per_sample(layer):
    inputs = layer.input if isinstance(layer.input, (list, tuple)) else [layer.input]
    query, key = inputs[0], inputs[-1] if len(inputs) > 1 else inputs[0]
    lengths = [_per_sample(query.shape[:-1]), _per_sample(key.shape[:-1])]
    if None in lengths:
        return None
    return 2 * layer.num_heads * lengths[0] * lengths[1]  # scores and probabilities


def _per_sample(shape):
    dims = tuple(shape)[1:]
    if any(d is None for d in dims):
        return None
    return int(np.prod(dims)) if dims else 1


def _slots_per_param(optimizer):
    if optimizer is None:
        return 0
    if isinstance(optimizer, numbers.Real) and not isinstance(optimizer, bool):
        if not optimizer >= 0 or optimizer == float("inf"):  # NaN fails `>=`
            raise ValueError(
                "`optimizer` must be a Keras optimizer, a name, a config dict, None, or a number of slots per "
                f"parameter, finite and >= 0. Received: optimizer={optimizer!r}."
            )
        return optimizer
    if not isinstance(optimizer, (keras.optimizers.Optimizer, str, dict)):
        raise TypeError(
            "`optimizer` must be a Keras optimizer, a name, a config dict, a number of slots per "
            f"parameter or None. Received: optimizer={optimizer!r} (of type {type(optimizer).__name__})."
        )
    probe_opt = _fresh(optimizer) if isinstance(optimizer, keras.optimizers.Optimizer) else checks.optimizer(optimizer)
    _built_on_probe(probe_opt, "float32")
    return sum(int(np.prod(v.shape)) for v in probe_opt.variables if len(v.shape) > 0) / _PROBE_SIZE


def _state_bytes(optimizer, slots, params_dtype, mode):
    """`(copy bytes, slot bytes)` per parameter of `params_dtype` under `master_weights=mode`.

    Measured on a `kmix.LossScaleOptimizer` around a fresh copy of `optimizer`, built on a probe
    variable; a slot count is costed by the rule: float32 copies 4 bytes, Kahan buffers 2, slots 4
    bytes each with either, else in the parameters' dtype.
    """
    if params_dtype == "float32" or mode is None or mode is False:
        mode = False
    if optimizer is None or isinstance(optimizer, numbers.Real) or slots == 0:
        return {True: 4, "kahan": 2, False: 0}[mode], slots * (4 if mode else _BYTES[params_dtype])
    from kmix.optimizers.loss_scale import LossScaleOptimizer

    wrapped = _built_on_probe(LossScaleOptimizer(_fresh(optimizer), dynamic=False, initial_scale=1.0,
                                                 master_weights=mode, fused_update=False), params_dtype)
    state = [v for v in wrapped.variables if v.name.startswith(("master_", "kahan_"))]
    slot_vars = [v for v in wrapped.inner_optimizer.variables if len(v.shape) > 0]
    return _nbytes(state) / _PROBE_SIZE, _nbytes(slot_vars) / _PROBE_SIZE


def _built_on_probe(optimizer, dtype):
    """`optimizer`, built on a probe variable of `_PROBE_SIZE` zeros in `dtype`."""
    optimizer.build([keras.Variable(np.zeros((64, 64), np.float32), dtype=dtype, name="memory_report_probe")])
    return optimizer


def _nbytes(variables):
    """The bytes of `variables`' values."""
    dtypes = [keras.backend.standardize_dtype(v.dtype) for v in variables]
    return sum(int(np.prod(v.shape)) * (_BYTES.get(d) or np.dtype(d).itemsize) for v, d in zip(variables, dtypes))


def _fresh(optimizer):
    """An unbuilt copy of `optimizer` (an instance, a name or a config; a loss-scale one's inner)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return type(optimizer).from_config(optimizer.get_config())
    return keras.optimizers.get(optimizer)


def _format_bytes(n):
    if n is None:
        return "n/a"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
