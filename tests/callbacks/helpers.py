"""Tiny models, data and recorders shared by the callback tests.

The "linear" model is a single float32 weight `w` (Dense(1), no bias, zero
init) trained with SGD on x = 1 and y = -1000 under mean absolute error:
the loss is `w + 1000`, its gradient is exactly 1, so every applied SGD
step moves `w` by exactly the learning rate it used. Recording `w` after
each batch therefore shows the learning rate of every step.
"""

import keras
import numpy as np

import kmix

# fit() modes: Keras's default (a traced tf.function), eager, and XLA.
MODES = {
    "graph": dict(jit_compile=False),
    "eager": dict(run_eagerly=True),
    "jit": dict(jit_compile=True),
}


def linear_model(optimizer=None, **compile_kwargs):
    """The one-weight model described above, compiled with `kmix.wrap(SGD(0.1))` by default."""
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(
        optimizer=optimizer if optimizer is not None else kmix.wrap(keras.optimizers.SGD(0.1)),
        loss="mean_absolute_error",
        **compile_kwargs,
    )
    # Built before `fit`, as Keras builds it under a distribution strategy: built in the first
    # trace of the train step instead, a loss scale's counters make TensorFlow trace it twice.
    # Run eagerly there is no trace: left to Keras, built in the first step.
    if not compile_kwargs.get("run_eagerly"):
        model.optimizer.build(model.trainable_variables)
    return model


def linear_data(n, bad=()):
    """`n` samples for `linear_model`; samples at indices `bad` have x = inf (a NaN loss)."""
    x = np.ones((n, 1), np.float32)
    x[list(bad)] = np.inf
    y = np.full((n, 1), -1000.0, np.float32)
    return x, y


class Recorder(keras.callbacks.Callback):
    """Records, after each batch, the weights, a copy of the logs and optimizer scalars."""

    def on_train_begin(self, logs=None):
        self.weights = [[np.array(w) for w in self.model.get_weights()]]
        self.logs = []
        self.scales = []
        self.skipped = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([np.array(w) for w in self.model.get_weights()])
        self.logs.append(dict(logs or {}))
        opt = self.model.optimizer
        if isinstance(opt, kmix.LossScaleOptimizer):
            self.scales.append(float(opt.loss_scale.numpy()))
            self.skipped.append(int(opt.skipped_steps.numpy()))

    def first_weight(self):
        """The scalar weight of `linear_model` before training and after each batch."""
        return np.array([float(w[0].ravel()[0]) for w in self.weights], np.float64)


class StopAt(keras.callbacks.Callback):
    """Raises `KeyboardInterrupt`-like `RuntimeError("interrupted")` after epoch `epoch`."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")
