"""`kmix.optimizers.SGD`: momentum as a sum of gradients, for float16 storage."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="kmix")
class SGD(keras.optimizers.SGD):
    """Stochastic gradient descent whose momentum survives float16 slots.

    Keras's SGD keeps the momentum with the learning rate inside it,
    `m = momentum * m - lr * g; w = w + m`. With float16 parameters and slots
    (pure half training, kmix's `"O3"`) the product `lr * g` underflows as soon
    as it falls below float16's smallest subnormal, 2^-24 (6e-8), and the
    weights stop moving although the gradients are perfectly representable.
    This class keeps the momentum as a sum of gradients and applies the
    learning rate afterwards, as NVIDIA's float16 Caffe and `torch.optim.SGD`
    do (dampening 0):

    ```
    h = momentum * h + g
    w = w - lr * (g + momentum * h)   if nesterov
    w = w - lr * h                    otherwise
    ```

    Every step is computed in float32 and only stored in the variables'
    dtype, so `lr * h` is never formed in float16. For float32 variables and a
    constant learning rate it is Keras's SGD (the buffers differ by the factor
    `-lr`); when the learning rate changes, the current rate applies to the
    whole buffer, as in torch. Use it for float16 parameters without master
    weights; with float32 parameters (`"O1"`) or float32 master weights
    (`"O2"`) Keras's SGD is as good.

    Args:
        learning_rate: a float, a schedule or a callable, as for Keras's SGD.
        momentum: a float >= 0.
        nesterov: whether to use Nesterov momentum.
        **kwargs: the other `keras.optimizers.SGD` arguments (`weight_decay`,
            `clipnorm`, `use_ema`, `name`, ...).

    Example:

    >>> kmix.set_policy("O3")
    >>> model.compile(optimizer=kmix.wrap(kmix.optimizers.SGD(1e-3, momentum=0.9)), loss="mse")
    """

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, **kwargs):
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        """One step on one variable, in float32, stored in the variable's dtype."""
        lr = ops.cast(learning_rate, "float32")
        g = ops.cast(gradient, "float32")
        if self.momentum == 0:
            self.assign_sub(variable, ops.multiply(g, lr))
            return
        h_var = self.momentums[self._get_variable_index(variable)]
        momentum = ops.cast(self.momentum, "float32")
        h = ops.add(ops.multiply(ops.cast(h_var, "float32"), momentum), g)
        self.assign(h_var, h)
        step = ops.add(g, ops.multiply(h, momentum)) if self.nesterov else h
        self.assign_sub(variable, ops.multiply(step, lr))
