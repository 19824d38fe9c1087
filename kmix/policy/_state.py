"""kmix's own global policy state, kept beside Keras's global dtype policy.

Keras keeps its global dtype policy per thread; so does kmix. The state is
the `kmix.Policy` last set by `set_policy` / `policy_scope` and the name of
the Keras policy it set, so that a later `keras.config.set_dtype_policy(...)`
to something else is noticed and the kmix policy no longer claims to be
active.
"""

import threading

import keras

_LOCAL = threading.local()


def get():
    """The `kmix.Policy` last set, or `None` (never set, or Keras's policy changed since)."""
    policy = getattr(_LOCAL, "policy", None)
    if policy is None:
        return None
    if keras.config.dtype_policy().name != getattr(_LOCAL, "keras_name", None):
        return None
    return policy


def set(policy, keras_name):  # noqa: A001  (module-level verb, like Keras's global_state.set)
    """Records `policy` as kmix's policy and `keras_name` as the Keras policy it set."""
    _LOCAL.policy = policy
    _LOCAL.keras_name = keras_name


def save():
    """A snapshot of kmix's policy state, for `restore`."""
    return (getattr(_LOCAL, "policy", None), getattr(_LOCAL, "keras_name", None))


def restore(saved):
    """Puts back a snapshot taken by `save` (Keras's own policy is not touched)."""
    _LOCAL.policy, _LOCAL.keras_name = saved
