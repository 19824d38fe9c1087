"""Putting a Keras object's class and attributes back as they were.

Keras has no public "snapshot and restore" of a layer: placing a model sets
policies through public setters, but undoing that on every layer, graph node
and operation (autocast also swaps classes and replaces constants) needs the
objects' own `__dict__` and `__class__`. Checked on Keras 3.10-3.15.
"""


def object_state(obj):
    """`(class, shallow copy of its attributes, copies of its dict attributes)`: what `restore_object_state` puts back.

    Dict attributes are copied one level down too: a keras-hub backbone's
    `DTypePolicyMap` is shared by its layers and changed in place (its
    `_policy_map`), not replaced.
    """
    attrs = dict(vars(obj))
    return type(obj), attrs, {k: dict(v) for k, v in attrs.items() if type(v) is dict}


def restore_object_state(obj, state):
    """Gives `obj` the class and attributes `object_state` took; returns whether anything changed.

    Attributes are compared by identity, never with `==`: Keras's
    `DTypePolicy.__eq__` raises against a `DTypePolicyMap` (keras-hub
    backbones hold both), and a restore must not call user code.
    """
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
