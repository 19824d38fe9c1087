"""The user's own model timed on each route, and put back exactly as it was.

`kmix.recommend` times every route over the user's variables: no copy of
the weights, one optimizer state. Under O1 the routes differ in compute
dtype only; their variables are the same float32 variables. For each route
it places the model itself with `kmix.autocast`, traces the training step
of a `shared_model` (a model that calls the user's, compiled on its own),
and puts every layer back (`kmix._preserved.Preserved`) before placing the
next route. A traced step keeps the placement it was traced under, so the
routes' steps then run interleaved over the same variables.
"""

from kmix._preserved import Preserved  # noqa: F401  (recommend's routes use it as `inplace.Preserved`)


def shared_model(model):
    """A `keras.Model` that calls `model`: its own compile and train step, `model`'s variables.

    It casts nothing on the way in (`autocast=False`): the user's model takes
    its inputs as it takes them from `fit`.
    """
    import keras

    class Shared(keras.Model):
        def __init__(self, inner):
            super().__init__(name=f"kmix_timing_{inner.name}", autocast=False)
            self.inner = inner

        def call(self, inputs, training=None):
            return self.inner(inputs, training=training)

    return Shared(model)
