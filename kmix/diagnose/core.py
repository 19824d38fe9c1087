"""`kmix.diagnose`: find why a float32 model would fail in float16, before it does."""

import math

import numpy as np
import tensorflow as tf

from kmix import _preserved
from kmix.diagnose import data, probe, report
from kmix.policy import Policy
from kmix.route.facts import fast_bfloat16

SCALE_RANGE = (2.0**-24, 2.0**24)  # kmix.LossScaleOptimizer's default cap is 2^24
TRACE_LIMIT = 32  # layers whose half-precision graph is inspected


def diagnose(model, x, y=None, policy="mixed_float16", batches=4, batch_size=32, bfloat16_available=None,
             float32_layers=None):
    """Runs a float32 model on a few batches and finds what would fail under a half policy.

    Per layer, nested ones included: the shares of outputs and gradients that overflow or flush to zero in the
    half dtype, and where a half run of the same batches turns non-finite, and why (docs/guide.md, "Diagnose
    before training"). The model, its weights, its optimizer and the global dtype policy are left as they were.

    Args:
        model: a compiled `keras.Model` computing in float32; its loss gives the gradients.
        x: the inputs as `model.fit` takes them, or a `tf.data.Dataset` of `(x, y[, sample_weight])` batches.
        y: the targets, for array inputs; None with a dataset.
        policy: the half policy to check, as `kmix.Policy` accepts it (`"mixed_float16"`).
        batches: how many batches to run, an int >= 1; `batch_size`: rows per batch of array inputs.
        bfloat16_available: whether the device has bfloat16 hardware (None: `kmix.device.fast_bfloat16()`);
            only `recommended_policy` depends on it.
        float32_layers: layer names or paths the half run keeps in float32, as `kmix.autocast` would.

    Returns:
        A `kmix.Diagnosis`; `print(diagnosis)` shows the table and findings. A TypeError or ValueError
        names the argument at fault (a model not compiled or not float32, data, policy, `batches`).

    Example:

    >>> d = kmix.diagnose(model, x_train, y_train, policy="mixed_float16")
    >>> print(d)                      # per-layer table and one line per finding
    >>> fast = kmix.autocast(model, "O1", float32_layers=d.float32_layers)
    """
    data.check_model(model)
    policy = data.check_policy(policy)
    if bfloat16_available is not None and not isinstance(bfloat16_available, bool):
        raise TypeError("`bfloat16_available` must be True, False or None (ask this machine). Received: "
                        f"bfloat16_available={bfloat16_available!r}.")
    found = data.batches(x, y, batches, batch_size)
    half = policy.compute_dtype
    if not model.built:
        data.forward(model, found[0][0], training=False)
    nodes = probe.layer_nodes(model)
    names = data.check_float32_layers(float32_layers, nodes)
    for node in nodes:  # parents come before their children: a layer named is kept, with everything inside
        inherited = node.parent is not None and node.parent.kept
        node.kept = node.kept or inherited or node.path in names or node.layer.name in names
    data.check_float32(nodes)
    run = _Float32Run(nodes, half)
    # The model's layers and variables (batch-norm statistics, seed states) come back as they were.
    with _preserved.Preserved(model, saved="all") as kept:
        for bx, by, bsw in found:
            run.batch(model, bx, by, bsw)
            kept.restore_variables()  # the half run starts from the same weights and random state
        for node in nodes:
            if not node.kept:
                node.layer.dtype_policy = f"mixed_{half}"
        # Constants such as -1e9 overflow as they are cast to float16: that is expected here.
        with np.errstate(over="ignore", invalid="ignore"):
            calls, first_args, error = _half_run(model, nodes, found)
            masks = trace_nonfinite(calls, first_args, half, probe.HALF_RANGES[half].max)
    return _decide(model, policy, run, calls, error, masks, bfloat16_available, len(found))


class _Float32Run:
    """Per-layer statistics of outputs, inputs and gradients over the float32 batches."""

    def __init__(self, nodes, half):
        self.nodes, self.half, self.histogram = nodes, half, probe.Log2Histogram()
        self.stats, self.weights = {}, {}  # node -> report.LayerStats (in first-call order); path -> TensorStats
        self.nonfinite, self.losses = [], []  # per batch: ids of the nodes with non-finite float32 outputs; loss

    def batch(self, model, x, y, sample_weight):
        calls = []

        def hook(node, args, kwargs, outputs):
            calls.append((node, probe.floating(outputs), probe.floating((args, kwargs))))

        def start(node):  # the table lists layers in the order their calls begin
            self.stats.setdefault(node, report.LayerStats(node))

        with tf.GradientTape() as tape:
            with probe.patched_calls(self.nodes, hook, start):
                y_pred = data.forward(model, x, training=True)
            try:
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
            except (ValueError, TypeError, KeyError, tf.errors.InvalidArgumentError) as e:
                raise ValueError(f"`y` does not fit model {model.name!r}'s outputs and loss (received "
                                 f"{'y=None' if y is None else 'y'}): computing the loss failed with "
                                 f"{type(e).__name__}: {data.first_line(e, 300)}") from e
        self.losses.append(float(loss))
        outputs = list({id(t): t for _, outs, _ in calls for t in outs}.values())  # each tensor once
        variables = list(model.trainable_variables)
        grads = tape.gradient(loss, outputs + variables, unconnected_gradients=tf.UnconnectedGradients.NONE)
        grad_of = {id(t): g for t, g in zip(outputs, grads)}
        counted, bad = set(), set()
        for node, outs, ins in calls:
            row = self.stats[node]
            row.calls += 1
            row.input_max = max([row.input_max] + [probe.max_finite(t) for t in ins])
            nonfinite_before = row.output.nonfinite
            for t in outs:
                row.output.add(t, self.half, values=False)
                g = grad_of.get(id(t))
                if g is not None:
                    values = row.gradient.add(g, self.half)
                    if id(t) not in counted:  # a block's output is often its last sub-layer's
                        counted.add(id(t))
                        self.histogram.add(values)
            if row.output.nonfinite > nonfinite_before:
                bad.add(id(node))
        self.nonfinite.append(bad)
        for variable, g in zip(variables, grads[len(outputs):]):
            if g is not None:
                stats = self.weights.setdefault(variable.path, probe.TensorStats())
                self.histogram.add(stats.add(tf.convert_to_tensor(g), self.half))


def _all_finite(tensors):
    return all(bool(tf.reduce_all(tf.math.is_finite(t))) for t in tensors)


def _half_run(model, nodes, found):
    """The half run: `(calls, first_args, error)`.

    `calls`: per batch `[(node, inputs_finite, outputs_finite)]`; `first_args`: each node's first non-finite call's
    `(args, kwargs)`; `error`: `(innermost node under way, exception)` where a layer raised, which ends the run.
    """
    calls, first_args, running = [], {}, []

    def hook(node, args, kwargs, outputs):
        running.pop()
        out_ok = _all_finite(probe.floating(outputs))
        calls[-1].append((node, _all_finite(probe.floating((args, kwargs))), out_ok))
        if not out_ok:
            first_args.setdefault(node, (args, kwargs))

    with probe.patched_calls(nodes, hook, start=running.append):
        for bx, _, _ in found:
            calls.append([])
            try:
                model(bx, training=True)
            except Exception as e:  # noqa: BLE001  a layer raising in half precision (any type) is the finding
                if not running:
                    raise
                return calls, first_args, (running[-1], e)
    return calls, first_args, None


def trace_nonfinite(calls, first_args, half, limit):
    """`{node: (values, feeds_softmax)}`: `big_constants` of the innermost layers the half run saw turn non-finite."""
    found = {}
    order = [node for batch in calls for node, _, ok in batch if not ok]
    for node in list(dict.fromkeys(order))[:TRACE_LIMIT]:
        if any(inner is not node and node in set(inner.ancestors()) for inner in found):
            continue
        args, kwargs = first_args[node]
        try:
            fn = tf.function(lambda a, k, layer=node.layer: layer(*a, **k), autograph=False)
            graph = fn.get_concrete_function(args, kwargs).graph
        except (TypeError, ValueError, AttributeError, NotImplementedError, tf.errors.OpError):
            continue  # a layer that cannot be traced (Python on tensors, numpy calls) is not inspected
        values, softmax = big_constants(graph, half, limit)
        if values:
            found[node] = (values, softmax)
    return found


def big_constants(graph, half, limit):
    """The constants of `graph` beyond the half range (a Python `-1e9` mask), and whether any reaches a softmax."""
    half = tf.as_dtype(half)
    sources, values = [], []
    for op in graph.get_operations():
        if op.type == "Const" and op.get_attr("dtype") == half:  # inf in the half dtype, or a float32 one cast
            value = tf.make_ndarray(op.get_attr("value")).astype(np.float32)
            beyond = ~np.isfinite(value)
        elif op.type == "Cast" and op.outputs[0].dtype == half and op.inputs[0].op.type == "Const":
            value = tf.make_ndarray(op.inputs[0].op.get_attr("value")).astype(np.float64)
            beyond = np.abs(value) > limit
        else:
            continue
        if beyond.any():
            sources.append(op)
            values.append(float(value[beyond].flat[0]))
    seen, frontier = set(), list(sources)
    while frontier:
        op = frontier.pop()
        if op.type in ("Softmax", "LogSoftmax"):
            return values, True
        for consumer in (c for out in op.outputs for c in out.consumers() if c.name not in seen):
            seen.add(consumer.name)
            frontier.append(consumer)
    return values, False


def _decide(model, policy, run, half_calls, half_error, masks, bfloat16_available, n_batches):
    """Turns the float32 run and the half run's `calls` and `error` into a `Diagnosis`."""
    half = policy.compute_dtype
    limits = probe.HALF_RANGES[half]
    origins, downstream = {}, {}  # the nodes turning non-finite in half only, from finite inputs or not (in order)
    for b, calls in enumerate(half_calls):
        for node, inputs_ok, outputs_ok in calls:
            if not outputs_ok and id(node) not in run.nonfinite[b]:
                (origins if inputs_ok else downstream)[node] = None
    first = next(iter(origins), next(iter(downstream), None))
    error = half_error[0] if half_error else None
    reasons = {}  # node -> why it belongs in float32
    for node, row in run.stats.items():
        why = ("error" if node is error else "mask" if node in masks else "output" if row.output.overflow else
               "inside" if node in origins else "input" if row.input_max > limits.max else None)
        if why and not node.kept:
            reasons[node] = why
    # A block (or nested model) whose output overflows, or that overflows inside, because a
    # flagged sub-layer does, needs no island of its own: the sub-layer's is enough.
    for node in [n for n, r in reasons.items() if r in ("inside", "output")]:
        if any(other is not node and node in set(other.ancestors()) for other in reasons):
            del reasons[node]
    for node, row in run.stats.items():
        row.half_nonfinite = node in origins or node in downstream
        row.verdict = _verdict(node, row, first, reasons)
    grad_max = max([r.gradient.max_abs for r in run.stats.values()] + [w.max_abs for w in run.weights.values()] + [0.0])
    if half == "bfloat16":
        scale = 1.0
    elif grad_max > 0:
        scale = float(min(max(2.0 ** math.floor(math.log2(limits.max / (report.MARGIN * grad_max))),
                              SCALE_RANGE[0]), SCALE_RANGE[1]))
    else:
        scale = None
    if bfloat16_available is None:
        bfloat16_available = fast_bfloat16()
    if half == "float16" and bfloat16_available and any(r in ("output", "input", "inside") for r in reasons.values()):
        recommended = Policy("mixed_bfloat16")
    else:
        recommended = Policy("O1", half=half) if reasons else policy
    return report.Diagnosis(
        model.name, policy, list(run.stats.values()), dict(run.weights), run.histogram,
        first_nonfinite_layer=None if first is None else first.path,
        float32_layers=list(dict.fromkeys(n.target for n in reasons)),
        reasons={n.path: (r, masks.get(n)) for n, r in reasons.items()}, recommended_scale=scale,
        recommended_policy=recommended, losses=run.losses, batches=n_batches, bfloat16_available=bfloat16_available,
        half_error=half_error and (error.path, half_error[1]))


def _verdict(node, row, first, reasons):
    if row.output.nonfinite:
        return "non-finite in float32"
    words = ["FIRST NON-FINITE"] * (node is first)
    words += [probe.VERDICTS[reasons[node]]] if node in reasons else ["non-finite from upstream"] * row.half_nonfinite
    words += ["kept"] * node.kept
    return ", ".join(words) or "ok"
