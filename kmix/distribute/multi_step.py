"""`steps_per_execution > 1` under a `tf.distribute` strategy (keras-team/keras#19246).

Keras 3.15 runs each step of an execution inside a `tf.cond`, where a collective all-reduce fails
("You must feed a value for placeholder tensor"). The loop below asks in its condition whether the next
batch exists, so its body runs the step unconditionally; each step is Keras's `strategy.run` and
`reduce_per_replica`. Everything else (no strategy, one step per execution, eager, `predict`) is Keras's.
"""

import logging

import tensorflow as tf

from kmix import _compat

_log = logging.getLogger("kmix")
_keras_has_bug = {}  # Keras's _make_function -> probe result (True, False or None)
_warned_unrolled = []


def log_if_keras_fixed(part, bug, issue):
    """Logs (WARNING) that Keras's `part` stays in place because `bug` is False (fixed) or None (unknown)."""
    if bug is False:
        _log.warning("kmix.distribute.enable_multi_worker_fit: the installed Keras no longer has the %s bug of %s; "
                     "kmix leaves Keras's own code in place.", part, issue)
    elif bug is None:
        _log.warning("kmix.distribute.enable_multi_worker_fit: Keras's %s has changed so that kmix cannot tell "
                     "whether %s is fixed; kmix leaves Keras's own code in place.", part, issue)


def _keras_still_has_bug(keras_make_function):
    """Keras's `_make_function` still traces its steps inside a `tf.cond` (probed once)."""
    if keras_make_function not in _keras_has_bug:
        bug = _compat.keras_steps_in_cond(keras_make_function)
        _keras_has_bug[keras_make_function] = bug
        log_if_keras_fixed("multi-step loop", bug, "keras-team/keras#19246")
    return bool(_keras_has_bug[keras_make_function])


def _multi_step_function(model, step_function):
    """`function(iterator)` running up to `model.steps_per_execution` steps with no `tf.cond` around them."""
    strategy = model.distribute_strategy
    if model.unrolled_steps_per_execution > 1 and not _warned_unrolled:
        _warned_unrolled.append(True)
        _log.warning("kmix: unrolled_steps_per_execution=%d is not applied under a tf.distribute strategy; the "
                     "steps run one per loop iteration.", model.unrolled_steps_per_execution)

    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        # Looked up on each trace: enable_multi_worker_fit may have replaced it.
        reduce_per_replica = _compat.keras_reduce_per_replica()
        return reduce_per_replica(outputs, strategy, reduction="auto")

    one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile)
    one_step_on_data = _compat.autoconvert_optionals(model, one_step_on_data)

    def multi_step_on_iterator(iterator):
        steps = model.steps_per_execution
        empty_outputs = tf.experimental.Optional.empty(None)  # its spec is set when the body is traced

        def cond(step, outputs, next_inputs):
            return tf.logical_and(tf.less(step, steps), next_inputs.has_value())

        def body(step, outputs, next_inputs):
            outputs = tf.experimental.Optional.from_value(one_step_on_data(next_inputs.get_value()))
            _compat.set_optional_spec(empty_outputs, outputs.element_spec)
            next_inputs = tf.cond(tf.less(step + 1, steps), iterator.get_next_as_optional, lambda: next_inputs)
            return step + 1, outputs, next_inputs

        _, outputs, _ = tf.while_loop(cond, body, [tf.constant(0), empty_outputs, iterator.get_next_as_optional()])
        _compat.set_optional_spec(outputs, empty_outputs.element_spec)
        return outputs

    return tf.function(multi_step_on_iterator, reduce_retracing=True)


def make_function_replacement(keras_make_function):
    """A `TensorFlowTrainer._make_function` that uses the loop above where Keras's fails."""

    def _make_function(self, step_function):
        keras_function = keras_make_function(self, step_function)
        if (self.steps_per_execution == 1 or self.run_eagerly or _compat.model_distribute_strategy(self) is None
                or not _keras_still_has_bug(keras_make_function)):
            return keras_function
        multi_step_on_iterator = _multi_step_function(self, step_function)

        def function(iterator):
            if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                return keras_function(iterator)  # a Python iterator: Keras's loop has no tf.cond
            outputs = multi_step_on_iterator(iterator)
            if not outputs.has_value():
                raise StopIteration
            return outputs.get_value()

        return function

    _make_function.kmix_replaces = keras_make_function
    return _make_function
