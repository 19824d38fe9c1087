"""Every route that updates weights scales the loss correctly, or says that it does not.

keras.io's custom `train_step` patterns as tiny Dense models on random data
under `mixed_float16` with `kmix.wrap`. The reference is the same model and
steps under float32 with the bare inner optimizer; float16 compute rounds, so
the comparison allows half-precision error. Before kmix checked the route, the
unscaled gradients of these steps were divided by 2^15 and nothing moved.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix

# Targets and an initial scale (2^10) small enough that the scaled gradients stay finite in
# float16 (2^15 overflows twice and backs off): no step is skipped, so the float16 run takes
# the same steps as the float32 reference.
SCALE = 2.0**10
TRUE_W = np.array([[0.25], [0.5], [-0.25], [0.75]], "float32")


def data(n=128):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, x @ TRUE_W + 0.125


def mse(pred, y):
    return keras.ops.mean((keras.ops.cast(pred, "float32") - y) ** 2)


def dense(name, units=1):
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(units, name=f"{name}_dense")(inputs), name=name)


class OneOptimizer(keras.Model):
    """keras.io's "customizing fit": one optimizer, `apply_gradients` (or Keras 3's `apply`), `scale_loss` or not."""

    def __init__(self, scale, use_apply=False, **kwargs):
        super().__init__(**kwargs)
        self.net, self.scale, self.use_apply = dense("net"), scale, use_apply

    def call(self, x):
        return self.net(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = mse(self(x, training=True), y)
            if self.scale:
                loss = self.optimizer.scale_loss(loss)
        grads = tape.gradient(loss, self.trainable_variables)
        if self.use_apply:
            self.optimizer.apply(grads, self.trainable_variables)
        else:
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class VAELike(OneOptimizer):
    """keras.io's VAE: part of the loss comes from `add_loss` inside the forward pass."""

    def call(self, x):
        y = self.net(x)
        self.add_loss(1e-2 * keras.ops.mean(keras.ops.cast(y, "float32") ** 2))
        return y

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = mse(self(x, training=True), y) + keras.ops.sum(self.losses)
            if self.scale:
                loss = self.optimizer.scale_loss(loss)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class GANLike(keras.Model):
    """keras.io's GAN shape: two sub-models, two optimizers, two tapes, one step.

    `critic` follows WGAN-GP: its loss holds a gradient penalty taken with a
    nested tape (the gradient of its output with respect to its input).
    """

    def __init__(self, scale_d, scale_g, **kwargs):
        super().__init__(**kwargs)
        self.critic, self.generator = dense("critic"), dense("generator")
        self.scale_d, self.scale_g = scale_d, scale_g

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def call(self, x):
        return self.critic(x), self.generator(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(x)
                critic_out = self.critic(x, training=True)
            slope = tf.cast(inner.gradient(critic_out, x), "float32")
            penalty = keras.ops.mean((keras.ops.sqrt(keras.ops.sum(slope**2, axis=1)) - 1.0) ** 2)
            d_loss = mse(critic_out, y) + 0.1 * penalty
            if self.scale_d:
                d_loss = self.d_optimizer.scale_loss(d_loss)
        grads = tape.gradient(d_loss, self.critic.trainable_variables)
        self.d_optimizer.apply_gradients(zip(grads, self.critic.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = mse(self.generator(x, training=True), 2.0 * y)
            if self.scale_g:
                g_loss = self.g_optimizer.scale_loss(g_loss)
        grads = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
        return {"g_loss": g_loss}


def train(make, policy, n_optimizers=1, epochs=3):
    """Fits `make()`: float32 with bare SGD, or `policy` with `kmix.wrap(SGD)` made under it."""
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    optimizers = [sgd() if policy == "float32" else kmix.wrap(sgd(), initial_scale=SCALE) for _ in range(n_optimizers)]
    model = make()
    x, y = data()
    model(x[:1])
    if isinstance(model, GANLike):
        model.compile(*optimizers)
    else:
        model.compile(optimizer=optimizers[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    messages = [str(w.message) for w in caught if "scale_loss in the same step" in str(w.message)]
    weights = [w.numpy().astype("float32") for w in model.trainable_variables]
    for opt in optimizers:
        if policy != "float32":
            assert int(opt.skipped_steps) == 0 and int(opt.iterations) == 8 * epochs
    return weights, messages, optimizers


def sgd():
    return keras.optimizers.SGD(0.1)


@functools.cache
def float32_reference(cls):
    """`cls`'s weights trained under float32 with bare SGD, once per module: `scale` and `use_apply` do not
    change them (a bare Keras optimizer's `scale_loss` returns the loss as it is)."""
    return train(lambda: cls(True), "float32")[0]


@pytest.mark.parametrize("use_apply", [False, True], ids=["apply_gradients", "apply"])
@pytest.mark.parametrize("scale", [True, False], ids=["scale_loss", "keras_io"])
def test_one_optimizer_train_step(scale, use_apply):
    reference = float32_reference(OneOptimizer)
    got, messages, (opt,) = train(lambda: OneOptimizer(scale, use_apply), "mixed_float16")
    assert opt.dynamic and float(opt.loss_scale) == SCALE  # float16: the scale is real
    for a, b in zip(reference, got):
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2)
    assert np.abs(reference[0] - TRUE_W).max() < 0.02  # float32 learned the line...
    if scale:
        assert messages == []
    else:  # ...and so did the keras.io step, unscaled, with one warning (not one per step)
        assert len(messages) == 1 and f"'{opt.name}': {'apply' if use_apply else 'apply_gradients'}()" in messages[0]
        assert "self.optimizer.scale_loss(loss)" in messages[0] and "not divided" in messages[0]


@pytest.mark.parametrize("scale", [True, False], ids=["scale_loss", "keras_io"])
def test_vae_like_add_loss_train_step(scale):
    reference = float32_reference(VAELike)
    got, messages, _ = train(lambda: VAELike(scale), "mixed_float16")
    for a, b in zip(reference, got):
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2)
    assert len(messages) == (0 if scale else 1)


def test_gan_two_optimizers_each_checked_apart_with_a_gradient_penalty():
    """The critic's loss (nested tape) is scaled, the generator's is not: only its optimizer warns."""
    reference, _, _ = train(lambda: GANLike(True, False), "float32", 2)
    got, messages, (d_opt, g_opt) = train(lambda: GANLike(True, False), "mixed_float16", 2)
    for a, b in zip(reference, got):
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2)
    assert len(messages) == 1 and f"'{g_opt.name}'" in messages[0] and f"'{d_opt.name}'" not in messages[0]


def test_fit_scales_through_keras_trainer_with_a_strategy_and_xla():
    """`fit` calls scale_loss itself: no warning, the steps equal float32's, on two replicas and under XLA."""
    keras.config.set_dtype_policy("float32")
    x, y = data(64)

    def fit(opt, strategy, jit):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer=opt(), loss="mse", jit_compile=jit)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    cpus = tf.config.list_logical_devices("CPU")
    # No collectives: their keys restart with each strategy, and another test's strategy
    # in this process may have used them for other shapes.
    mirrored = tf.distribute.MirroredStrategy([d.name for d in cpus[:2]],
                                               cross_device_ops=tf.distribute.ReductionToOneDevice())
    reference = fit(sgd, tf.distribute.get_strategy(), False)
    for strategy, jit in ((tf.distribute.get_strategy(), True), (mirrored, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any unscaled-route warning fails the test
            got = fit(lambda: kmix.wrap(sgd(), dynamic=True), strategy, jit)
        for a, b in zip(reference, got):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)  # 2^15 scaling is exact


def test_custom_loop_apply_without_scale_loss_applies_as_given_and_warns_once():
    var = keras.Variable(np.zeros(1, np.float32))
    opt = kmix.wrap(keras.optimizers.SGD(1.0), dynamic=True, initial_scale=4.0)
    step = tf.function(lambda g: opt.apply([g], [var]))
    with pytest.warns(UserWarning, match=r"apply\(\) received gradients.*not divided"):
        step(tf.constant([4.0]))
    assert float(var.numpy()[0]) == -4.0  # as given: the step was written for float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(tf.constant([8.0]))  # traced once: no second warning
        opt.apply([tf.constant([4.0])], [var], scaled=True)  # said explicitly: divided, silent

        @tf.function
        def scaled_step():
            loss = opt.scale_loss(tf.reduce_sum(var * 2.0))  # d/dvar = 2 * scale
            grads = tf.gradients(loss, [var])
            opt.apply(grads, [var])

        scaled_step()
    assert float(var.numpy()[0]) == -4.0 - 8.0 - 1.0 - 2.0


def test_a_retrace_and_a_later_step_do_not_inherit_a_mark():
    """A mark belongs to one step: scale_loss in one call does not make the next call's gradients scaled."""
    var = keras.Variable(np.zeros(1, np.float32))
    opt = kmix.wrap(keras.optimizers.SGD(1.0), dynamic=True, initial_scale=4.0)
    opt.build([var])
    opt.scale_loss(tf.constant(1.0))  # eager mark, consumed by the next eager apply_gradients
    opt.apply_gradients([(tf.constant([8.0]), var)])
    assert float(var.numpy()[0]) == -2.0  # divided by 4
    with pytest.warns(UserWarning, match="apply_gradients"):
        opt.apply_gradients([(tf.constant([1.0]), var)])  # no mark left: applied as it is
    assert float(var.numpy()[0]) == -3.0
