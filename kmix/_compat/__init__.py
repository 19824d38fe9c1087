"""The one place kmix touches TensorFlow or Keras names that are not public.

Each use says why no public name does the job. Nothing else in kmix may import
`keras.src` (within this package, only `keras_src` does) or `tf.__internal__`.
The names are grouped by what they reach into: `checkpoint` (how a
`tf.train.Checkpoint` read matches objects), `layers` (the layer tree,
functional graphs, a variable's storage),
`optimizer` (Keras optimizers), `trainer` (Keras's TensorFlow trainer, which
kmix patches for multi-worker fit and multi-step runs) and `runtime`
(oneDNN, profiler traces), `stateless` (a model built without weights, run on
another's variables); callers use them as `_compat.<name>`.
"""

from kmix._compat.checkpoint import NamedMark, NamedRecord, attach_record
from kmix._compat.layers import (
    built_input_shapes,
    graph_nodes,
    is_functional,
    lists_layers,
    node_call,
    node_inputs,
    producer,
    recast_variable,
    replace_dtype_policy,
    set_class,
    set_layer_tensor,
    set_node_arguments,
    set_operation_setting,
    storage_swapped,
    sublayers,
)
from kmix._compat.optimizer import (
    adam_slots,
    captured_handles,
    keras_loss_scale_apply,
    key_as,
    set_keras_loss_scale_apply,
    learning_rate_object,
    leave_weight_decay_of,
    float32_slots,
    loads_nothing,
    replace_update_step,
    replaced_update_step,
    restore_update_step,
    route_assigns,
    no_automatic_dependency_tracking,
    optimizer_variable_key,
    strategy_supports_no_merge_call,
    take_gradients_as_reduced,
    weight_decay_applies,
)
from kmix._compat.objects import calls_replaced
from kmix._compat.objects import object_state, restore_object_state
from kmix._compat.runtime import onednn_enabled, releases_custom_gradients, releasing_custom_gradients, xplane_proto
from kmix._compat.stateless import stateless
from kmix._compat.trainer import (
    autoconvert_optionals,
    keras_make_function,
    keras_multi_worker_bugs,
    keras_reduce_per_replica,
    keras_steps_in_cond,
    keras_symbolic_build,
    model_distribute_strategy,
    set_keras_make_function,
    set_keras_reduce_per_replica,
    set_keras_symbolic_build,
    set_optional_spec,
)

__all__ = [
    "NamedMark",
    "NamedRecord",
    "adam_slots",
    "attach_record",
    "autoconvert_optionals",
    "built_input_shapes",
    "calls_replaced",
    "captured_handles",
    "graph_nodes",
    "is_functional",
    "lists_layers",
    "keras_make_function",
    "keras_multi_worker_bugs",
    "keras_reduce_per_replica",
    "keras_steps_in_cond",
    "keras_loss_scale_apply",
    "key_as",
    "set_keras_loss_scale_apply",
    "keras_symbolic_build",
    "learning_rate_object",
    "leave_weight_decay_of",
    "float32_slots",
    "loads_nothing",
    "replace_update_step",
    "replaced_update_step",
    "restore_update_step",
    "route_assigns",
    "model_distribute_strategy",
    "no_automatic_dependency_tracking",
    "node_call",
    "object_state",
    "restore_object_state",
    "node_inputs",
    "onednn_enabled",
    "releases_custom_gradients",
    "releasing_custom_gradients",
    "optimizer_variable_key",
    "producer",
    "recast_variable",
    "replace_dtype_policy",
    "set_class",
    "set_layer_tensor",
    "set_operation_setting",
    "set_keras_make_function",
    "set_keras_reduce_per_replica",
    "set_keras_symbolic_build",
    "set_node_arguments",
    "set_optional_spec",
    "strategy_supports_no_merge_call",
    "stateless",
    "sublayers",
    "take_gradients_as_reduced",
    "weight_decay_applies",
    "xplane_proto",
]
