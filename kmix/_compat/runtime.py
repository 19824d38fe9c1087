"""TensorFlow's runtime facts with no public accessor: oneDNN, profiler traces."""


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
