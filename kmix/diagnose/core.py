"""`kmix.diagnose`: find why a float32 model would fail in float16, before it does."""

import math

import numpy as np
import tensorflow as tf

from kmix import _preserved
from kmix.diagnose import data, graph, probe, report
from kmix.policy import Policy
from kmix.route.facts import fast_bfloat16

MARGIN = 8.0  # the recommended scale keeps the largest gradient this far below the half maximum
SCALE_RANGE = (2.0**-24, 2.0**24)  # kmix.LossScaleOptimizer's default cap is 2^24


def diagnose(model, x, y=None, policy="mixed_float16", batches=4, batch_size=32, bfloat16_available=None,
             float32_layers=None):
    """Runs a float32 model on a few batches and finds what would fail under a half policy.

    In float32 it records, per layer (nested ones included), the largest
    |output| and the shares of outputs and gradients that overflow or flush
    to zero in the half dtype; then it runs the same batches in the half
    dtype and finds the first layer whose output turns non-finite from finite
    inputs, tracing such a layer for a constant beyond the half range (a
    `-1e9` mask) feeding a softmax. The model, its weights, its optimizer
    and the global dtype policy are left as they were.

    Args:
        model: a compiled `keras.Model` computing in float32; its loss
            (`model.compute_loss`) gives the gradients.
        x: the inputs, as `model.fit` takes them: arrays or tensors (or a
            list / dict of them), or a `tf.data.Dataset` of `(x, y[, sample_weight])` batches.
        y: the targets, for array inputs; None with a dataset.
        policy: the half policy to check, as `kmix.Policy` accepts it (`"mixed_float16"`).
        batches: how many batches to run, an int >= 1.
        batch_size: the batch size for array inputs.
        bfloat16_available: whether the training device has bfloat16
            hardware (None: `kmix.device.fast_bfloat16()`); only
            `recommended_policy` depends on it.
        float32_layers: layer names or paths the half run keeps in float32,
            as `kmix.autocast(float32_layers=...)` would; not reported.

    Returns:
        A `kmix.Diagnosis`; `print(diagnosis)` shows the table and findings.

    Raises:
        TypeError / ValueError: naming the argument, for a model that is not
            a compiled float32 `keras.Model`, data of the wrong structure, a
            policy without half compute, or `batches < 1`.

    Example:

    >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    >>> d = kmix.diagnose(model, x_train, y_train, policy="mixed_float16")
    >>> print(d)                      # per-layer table and one line per finding
    >>> fast = kmix.autocast(model, "O1", float32_layers=d.float32_layers)
    >>> with kmix.policy_scope("O1"):
    ...     fast.compile(optimizer=kmix.wrap("adam", initial_scale=d.recommended_scale), loss=...)
    """
    data.check_model(model)
    policy = data.check_policy(policy)
    if bfloat16_available is not None and not isinstance(bfloat16_available, bool):
        raise TypeError(
            "`bfloat16_available` must be True, False or None (ask this machine). Received: "
            f"bfloat16_available={bfloat16_available!r}."
        )
    found = data.batches(x, y, batches, batch_size)
    half = policy.compute_dtype
    limits = probe.HALF_RANGES[half]
    if not model.built:
        data.forward(model, found[0][0], training=False)
    nodes = probe.layer_nodes(model)
    _keep(nodes, data.check_float32_layers(float32_layers, nodes))
    data.check_float32(nodes)
    run, flaky = _Float32Run(nodes, half), _HalfRun()
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
            for bx, _, _ in found:
                flaky.batch(model, nodes, bx)
            masks = graph.trace_nonfinite(flaky.calls, flaky.first_args, half, limits.max)
    return _decide(model, policy, run, flaky, masks, bfloat16_available, len(found))


def _keep(nodes, names):
    """Marks the nodes named (by name or path) and everything inside them as kept in float32."""
    for node in nodes:  # parents come before their children
        if node.path in names or node.layer.name in names or (node.parent is not None and node.parent.kept):
            node.kept = True


class _Float32Run:
    """Per-layer statistics of outputs, inputs and gradients over the float32 batches."""

    def __init__(self, nodes, half):
        self.nodes, self.half = nodes, half
        self.stats = {}  # node -> report.LayerStats, in first-call order
        self.weights = {}  # variable path -> probe.TensorStats
        self.histogram = probe.Log2Histogram()
        self.nonfinite = []  # per batch: ids of the nodes with non-finite float32 outputs
        self.losses = []

    def batch(self, model, x, y, sample_weight):
        calls = []

        def hook(node, args, kwargs, outputs):
            calls.append((node, probe.floating(outputs), probe.floating((args, kwargs))))

        def start(node):  # the table lists layers in the order their calls begin
            if node not in self.stats:
                self.stats[node] = report.LayerStats(node)

        with tf.GradientTape() as tape:
            with probe.patched_calls(self.nodes, hook, start):
                y_pred = data.forward(model, x, training=True)
            try:
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
            except (ValueError, TypeError, KeyError, tf.errors.InvalidArgumentError) as e:
                raise ValueError(
                    f"`y` does not fit model {model.name!r}'s outputs and loss (received "
                    f"{'y=None' if y is None else 'y'}): computing the loss "
                    f"failed with {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
                ) from e
        self.losses.append(float(loss))
        outputs = list({id(t): t for _, outs, _ in calls for t in outs}.values())  # each tensor once
        variables = list(model.trainable_variables)
        grads = tape.gradient(loss, outputs + variables, unconnected_gradients=tf.UnconnectedGradients.NONE)
        grad_of = {id(t): g for t, g in zip(outputs, grads)}
        counted, bad = set(), set()
        for node, outs, ins in calls:
            row = self.stats[node]
            row.calls += 1
            for t in ins:
                row.input_max = max(row.input_max, _max_abs(t))
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
            if g is None:
                continue
            stats = self.weights.setdefault(variable.path, probe.TensorStats())
            self.histogram.add(stats.add(tf.convert_to_tensor(g), self.half))


def _max_abs(t):
    a = tf.abs(tf.cast(t, tf.float32))
    return float(tf.reduce_max(tf.where(tf.math.is_finite(a), a, tf.zeros_like(a)))) if a.shape.num_elements() else 0.0


def _all_finite(tensors):
    return all(bool(tf.reduce_all(tf.math.is_finite(t))) for t in tensors)


class _HalfRun:
    """The calls of the half-precision run: which layers turn non-finite, from what inputs.

    A layer that raises ends the run: `error` is `(innermost node under way, exception)`.
    """

    def __init__(self):
        self.calls = []  # per batch: [(node, inputs_finite, outputs_finite)] in completion order
        self.first_args = {}  # node -> (args, kwargs) of its first non-finite call
        self.error = None

    def batch(self, model, nodes, x):
        if self.error is not None:
            return
        calls, running = [], []

        def hook(node, args, kwargs, outputs):
            running.pop()
            out_ok = _all_finite(probe.floating(outputs))
            calls.append((node, _all_finite(probe.floating((args, kwargs))), out_ok))
            if not out_ok and node not in self.first_args:
                self.first_args[node] = (args, kwargs)

        try:
            with probe.patched_calls(nodes, hook, start=running.append):
                model(x, training=True)
        except Exception as e:  # noqa: BLE001  a layer raising in half precision (any type, user code) is the finding
            if not running:
                raise
            self.error = (running[-1], e)
        self.calls.append(calls)


def _decide(model, policy, run, flaky, masks, bfloat16_available, n_batches):
    """Turns the two runs into a `Diagnosis`."""
    half = policy.compute_dtype
    limits = probe.HALF_RANGES[half]
    nodes = list(run.stats)
    origins, downstream = [], []
    for b, calls in enumerate(flaky.calls):
        for node, inputs_ok, outputs_ok in calls:
            if outputs_ok or id(node) in run.nonfinite[b]:
                continue
            (origins if inputs_ok else downstream).append(node)
    origins, downstream = list(dict.fromkeys(origins)), list(dict.fromkeys(downstream))
    first = origins[0] if origins else downstream[0] if downstream else None
    reasons = {}  # node -> why it belongs in float32
    error = flaky.error[0] if flaky.error else None
    for node in nodes:
        row = run.stats[node]
        if node.kept:
            continue
        if node is error:
            reasons[node] = "error"
        elif node in masks:
            reasons[node] = "mask"
        elif row.output.overflow:
            reasons[node] = "output"
        elif node in origins:
            reasons[node] = "inside"
        elif row.input_max > limits.max:
            reasons[node] = "input"
    # A block (or nested model) whose output overflows, or that overflows inside, because a
    # flagged sub-layer does, needs no island of its own: the sub-layer's is enough.
    for node in [n for n, r in reasons.items() if r in ("inside", "output")]:
        if any(other is not node and node in set(other.ancestors()) for other in reasons):
            del reasons[node]
    for node, row in run.stats.items():
        row.half_nonfinite = node in origins or node in downstream
        row.verdict = _verdict(node, row, first, reasons)
    float32_layers = list(dict.fromkeys(n.target for n in nodes if n in reasons))
    grad_max = max([r.gradient.max_abs for r in run.stats.values()] + [w.max_abs for w in run.weights.values()] + [0.0])
    if half == "bfloat16":
        scale = 1.0
    elif grad_max > 0:
        k = math.floor(math.log2(limits.max / (MARGIN * grad_max)))
        scale = float(min(max(2.0**k, SCALE_RANGE[0]), SCALE_RANGE[1]))
    else:
        scale = None
    if bfloat16_available is None:
        bfloat16_available = fast_bfloat16()
    overflow = any(reasons.get(n) in ("output", "input", "inside") for n in nodes)
    if half == "float16" and overflow and bfloat16_available:
        recommended = Policy("mixed_bfloat16")
    elif reasons:
        recommended = Policy("O1", half=half)
    else:
        recommended = policy
    return report.Diagnosis(
        model_name=model.name,
        policy=policy,
        layers=[run.stats[n] for n in nodes],
        weight_gradients=dict(run.weights),
        histogram=run.histogram,
        first_nonfinite_layer=None if first is None else first.path,
        float32_layers=float32_layers,
        reasons={n.path: (r, masks.get(n)) for n, r in reasons.items()},
        half_error=None if error is None else (error.path, flaky.error[1]),
        recommended_scale=scale,
        recommended_policy=recommended,
        losses=run.losses,
        batches=n_batches,
        bfloat16_available=bfloat16_available,
    )


def _verdict(node, row, first, reasons):
    if row.output.nonfinite:
        return "non-finite in float32"
    words = ["FIRST NON-FINITE"] if node is first else []
    if node in reasons:
        words.append(probe.VERDICTS[reasons[node]])
    elif row.half_nonfinite:
        words.append("non-finite from upstream")
    if node.kept:
        words.append("kept")
    return ", ".join(words) or "ok"
