"""Putting a Keras object's class, attributes and `call` back as they were.

Keras has no public "snapshot and restore" of a layer, nor a public hook
around one layer's call. Checked on Keras 3.10-3.15.
"""

import contextlib


def object_state(obj):
    """`(class, shallow copy of its attributes, copies of its dict attributes)`, or None without a `__dict__`.

    Why: undoing autocast on every layer, graph node and operation (policies,
    swapped classes, replaced constants) needs the objects' own `__dict__` and
    `__class__`; a keras-hub `DTypePolicyMap` is changed in place (its
    `_policy_map` dict), so dict attributes are copied one level down.
    Checked on Keras 3.15.
    """
    if not hasattr(obj, "__dict__"):
        return None
    attrs = dict(vars(obj))
    return type(obj), attrs, {k: dict(v) for k, v in attrs.items() if type(v) is dict}


def restore_object_state(obj, state):
    """Gives `obj` the class and attributes `object_state` took; returns whether anything changed.

    Attributes are compared by identity, never with `==`: Keras's
    `DTypePolicy.__eq__` raises against a `DTypePolicyMap`, and a restore
    must not call user code.
    """
    if state is None:
        return False
    cls, attrs, dicts = state
    changed = False
    if type(obj) is not cls:
        obj.__class__ = cls  # autocast swaps Keras's Softmax / MultiHeadAttention for kmix's in place
        changed = True
    current = vars(obj)
    if current.keys() != attrs.keys() or any(current[k] is not v for k, v in attrs.items()):
        current.clear()
        current.update(attrs)
        changed = True
    for key, contents in dicts.items():
        held = attrs[key]
        if held.keys() != contents.keys() or any(held[k] is not v for k, v in contents.items()):
            held.clear()
            held.update(contents)
            changed = True
    return changed


@contextlib.contextmanager
def calls_replaced(layers, make_call):
    """Within the block `layers[i].call` is `make_call(layers[i], i)`; each layer's own is put back on exit.

    Why: `kmix.diagnose` and autocast's trace read every layer's inputs and
    outputs, nested layers included; Keras has no public per-layer call hook
    (only `Model` callbacks), so the instance's `call` is replaced, never its
    class's. Checked on Keras 3.15.
    """
    missing = object()
    saved = []
    try:
        for i, layer in enumerate(layers):
            saved.append((layer, vars(layer).get("call", missing)))
            layer.call = make_call(layer, i)
        yield
    finally:
        for layer, own in reversed(saved):
            if own is missing:
                vars(layer).pop("call", None)  # absent where an interrupt came before it was set
            else:
                layer.call = own
