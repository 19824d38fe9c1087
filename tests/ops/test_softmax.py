"""kmix.ops.masked_softmax / masked_log_softmax against a float64 NumPy reference.

The reference picks each row's kept entries by boolean indexing and applies the textbook formulas to them
alone: it shares none of the `where` machinery of the code under test.
"""

import itertools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix

THRESHOLD = -1e3  # documented: a bias at or below this masks its position


def reference(logits, mask=None, bias=None, axis=-1, upstream=None, log=False):
    """Float64 softmax (or log-softmax) and, given `upstream`, the analytic gradient: `(out, grad)`.

    `grad` is dL/dlogits for L = sum(upstream * out), None without `upstream`."""
    x = np.array(logits, np.float64)
    keep = np.ones(x.shape, bool)
    if mask is not None:
        m = np.asarray(mask)
        m = m if m.dtype == bool else m > 0.5
        keep &= np.broadcast_to(m, x.shape)
    if bias is not None:
        b = np.broadcast_to(np.asarray(bias, np.float64), x.shape)
        masked_by_bias = b <= THRESHOLD
        keep &= ~masked_by_bias
        x = x + np.where(masked_by_bias, 0.0, b)
    keep &= x != -np.inf
    axes = tuple(sorted(a % x.ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,))))
    rest = tuple(a for a in range(x.ndim) if a not in axes)

    def rows(a):  # the normalised axes flattened last, one row per remaining index
        return np.transpose(a, rest + axes).reshape(-1, int(np.prod([x.shape[i] for i in axes])))

    xs, ks = rows(x), rows(keep)
    gs = rows(np.broadcast_to(upstream, x.shape).astype(np.float64)) if upstream is not None else None
    out, grad = np.zeros_like(xs), np.zeros_like(xs)
    for r in range(xs.shape[0]):
        k = ks[r]
        if not k.any():
            continue  # a fully masked row: zeros, zero gradient
        z = xs[r, k] - xs[r, k].max()
        p = np.exp(z) / np.exp(z).sum()
        out[r, k] = z - np.log(np.exp(z).sum()) if log else p
        if gs is not None:
            g = gs[r, k]
            grad[r, k] = g - p * g.sum() if log else p * (g - (g * p).sum())
    shape_t = tuple(x.shape[i] for i in rest + axes)
    inverse = np.argsort(rest + axes)

    def back(a):
        return np.transpose(a.reshape(shape_t), inverse)

    return back(out), (back(grad) if upstream is not None else None)


def as_dtype(values, dtype):
    """`values` as a tensor of `dtype`, and the exact float64 values it holds."""
    t = tf.cast(tf.constant(np.asarray(values, np.float64)), dtype)
    return t, tf.cast(t, tf.float64).numpy()


RNG = np.random.default_rng(0)
SHAPE = (3, 4, 9)


def _logits(kind):
    x = RNG.normal(scale=4.0, size=SHAPE)
    if kind == "extreme":  # +-6e4 in float16, next to ordinary values
        x[..., ::3] = 6e4
        x[..., 1::4] = -6e4
        x[0, 0] = -6e4
        x[1, 1] = 6e4
    return x


def _mask(kind):
    m = RNG.random(SHAPE) > 0.4
    m[0, 1] = False  # a fully masked row
    m[2, 3] = False
    if kind == "float":
        return m.astype(np.float32)
    if kind == "int":
        return m.astype(np.int32)
    if kind == "broadcast":  # (1, 4, 9): the same mask for every batch entry
        return m[:1]
    return m


CASES = {
    "plain": dict(),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "int_mask": dict(mask="int"),
    "broadcast_mask": dict(mask="broadcast"),
}


@pytest.mark.parametrize("logits_dtype", ["float16", "bfloat16", "float32"])
def test_matches_float64_reference(logits_dtype):
    for values in ("normal", "extreme"):
        for case in sorted(CASES):
            logits, exact = as_dtype(_logits(values), logits_dtype)
            mask = _mask(CASES[case]["mask"]) if "mask" in CASES[case] else None
            for log in (False, True):
                fn = kmix.ops.masked_log_softmax if log else kmix.ops.masked_softmax
                got = fn(logits, mask=mask, dtype="float32").numpy()
                expected, _ = reference(exact, mask=mask, log=log)
                where = (values, case, "log" if log else "softmax")
                if log and values == "extreme":  # log-probs reach -1.2e5: relative precision
                    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6, err_msg=str(where))
                else:
                    assert np.max(np.abs(got - expected)) <= 1e-6, where
                if mask is not None:
                    keep = np.broadcast_to(mask > 0.5, SHAPE)
                    fully_masked = ~keep.any(axis=-1)
                    assert fully_masked.any()
                    assert np.all(got[~keep] == 0) and np.all(got[fully_masked] == 0), where


@pytest.mark.parametrize("bias_dtype", ["float16", "bfloat16", "float32", "float64"])
def test_additive_bias_masks(bias_dtype):
    for fill in ("-inf", "-1e9", "finfo.min", "-1e4"):
        for logits_dtype in ("float16", "float32"):
            keep = RNG.random(SHAPE) > 0.4
            keep[1, 2] = False  # fully masked by the bias alone
            value = {"-inf": -np.inf, "-1e9": -1e9, "-1e4": -1e4,
                     "finfo.min": float(tf.as_dtype(bias_dtype).min)}[fill]
            soft = RNG.normal(size=SHAPE)  # a real bias where kept, not just 0
            # Built in float64 then cast: a float16 -1e9 becomes -inf, as in a model.
            bias, bias_exact = as_dtype(np.where(keep, soft, value), bias_dtype)
            logits, exact = as_dtype(_logits("extreme" if logits_dtype == "float16" else "normal"), logits_dtype)
            if logits_dtype == "float16":
                # Adding a non-zero bias to +-6e4 loses digits in float32 itself.
                bias = tf.where(keep, tf.zeros_like(bias), bias)
                bias_exact = np.where(keep, 0.0, bias_exact)
            mask = RNG.random(SHAPE[-1:]) > 0.2
            for log in (False, True):
                fn = kmix.ops.masked_log_softmax if log else kmix.ops.masked_softmax
                got = fn(logits, mask=mask, bias=bias, dtype="float32").numpy()
                expected, _ = reference(exact, mask=mask, bias=bias_exact, log=log)
                where = (fill, logits_dtype, "log" if log else "softmax")
                assert np.all(np.isfinite(got)), where
                np.testing.assert_allclose(got, expected, rtol=1e-6 if log else 0, atol=1e-6, err_msg=str(where))
                assert np.all(got[1, 2] == 0), where


def test_float16_bias_that_became_inf_equals_boolean_mask():
    logits = tf.constant(RNG.normal(size=SHAPE), tf.float16)
    keep = RNG.random(SHAPE) > 0.5
    keep[0, 0] = False
    hand_made = tf.cast((1.0 - keep.astype(np.float32)) * -1e9, tf.float16)  # 0 and -inf
    assert np.isneginf(hand_made.numpy()).any()
    by_bias = kmix.ops.masked_softmax(logits, bias=hand_made, dtype="float32")
    by_mask = kmix.ops.masked_softmax(logits, mask=keep, dtype="float32")
    np.testing.assert_array_equal(by_bias.numpy(), by_mask.numpy())


def test_axes():
    logits = RNG.normal(size=SHAPE).astype(np.float32)
    mask = _mask("bool")
    for axis, log in itertools.product([0, -2, (1, 2), [0, 2], (0, 1, 2)], (False, True)):
        fn = kmix.ops.masked_log_softmax if log else kmix.ops.masked_softmax
        got = fn(logits, mask=mask, axis=axis).numpy()
        expected, _ = reference(logits, mask=mask, axis=axis, log=log)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_output_dtypes():
    x = RNG.normal(size=(2, 5))
    assert kmix.ops.masked_softmax(x.astype(np.float16)).dtype == tf.float16
    assert kmix.ops.masked_softmax(tf.cast(x, tf.bfloat16)).dtype == tf.bfloat16
    assert kmix.ops.masked_softmax(x.astype(np.float16), dtype="bfloat16").dtype == tf.bfloat16
    assert kmix.ops.masked_softmax([[1, 2, 3]]).dtype == tf.float32  # ints: floatx
    # float64 stays float64, to float64 precision.
    got = kmix.ops.masked_softmax(x, mask=x > 0)
    assert got.dtype == tf.float64
    np.testing.assert_allclose(got.numpy(), reference(x, mask=x > 0)[0], rtol=1e-13, atol=1e-15)
    got = kmix.ops.masked_log_softmax(x.astype(np.float16), dtype="float64")
    assert got.dtype == tf.float64


def test_float16_output_is_the_rounded_float32_result():
    logits, exact = as_dtype(RNG.normal(scale=3, size=(4, 300)), "float16")
    got = kmix.ops.masked_softmax(logits).numpy()
    expected = reference(exact)[0].astype(np.float16)
    # Within one float16 ulp of the correctly rounded result.
    np.testing.assert_array_less(np.abs(got.astype(np.float64) - expected), np.spacing(expected) * 1.01)


def _gradients(fn, logits, mask, bias, upstream, jit=False):
    def run(logits, bias):
        with tf.GradientTape() as tape:
            tape.watch([logits, bias])
            out = fn(logits, mask=mask, bias=bias)
            loss = tf.reduce_sum(out * upstream)
        return out, tape.gradient(loss, [logits, bias])

    if jit:
        run = tf.function(run, jit_compile=True)
    out, (g_logits, g_bias) = run(logits, bias)
    return out.numpy(), g_logits.numpy(), g_bias.numpy()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_match_analytic(dtype, jit):
    for log in (False, True):
        _check_gradients(dtype, log, jit)


def _check_gradients(dtype, log, jit):
    logits, exact = as_dtype(RNG.normal(scale=3, size=SHAPE), dtype)
    mask = _mask("bool")
    keep_bias = RNG.random(SHAPE[1:]) > 0.3  # (4, 9), broadcast over the batch
    keep_bias[3] = False  # rows fully masked by the bias
    bias, bias_exact = as_dtype(np.where(keep_bias, RNG.normal(size=SHAPE[1:]), -np.inf), dtype)
    upstream = tf.constant(RNG.normal(size=SHAPE), dtype)
    fn = kmix.ops.masked_log_softmax if log else kmix.ops.masked_softmax
    out, g_logits, g_bias = _gradients(fn, logits, mask, bias, upstream, jit)
    expected, expected_grad = reference(exact, mask, bias_exact, upstream=upstream.numpy(), log=log)
    tol = 1e-6 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)
    np.testing.assert_allclose(g_logits, expected_grad, rtol=tol, atol=tol)
    # The bias is added: its gradient is the logits' one, summed over the batch.
    np.testing.assert_allclose(g_bias, expected_grad.sum(axis=0), rtol=tol, atol=tol * 10)
    masked = ~(np.broadcast_to(mask, SHAPE) & keep_bias)
    assert np.all(g_logits[masked] == 0) and np.all(g_bias[~keep_bias] == 0)
    assert np.all(np.isfinite(g_logits)) and np.all(np.isfinite(g_bias))


@pytest.mark.parametrize("logits_dtype", ["float16", "bfloat16"])
def test_low_precision_gradients_are_finite_and_zero_where_masked(logits_dtype):
    logits, exact = as_dtype(_logits("extreme"), logits_dtype)
    mask = _mask("bool")
    bias = tf.cast(np.where(RNG.random(SHAPE) > 0.3, 0.0, -1e9), logits_dtype)  # -inf in float16
    upstream = tf.constant(RNG.normal(size=SHAPE), logits_dtype)
    out, g_logits, g_bias = _gradients(kmix.ops.masked_softmax, logits, mask, bias, upstream)
    keep = mask & (tf.cast(bias, tf.float64).numpy() > THRESHOLD)
    _, expected_grad = reference(exact, mask, tf.cast(bias, tf.float64).numpy(), upstream=tf.cast(upstream, tf.float64).numpy())
    g = g_logits.astype(np.float64)
    assert np.all(np.isfinite(g)) and np.all(g[~keep] == 0)
    assert np.all(np.isfinite(g_bias.astype(np.float64)))
    # The gradient is rounded once, to the logits' dtype.
    np.testing.assert_allclose(g, expected_grad, rtol=1e-2, atol=1e-2 * np.abs(expected_grad).max())


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_compiled_equals_eager_on_masked_rows(log):
    # tensorflow#55682: XLA on CPU once gave a uniform softmax on masked rows.
    logits = tf.constant(RNG.normal(size=(4, 16)), tf.float16)
    mask = np.ones((4, 16), bool)
    mask[1] = False
    mask[2, 5:] = False
    fn = kmix.ops.masked_log_softmax if log else kmix.ops.masked_softmax
    compiled = tf.function(lambda x, m: fn(x, mask=m, dtype="float32"), jit_compile=True)
    eager = fn(logits, mask=mask, dtype="float32").numpy()
    got = compiled(logits, tf.constant(mask)).numpy()
    np.testing.assert_allclose(got, eager, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, reference(tf.cast(logits, tf.float64).numpy(), mask, log=log)[0],
                               rtol=1e-6, atol=1e-6)
    assert np.all(got[1] == 0)


def test_all_minus_inf_logits_give_zeros():
    logits = tf.constant([[-np.inf, -np.inf], [0.0, -np.inf]], tf.float16)
    np.testing.assert_array_equal(kmix.ops.masked_softmax(logits).numpy(), [[0, 0], [1, 0]])
    np.testing.assert_array_equal(kmix.ops.masked_log_softmax(logits).numpy(), [[0, 0], [0, 0]])
    # The fused kernel's softmax of a row of -inf is NaN, and so its gradient: not here.
    upstream = tf.constant([[1.0, -2.0], [3.0, 0.5]], tf.float32)
    for jit in (False, True):
        _, g_logits, _ = _gradients(kmix.ops.masked_softmax, tf.cast(logits, tf.float32), None,
                                    tf.zeros([2], tf.float32), upstream, jit)
        np.testing.assert_array_equal(g_logits, [[0, 0], [0, 0]])


def test_nan_bias_is_not_hidden():
    out = kmix.ops.masked_softmax(np.zeros((1, 3), np.float32), bias=np.array([[0.0, np.nan, -1e9]], np.float32))
    assert np.isnan(out.numpy()).any()


def test_mask_shape_error_names_the_argument():
    with pytest.raises(ValueError, match=r"Received: mask\.shape=\(2, 5\); expected a shape broadcastable to \(2, 4, 4\)\."):
        kmix.ops.masked_softmax(np.zeros((2, 4, 4)), mask=np.ones((2, 5), bool))
    with pytest.raises(ValueError, match=r"must not have more dimensions.*mask\.shape=\(1, 1, 3\)"):
        kmix.ops.masked_softmax(np.zeros((1, 3)), mask=np.ones((1, 1, 3)))
    with pytest.raises(ValueError, match=r"Received: bias\.shape=\(3,\)"):
        kmix.ops.masked_log_softmax(np.zeros((2, 4)), bias=np.zeros(3))


def test_dtype_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"Received: mask\.dtype=string; expected bool"):
        kmix.ops.masked_softmax(np.zeros((2, 3)), mask=tf.constant(["a", "b", "c"]))
    with pytest.raises(TypeError, match=r"Received: bias\.dtype=bool.*Pass a boolean mask as `mask`"):
        kmix.ops.masked_softmax(np.zeros((2, 3)), bias=np.ones(3, bool))
    with pytest.raises(ValueError, match=r"Received: dtype='int32'; expected None or a float dtype"):
        kmix.ops.masked_softmax(np.zeros((2, 3)), dtype="int32")


def test_axis_errors():
    for axis in (2, -3, (0, 0), (), 1.0, "1", True):
        with pytest.raises(ValueError, match=r"Received: axis=.*expected an int or a non-empty tuple"):
            kmix.ops.masked_softmax(np.zeros((2, 3)), axis=axis)


def test_symbolic_input_points_to_the_layer():
    with pytest.raises(TypeError, match="kmix.layers.MaskedSoftmax"):
        kmix.ops.masked_softmax(keras.Input((3,)))


# ------------------------------------------------------------------ a bias given as `mask`
def _bias_and_keep():
    keep = RNG.random(SHAPE) > 0.4
    keep[1, 2] = False
    return keep, np.where(keep, 0.0, -1e9)


@pytest.mark.parametrize("kind", ["-1e9", "-inf", "float16 -1e9 (-inf)", "0/2"])
def test_additive_bias_as_mask_raises_pointing_to_bias(kind):
    keep, bias = _bias_and_keep()
    mask = {
        "-1e9": bias,
        "-inf": np.where(keep, 0.0, -np.inf),
        "float16 -1e9 (-inf)": tf.cast(bias, tf.float16),
        "0/2": keep * 2.0,
    }[kind]
    x = _logits("plain")
    with pytest.raises(ValueError, match=r"outside \[0, 1\].*pass it as `bias=`"):
        kmix.ops.masked_softmax(x, mask=mask)
    with pytest.raises(ValueError, match="additive bias"):
        kmix.ops.masked_log_softmax(x, mask=mask)
    # What the user meant: the same values as `bias` equal the float64 reference.
    if kind != "0/2":
        want, _ = reference(x, mask=keep)
        np.testing.assert_allclose(kmix.ops.masked_softmax(x, bias=mask, dtype="float64"), want, atol=1e-12)


def test_bias_as_mask_in_a_graph_raises_and_under_xla_gives_nan():
    keep, bias = _bias_and_keep()
    x = _logits("plain").astype(np.float32)

    def fn(logits, mask):
        return kmix.ops.masked_softmax(logits, mask=mask)

    graph, xla = tf.function(fn), tf.function(fn, jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"outside \[0, 1\].*bias="):
        graph(x, bias.astype(np.float32))
    assert np.isnan(xla(x, bias.astype(np.float32)).numpy()).all()  # XLA drops assertions
    # A 0/1 float mask passes the check on every path and equals the reference.
    want, _ = reference(x, mask=keep)
    for f in (graph, xla):
        np.testing.assert_allclose(f(x, keep.astype(np.float32)), want, atol=1e-6)
    # A constant mask is checked while tracing: the ValueError of eager mode.
    with pytest.raises(ValueError, match="bias="):
        tf.function(lambda logits: fn(logits, tf.constant(bias)))(x)


def test_keep_mask_as_bias_warns_pointing_to_mask():
    keep, bias = _bias_and_keep()
    x = _logits("plain")
    with pytest.warns(UserWarning, match=r"only 0 and 1.*`mask=`"):
        out = kmix.ops.masked_softmax(x, bias=keep.astype(np.float32), dtype="float64")
    # It masks nothing: it is a bias of +1 on the kept positions.
    want, _ = reference(x, bias=keep.astype(np.float64))
    np.testing.assert_allclose(out, want, atol=1e-12)
    with pytest.warns(UserWarning, match="only 0 and 1"):
        tf.function(lambda logits: kmix.ops.masked_softmax(logits, bias=tf.constant(keep, tf.float32)))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kmix.ops.masked_softmax(x, bias=bias)  # a real bias: no warning
        kmix.ops.masked_softmax(x, bias=np.zeros(SHAPE))  # all zeros: nothing to say


@pytest.mark.parametrize("mask_shape", [(4, 9), (9,), (3, 4, 1)], ids=["rows", "keys", "per_row"])
def test_rows_from_mask_path_equals_the_full_check(mask_shape):
    """What kmix's attention takes for scores that hold no -inf: the same values and gradients."""
    from kmix.ops.softmax import _masked_softmax

    logits = tf.constant(RNG.normal(scale=3, size=SHAPE), tf.float32)
    mask = RNG.random(mask_shape) > 0.4
    mask.reshape(-1, mask_shape[-1])[0] = False  # one row (or every row: per_row) with nothing kept
    upstream = tf.constant(RNG.normal(size=SHAPE), tf.float32)
    results = []
    for infinite_logits in (True, False):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            out = _masked_softmax(logits, mask, None, -1, "bfloat16", log=False, infinite_logits=infinite_logits)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * upstream)
        results.append((tf.cast(out, tf.float32).numpy(), tape.gradient(loss, logits).numpy()))
    (out_full, grad_full), (out_rows, grad_rows) = results
    np.testing.assert_array_equal(out_rows, out_full)
    np.testing.assert_allclose(grad_rows, grad_full, atol=1e-6)
    assert np.all(np.isfinite(grad_rows)) and np.all(grad_rows[~np.broadcast_to(mask, SHAPE)] == 0)
