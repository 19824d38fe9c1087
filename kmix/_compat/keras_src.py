"""The only module of kmix that imports `keras.src`: the three private Keras modules kmix needs.

Imported on first use (`keras.src` moves between Keras releases; a change
breaks the feature that needs it, not `import kmix`). Why each is needed is
said where it is used, in the other modules of `kmix._compat`.
"""


def functional_class():
    """Keras's `Functional` model class (`keras.Model(inputs, outputs)` returns one; no public name)."""
    from keras.src.models.functional import Functional

    return Functional


def tracking():
    """Keras's `keras.src.utils.tracking` module (automatic dependency tracking of attributes)."""
    from keras.src.utils import tracking as module

    return module


def tensorflow_trainer():
    """Keras's TensorFlow trainer module (`TensorFlowTrainer`, `reduce_per_replica`)."""
    from keras.src.backend.tensorflow import trainer

    return trainer


def global_state():
    """Keras's `keras.src.backend.common.global_state` module (its process-wide attributes)."""
    from keras.src.backend.common import global_state as module

    return module
