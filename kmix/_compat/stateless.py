"""A model built without weights, and run on another model's variables: Keras's `StatelessScope`.

`keras.StatelessScope()` makes the variables created inside it without storage (Keras registers each as uninitialised),
and `keras.StatelessScope(state_mapping=[(variable, value), ...])` reads the given values in place of the variables': a
twin built so computes on the model's own variables, with no copy of them. What is private: when the outermost
`StatelessScope` exits, Keras initialises every variable still on its process-wide list of uninitialised variables
(`global_state`'s `"uninitialized_variables"`), whoever made it, which would allocate the twin's weights after all (+1x
the model). No public name takes a variable off that list, so `stateless` takes off the ones made inside it.
"""

import contextlib

import keras

from kmix._compat import keras_src

_LIST = "uninitialized_variables"


@contextlib.contextmanager
def stateless(state_mapping=None):
    """A `keras.StatelessScope`; the variables created inside are left uninitialised, and unlisted.

    Args:
        state_mapping: `[(variable, value or variable)]`, as `keras.StatelessScope` takes it.
    """
    state = keras_src.global_state()
    before = {id(v) for v in state.get_global_attribute(_LIST, []) or []}
    try:
        with keras.StatelessScope(state_mapping=state_mapping, initialize_variables=False):
            yield
    finally:
        listed = state.get_global_attribute(_LIST, []) or []
        state.set_global_attribute(_LIST, [v for v in listed if id(v) in before])
