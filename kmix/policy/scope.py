"""`set_policy`, `policy_scope` and `active_policy`: kmix's global policy."""

import contextlib
import gc
import sys
import warnings

import keras

from kmix import _state
from kmix.policy.policy import Policy

_WARNED = set()  # the opt levels `set_policy` / `policy_scope` have warned about in this process


def set_policy(spec, half=None):
    """Sets Keras's global dtype policy and the policy `kmix.wrap` will follow.

    Layers created afterwards take `policy.to_keras()`, one Keras policy for every layer (no float32
    islands: those come from `kmix.autocast`, so O1 / O2 here warn once); `kmix.wrap(opt)` follows the
    policy's loss scaling and master weights.

    Args:
        spec: anything `kmix.Policy` accepts: `"O0"`-`"O3"`, a Keras policy
            name, a jmp-style string, or a `kmix.Policy`.
        half: `"float16"` (default) or `"bfloat16"`, for opt levels.

    Returns:
        The `kmix.Policy` now in force.

    Example:

    >>> kmix.set_policy("O1")
    >>> keras.config.dtype_policy()
    <DTypePolicy "mixed_float16">
    """
    policy = _set(Policy(spec, half=half))
    _warn_once(policy, f"kmix.set_policy({policy.opt_level!r}) gives every layer built from now on")
    return policy


def _warn_once(policy, subject, stacklevel=3):
    """The one-time warning for O1 / O2 as a global policy: layers get the whole level's policy."""
    if policy.opt_level not in ("O1", "O2") or policy.opt_level in _WARNED:
        return
    _WARNED.add(policy.opt_level)
    level = policy.opt_level
    warnings.warn(
        f"{subject} Keras's policy {policy.to_keras().name!r}: normalization layers, softmax and "
        f"the model's outputs included, not {level}'s float32 placement. For that, build the "
        f"model in float32 and call `kmix.autocast(model, {level!r})`; compile it inside "
        f"`kmix.policy_scope({level!r})` so that `kmix.wrap` follows the level.",
        stacklevel=stacklevel,
    )


def _layers_holding(keras_policy, baseline):
    """Whether layers created since `baseline` (a reference count) hold `keras_policy`.

    A layer created with no `dtype` keeps the global policy object itself, so
    the scope's own `keras.DTypePolicy` gains references exactly when layers
    are built inside the scope (metrics, losses and optimizers take none).
    The count is O(1); only a rise pays for a look at who refers to it.
    """
    if sys.getrefcount(keras_policy) <= baseline:
        return False
    return any(
        isinstance(r, dict) and r.get("_dtype_policy") is keras_policy
        for r in gc.get_referrers(keras_policy)
    )


def _set(policy):
    keras_policy = policy.to_keras()
    keras.config.set_dtype_policy(keras_policy)
    _state.set_active(policy, keras_policy.name)
    return policy


@contextlib.contextmanager
def policy_scope(spec, half=None):
    """Runs a `with` block under a policy, then restores the previous one.

    Keras's and kmix's global policies are restored on exit, also when the block raises. The scope is
    for *compiling*: `kmix.wrap` inside it follows the level. Layers *built* inside take the level's
    whole Keras policy, as under `set_policy` (warned once per level under O1 / O2).

    Args:
        spec: anything `kmix.Policy` accepts.
        half: `"float16"` (default) or `"bfloat16"`, for opt levels.

    Yields:
        The `kmix.Policy` in force inside the block.

    Example:

    >>> model = kmix.autocast(build_model(), "O2")   # built in float32, placed
    >>> with kmix.policy_scope("O2") as policy:
    ...     model.compile(optimizer=kmix.wrap("adam"), loss="mse")  # float32 master weights
    """
    previous_keras = keras.config.dtype_policy()
    previous = _state.save()
    try:
        policy = _set(Policy(spec, half=half))
        keras_policy = keras.config.dtype_policy()
        baseline = sys.getrefcount(keras_policy)
        try:
            yield policy
        finally:
            if policy.opt_level in ("O1", "O2") and policy.opt_level not in _WARNED:
                if _layers_holding(keras_policy, baseline):
                    _warn_once(
                        policy, f"Layers built inside kmix.policy_scope({policy.opt_level!r}) took", 4
                    )
            del keras_policy
    finally:
        keras.config.set_dtype_policy(previous_keras)
        _state.restore(previous)


def active_policy():
    """The `kmix.Policy` set by `set_policy` / `policy_scope`, if still in force.

    Returns:
        The policy, or `None` if kmix never set one in this thread or Keras's
        global policy has since been changed to another one by other code.

    Example:

    >>> kmix.set_policy("O2")
    >>> kmix.active_policy().needs_master_weights
    True
    >>> keras.config.set_dtype_policy("float32")
    >>> kmix.active_policy() is None
    True
    """
    return _state.active_policy()
