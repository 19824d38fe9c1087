"""kmix: safe and fast mixed-precision training for Keras 3 (TensorFlow backend).

    import keras, kmix
    rec = kmix.recommend(model, x, y)           # your training step, timed on each route here
    model = kmix.autocast(model, rec.policy)    # in place: no copy of the weights
    with kmix.policy_scope(rec.policy):
        model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(3e-4)), loss=...,
                      jit_compile=rec.jit_compile)
"""

__version__ = "0.1.0"

from kmix import _startup  # noqa: E402  (before anything imports TensorFlow)

if _startup.launched_as_command():
    _startup.quiet_tensorflow_start()

from kmix import callbacks, distribute, layers, ops, schedules  # noqa: E402
from kmix.diagnose import Diagnosis, diagnose  # noqa: E402
from kmix.optimizers import LossScaleOptimizer, wrap  # noqa: E402
from kmix.placing import autocast  # noqa: E402
from kmix.policy import Policy, active_policy, memory_report, policy_scope, set_policy  # noqa: E402
from kmix.route import device  # noqa: E402  (kmix.device: the device's facts and probe)
from kmix.route.recommendation import Recommendation, recommend  # noqa: E402
from kmix.serving import export  # noqa: E402

__all__ = [
    "Diagnosis",
    "LossScaleOptimizer",
    "Policy",
    "Recommendation",
    "__version__",
    "active_policy",
    "autocast",
    "callbacks",
    "diagnose",
    "distribute",
    "export",
    "layers",
    "memory_report",
    "ops",
    "policy_scope",
    "recommend",
    "schedules",
    "set_policy",
    "wrap",
]
