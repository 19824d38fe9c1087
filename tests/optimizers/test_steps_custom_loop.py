"""The README's custom training loop: `scale_loss` / `apply` in a `tf.GradientTape` step."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras
import kmix


def run(wrapped, steps=12):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-2)
    if wrapped:
        # Keras's own Adam arithmetic (not the fused kernel): the comparison is bitwise.
        opt = kmix.wrap(opt, dynamic=True, initial_scale=2.0**15, growth_interval=4, fused_update=False)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = opt.scale_loss(loss) if wrapped else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    rng = np.random.default_rng(3)
    for step in range(steps):
        x = rng.normal(size=(8, 5)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        if wrapped and step == 5:
            x[0, 0] = np.nan  # this step is skipped...
        elif not wrapped and step == 5:
            continue  # ...so the reference leaves it out
        train_step(tf.constant(x), tf.constant(y))
    return model.get_weights(), opt


def test_custom_loop_matches_unscaled_float32_loop():
    reference, _ = run(wrapped=False)
    got, opt = run(wrapped=True)
    for a, b in zip(reference, got):
        np.testing.assert_array_equal(a, b)  # power-of-two scaling is exact in float32
    assert int(opt.skipped_steps) == 1
    # 4 finite steps -> x2, skip -> /2, 4 more -> x2, 2 more.
    assert float(opt.loss_scale) == 2.0**16


def test_tf_keras_names():
    opt = kmix.wrap("sgd", dynamic=True, initial_scale=8.0)
    var = keras.Variable(np.ones(2, np.float32))
    opt.build([var])
    assert float(opt.get_scaled_loss(tf.constant(1.5))) == 12.0
    grads = opt.get_unscaled_gradients([tf.constant([8.0, 16.0], tf.float16), None])
    assert grads[1] is None and grads[0].dtype == tf.float32
    np.testing.assert_array_equal(grads[0].numpy(), [1.0, 2.0])


# ------------------------------------------------- unscale, clip, apply(scaled=False)
CLIP = 0.5  # global norm; the gradients here are larger, so every step is clipped


def clipped_run(wrapped, jit, accumulation_steps=1, steps=9, bad=4):
    """Unscale -> clip_by_global_norm -> apply(scaled=False); the reference clips float32 grads.

    The reference is the inner optimizer alone on the float32 model, applied to
    the clipped true gradients: per step, or the mean of `accumulation_steps`
    clipped micro-batch gradients. Batch `bad` holds a NaN: kmix skips it (the
    whole window under accumulation), the reference leaves it (its window) out.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    variables = model.trainable_variables
    inner = keras.optimizers.Adam(1e-2)
    opt = kmix.wrap(inner, dynamic=True, initial_scale=2.0**15, growth_interval=3, fused_update=False,
                    accumulation_steps=accumulation_steps) if wrapped else inner
    opt.build(variables)
    loss_fn = keras.losses.MeanSquaredError()

    def clipped_grads(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = opt.scale_loss(loss) if wrapped else loss
        grads = tape.gradient(scaled, variables)
        if wrapped:
            grads = opt.get_unscaled_gradients(grads)
        return tf.clip_by_global_norm(grads, CLIP)[0]

    @tf.function(jit_compile=jit)
    def kmix_step(x, y):
        opt.apply(clipped_grads(x, y), variables, scaled=False)

    @tf.function(jit_compile=jit)
    def window_grads(x, y):
        return clipped_grads(x, y)

    rng = np.random.default_rng(1)
    batches = []
    for step in range(steps):
        x = rng.normal(scale=3.0, size=(8, 5)).astype("float32")
        y = 10 * x.sum(axis=1, keepdims=True)
        if step == bad:
            x[0, 0] = np.nan
        batches.append((tf.constant(x), tf.constant(y)))
    if wrapped:
        for x, y in batches:
            kmix_step(x, y)
    else:
        k = accumulation_steps
        for start in range(0, steps - steps % k, k):
            if start <= bad < start + k:
                continue  # the window with the NaN batch is skipped whole
            window = [window_grads(*batches[i]) for i in range(start, start + k)]
            opt.apply([tf.add_n(list(g)) / k for g in zip(*window)], variables)
    return model.get_weights(), opt


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("accumulation_steps", [1, 3])
def test_apply_unscaled_clipped_gradients_equals_inner_optimizer(jit, accumulation_steps):
    reference, _ = clipped_run(False, jit, accumulation_steps)
    got, opt = clipped_run(True, jit, accumulation_steps)
    for a, b in zip(reference, got):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    k = accumulation_steps
    assert int(opt.skipped_steps) == 1
    assert int(opt.iterations) == 9 // k - 1
    # Finite steps between overflows set the scale: growth every 3, one halving.
    good_before = 4 // k  # windows applied before the NaN
    grown = good_before // 3 + (9 // k - 1 - good_before) // 3
    assert float(opt.loss_scale) == 2.0**15 * 2.0**grown / 2


def test_scaled_says_what_the_gradients_are():
    """`scaled=False`: used as given; `scaled=True`: divided by the scale; neither and no mark: as given, warned."""
    var = keras.Variable(np.zeros(1, np.float32))
    opt = kmix.wrap(keras.optimizers.SGD(1.0), dynamic=True, initial_scale=2.0**15)
    opt.build([var])
    true_grad = [tf.constant([1.0])]
    opt.apply(true_grad, [var], scaled=False)
    assert float(var.numpy()[0]) == -1.0
    opt.apply(true_grad, [var], scaled=True)  # taken as scaled: divided by 2^15
    assert float(var.numpy()[0]) == -1.0 - 2.0**-15
    with pytest.warns(UserWarning, match=r"apply\(\) received gradients.*not divided"):
        opt.apply(true_grad, [var])  # no scale_loss in this (eager) step: as given
    assert float(var.numpy()[0]) == -2.0 - 2.0**-15
    with pytest.raises(TypeError, match="scaled"):
        opt.apply(true_grad, [var], scaled="no")


def test_readme_custom_loop_runs_as_written(capsys):
    """The custom-loop block the README had, now in docs/guide.md, run as written (its dataset cut to 2 batches)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "guide.md")
    with open(path) as f:
        readme = f.read()
    section = readme[readme.index("## From the README: a complete custom loop"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    assert "dataset = " in code and "scaled=False" in code
    code = code.replace(".batch(64)", ".batch(64).take(2)")
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    opt = namespace["opt"]
    assert int(opt.iterations) + int(opt.skipped_steps) == 4  # 2 epochs of 2 batches
    out = capsys.readouterr().out
    assert out.startswith("loss ") and "nan" not in out
