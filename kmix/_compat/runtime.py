"""TensorFlow's runtime facts with no public accessor: oneDNN, profiler traces."""

import contextlib
import functools


def onednn_enabled():
    """Whether TensorFlow runs its CPU kernels and CPU allocator through oneDNN in this process.

    `python -m kmix bench memory` reads the CPU allocator's statistics, which
    TensorFlow's default CPU allocator keeps only when oneDNN is on (by default
    only on CPUs with AVX-512 and the like); otherwise the benchmark switches to
    the BFC allocator before TensorFlow's runtime starts. TensorFlow decides
    this from the CPU and `TF_ENABLE_ONEDNN_OPTS` and exposes the answer only
    through this private module.
    """
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def xplane_proto():
    """The protobuf module of TensorFlow profiler traces (`*.xplane.pb`).

    `python -m kmix bench profile` reads the per-op times of a
    `tf.profiler.experimental` trace. TensorFlow ships the message type only
    under this internal path; the alternative, the tensorboard-plugin-profile
    package, would be a dependency for one parser.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2


@contextlib.contextmanager
def releasing_custom_gradients():
    """Drops the gradient functions that traces made inside the block registered, on exit.

    Every graph-mode call of a `tf.custom_gradient` function (Keras's own `silu` on TensorFlow, used by Llama, Qwen,
    Gemma, Mistral...) and every `tf.saved_model.load` of such a model registers a gradient function under a fresh name
    in TensorFlow's global gradient registry, which is never emptied: it holds the traced graph, and through it whatever
    the graph captured, for the life of the process. kmix's own traces (the export's served function and its read-back,
    recommend's timed steps, autocast's check) are thrown away when the call returns, so their registrations are too; a
    trace that outlives the call (a model's `predict_function`) has already taken its gradients. The registry is
    `ops.gradient_registry`, a private name with no public way to unregister. Checked on TensorFlow 2.16-2.21.
    """
    from tensorflow.python.framework import ops

    registry = getattr(getattr(ops, "gradient_registry", None), "_registry", None)
    before = set(registry) if isinstance(registry, dict) else None
    try:
        yield
    finally:
        if before is not None:
            for name in [n for n in registry if n not in before and n.startswith("CustomGradient-")]:
                del registry[name]


def releases_custom_gradients(fn):
    """`fn` run inside `releasing_custom_gradients()`: for kmix's public calls whose traces end with them."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with releasing_custom_gradients():
            return fn(*args, **kwargs)

    return wrapper
