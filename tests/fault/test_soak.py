"""Soak: thousands of steps with about 5% injected non-finite gradients.

A float16 model with float32 master weights trains for `KMIX_SOAK_STEPS`
steps (10,000 by default; set the variable for a longer run). About 5% of the
steps get a non-finite gradient: half of them through an inf in the input
(every gradient is NaN), half through a NaN added to one chosen variable's
gradient. The whole loop runs in a `tf.function` (a `tf.while_loop` over a
chunk of steps), which records per step whether any weight, master weight or
optimizer slot changed bit-wise, and the scale and counters afterwards.

Checked against references computed another way:
- a skipped step changes no bit of the training state; a finite step changes it;
- the scale and `good_steps` after every step equal `simulate` (the plain-Python
  run of the optimizer's documented pseudo-code in tests/optimizers);
- `skipped_steps` equals the injected count, `iterations` the finite count,
  `overflow_counts` per variable the injections that reached that variable.
"""

import os
import time

import keras
import numpy as np
import tensorflow as tf

import kmix
from tests.optimizers.test_scaling_trajectory import simulate

STEPS = int(os.environ.get("KMIX_SOAK_STEPS", "10000"))
CHUNK = 2500  # steps per tf.function call: one trace, a progress line per call
RATE = 0.05
SETTINGS = dict(
    initial_scale=2.0**10,
    growth_interval=20,
    growth_factor=2.0,
    backoff_factor=0.5,
    hysteresis=2,
    min_scale=1.0,
    # Low enough that no float16 gradient of this model overflows by itself, so
    # every skip is an injected one; the scale still reaches both bounds.
    max_scale=2.0**12,
)
BATCH, FEATURES = 16, 8


def injection_plan(steps, n_variables, seed=0):
    """Per step: 0 clean, 1 inf in the input, 2 NaN in one variable's gradient; and that variable."""
    rng = np.random.default_rng(seed)
    kind = np.where(rng.random(steps) < RATE, rng.integers(1, 3, steps), 0)
    kind[steps // 2 : steps // 2 + 30] = 1  # a burst: the scale falls to the floor and stays
    target = rng.integers(0, n_variables, steps)
    return kind.astype(np.int32), target.astype(np.int32)


def state_variables(model, optimizer):
    """Everything a skipped step must leave untouched: weights, masters, slots, iterations."""
    counters = {
        id(v)
        for v in (
            optimizer.dynamic_scale,
            optimizer.good_steps,
            optimizer.skipped_steps,
            optimizer.hysteresis_left,
            optimizer.overflow_counts,
            optimizer.min_scale_overflows,
            optimizer.current_growth_interval,
        )
    }
    return list(model.variables) + [v for v in optimizer.variables if id(v) not in counters]


def bits(value):
    """A tensor's bits as integers, so that comparisons see -0.0 vs 0.0 and NaN payloads."""
    if value.dtype.is_integer:
        return value
    return tf.bitcast(value, {2: tf.int16, 4: tf.int32}[value.dtype.size])


def make_soak(model, optimizer, kind, target):
    """A `tf.function(start, count)` that trains `count` steps and records each one."""
    variables = model.trainable_variables
    watched = state_variables(model, optimizer)
    loss_fn = keras.losses.MeanSquaredError()
    kind = tf.constant(kind)
    target = tf.constant(target)

    def one_step(step):
        seed = tf.stack([step, 0])
        x = tf.random.stateless_normal((BATCH, FEATURES), seed)
        y = tf.reduce_sum(x[:, :3], axis=1, keepdims=True)
        x = tf.where(tf.equal(kind[step], 1), tf.tensor_scatter_nd_update(x, [[0, 0]], [np.inf]), x)
        before = [bits(tf.identity(v)) for v in watched]
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        nan = tf.constant(np.nan, tf.float32)
        grads = [
            tf.where(
                tf.logical_and(tf.equal(kind[step], 2), tf.equal(target[step], i)),
                g + tf.cast(nan, g.dtype),
                g,
            )
            for i, g in enumerate(grads)
        ]
        optimizer.apply(grads, variables)
        after = [bits(tf.convert_to_tensor(v)) for v in watched]
        changed = tf.reduce_any([tf.reduce_any(tf.not_equal(a, b)) for a, b in zip(before, after)])
        return changed

    @tf.function
    def soak(start, count):
        records = [tf.TensorArray(dtype, size=count) for dtype in (tf.bool, tf.float32, tf.int64, tf.int64)]

        def body(i, records):
            changed = one_step(start + i)
            values = (
                changed,
                tf.convert_to_tensor(optimizer.loss_scale),
                tf.convert_to_tensor(optimizer.good_steps),
                tf.convert_to_tensor(optimizer.skipped_steps),
            )
            return i + 1, [r.write(i, v) for r, v in zip(records, values)]

        _, records = tf.while_loop(lambda i, _: i < count, body, (tf.constant(0), records))
        return [r.stack() for r in records]

    return soak


def test_soak_skips_leave_no_trace_and_the_scale_follows_the_pseudo_code():
    keras.config.set_dtype_policy("float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    optimizer = kmix.wrap(keras.optimizers.Adam(1e-3), master_weights=True, **SETTINGS)
    optimizer.build(model.trainable_variables)
    n_variables = len(model.trainable_variables)
    kind, target = injection_plan(STEPS, n_variables)
    soak = make_soak(model, optimizer, kind, target)

    started = time.perf_counter()
    chunks = []
    for start in range(0, STEPS, CHUNK):
        count = min(CHUNK, STEPS - start)
        chunks.append([t.numpy() for t in soak(tf.constant(start), tf.constant(count))])
        print(f"soak: {start + count}/{STEPS} steps, {time.perf_counter() - started:.1f} s", flush=True)
    changed, scale, good, skipped = (np.concatenate(parts) for parts in zip(*chunks))

    bad = kind > 0
    expected = simulate(bad, **SETTINGS)
    expected_scale = np.array([e[0] for e in expected], np.float32)
    expected_good = np.array([e[1] for e in expected])
    expected_skipped = np.array([e[2] for e in expected])
    print(
        f"soak figures: {STEPS} steps, {int(bad.sum())} skipped "
        f"({int((kind == 1).sum())} inf inputs, {int((kind == 2).sum())} NaN gradients), "
        f"scale lowest {scale.min():g}, highest {scale.max():g}, "
        f"{time.perf_counter() - started:.1f} s"
    )

    assert not changed[bad].any(), f"skipped steps that changed the state: {np.flatnonzero(changed & bad)[:10]}"
    assert changed[~bad].all(), f"finite steps that changed nothing: {np.flatnonzero(~changed & ~bad)[:10]}"
    first = np.flatnonzero(scale != expected_scale)
    assert first.size == 0, f"step {first[0]}: scale {scale[first[0]]}, simulated {expected_scale[first[0]]}"
    np.testing.assert_array_equal(good, expected_good)
    np.testing.assert_array_equal(skipped, expected_skipped)
    assert scale.min() == SETTINGS["min_scale"] and scale.max() == SETTINGS["max_scale"]

    assert int(optimizer.skipped_steps.numpy()) == int(bad.sum())
    assert int(optimizer.iterations.numpy()) == int((~bad).sum())
    per_variable = [
        int((kind == 1).sum() + ((kind == 2) & (target == i)).sum()) for i in range(n_variables)
    ]
    assert optimizer.overflow_counts.numpy().tolist() == per_variable
    at_floor = int((bad & (np.concatenate([[SETTINGS["initial_scale"]], expected_scale[:-1]]) <= 1.0)).sum())
    assert int(optimizer.min_scale_overflows.numpy()) == at_floor
    for w in model.trainable_variables:
        assert np.isfinite(w.numpy()).all()
