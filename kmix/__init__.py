"""kmix: safe and fast mixed-precision training for Keras 3 (TensorFlow backend).

    import keras, kmix
    model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(3e-4)), loss=...)
"""

__version__ = "0.1.0"

from kmix import callbacks, layers, ops, schedules  # noqa: E402
from kmix.optimizers import LossScaleOptimizer, wrap  # noqa: E402

__all__ = [
    "LossScaleOptimizer",
    "__version__",
    "callbacks",
    "layers",
    "ops",
    "schedules",
    "wrap",
]
