"""A `tf.train.Checkpoint` dependency that names what its owner holds, checked while a read matches objects.

TensorFlow matches a checkpoint to objects by the names of their dependencies
and reads every value of a subtree in one batch after that matching walk; no
public hook runs between the two. A `Trackable` can see the walk only through
its private methods (`_trackable_children` when written, `_lookup_dependency`
for each saved name when read); checked on TensorFlow 2.21. Its
`_serialize_to_tensors` gives the record a value, so that a read before the
owner attaches it defers it (TF drops saved dependencies without values) and
the owner sees it when it attaches the record.
"""

import tensorflow as tf

_Trackable = tf.__internal__.tracking.Trackable  # the base of every checkpointable object; no public alias


class Leaf(_Trackable):
    """The empty object the record's one dependency points to: its name is what counts."""


class NamedMark(_Trackable):
    """Writes `name()` as the name of its one dependency; `check(saved_name)` sees the name a checkpoint holds.

    Args:
        name: returns the string this owner writes now.
        check: called with each name the checkpoint's record holds, while the
            read is matching objects, before any value is read; raises to
            refuse the read.
        label: what `repr` says (TensorFlow's assertions list unmatched objects by it).
    """

    def __init__(self, name, check, label="record"):
        self._name = name
        self._check = check
        self._label = label
        self._leaf = Leaf()

    def __repr__(self):
        return f"<{self._label}>"

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return {self._name(): self._leaf}

    def _lookup_dependency(self, name, cached_dependencies=None):
        self._check(name)
        return self._leaf if name == self._name() else None


class NamedRecord(NamedMark):
    """A `NamedMark` with a value: a read before its owner attaches it waits for it (see the module).

    TensorFlow's `assert_existing_objects_matched` lists it as unmatched where a
    checkpoint lacks it; a `NamedMark` (no value) it does not list.
    """

    def _serialize_to_tensors(self):
        return {"record": tf.constant(self._name())}

    def _restore_from_tensors(self, restored_tensors):
        return tf.no_op()  # the walk already checked it; the value is for people reading the file


def attach_record(owner, name, record):
    """Makes `record` the checkpoint dependency `name` of `owner`; a read waiting for it is checked now.

    `Trackable._track_trackable` is how TensorFlow declares a dependency
    (said here, not left to an attribute assignment, whose tracking depends
    on Keras's tracking scopes); it also restores what a read before `build`
    deferred to that name, so the record's check runs before `build` goes on.
    """
    owner._track_trackable(record, name=name, overwrite=True)
