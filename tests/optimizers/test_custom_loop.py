"""The README's custom training loop: `scale_loss` / `apply` in a `tf.GradientTape` step."""

import numpy as np
import tensorflow as tf

import keras
import kmix


def run(wrapped, steps=12):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-2)
    if wrapped:
        opt = kmix.wrap(opt, dynamic=True, initial_scale=2.0**15, growth_interval=4)
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
