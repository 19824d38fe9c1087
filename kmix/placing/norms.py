"""Whether a normalization layer computes its statistics in float32 under a half policy.

Keras's own norms (`LayerNormalization`, `RMSNormalization`,
`BatchNormalization`, ...) and most of keras-hub's (`LlamaLayerNorm`,
Gemma's `RMSNormalization`, `MistralLayerNormalization`) cast their input
to float32, compute mean and variance there and hand back the compute
dtype. Others square their input in the compute dtype: keras-hub's
`T5LayerNorm` gives `inf` in float16 once |x| > 256 (256^2 = 65536 > 65504).
Inside a block, the first kind keeps the block's half policy (the block adds
its output to raw half tensors); the second must compute in float32.

Which kind a class is, is measured once per class and config:

```
a, b = the layer's class from its config under "float32" and under "mixed_float16", same weights
x = normal values of |x| ~ 1000, exactly representable in float16 (x^2 ~ 1e6 > 65504)
float32 statistics  <=>  b(x) is finite and max|b(x) - a(x)| <= TOLERANCE * max|a(x)|
```
"""

import inspect
import json
import warnings

import keras
import numpy as np

SCALE = 1000.0  # |x| of the probe's inputs: squares near 1e6, past float16's 65504
TOLERANCE = 2e-2  # float16 output rounding (2^-11 relative) with room to spare
_MAX_ELEMENTS = 2**16
_CACHE = {}  # (class, config without name and dtype) -> Verdict


class Verdict:
    """What the probe found for one normalization class.

    Attributes:
        float32: True when the class computes its statistics in float32 under
            a half policy, False when in half, None when it could not be probed.
        detail: a few words for the autocast table's `why` column.
        error: the half instance's largest error on the probe, relative to
            the float32 output's largest value (inf when non-finite; None
            when not probed).
    """

    def __init__(self, float32, detail, error=None):
        self.float32, self.detail, self.error = float32, detail, error

    def __repr__(self):
        return f"Verdict(float32={self.float32}, {self.detail!r}, error={self.error})"


def probe(layer):
    """The `Verdict` for `layer`'s class and config (measured once, then cached).

    Args:
        layer: a built normalization layer.

    Returns:
        A `Verdict`.
    """
    try:
        config = {k: v for k, v in layer.get_config().items() if k not in ("name", "dtype")}
    except NotImplementedError:  # made with a non-serializable argument (a policy map as dtype)
        config = {}  # the class's defaults: the same arithmetic
    key = (type(layer), json.dumps(config, sort_keys=True, default=repr))
    if key not in _CACHE:
        try:
            with warnings.catch_warnings():  # the layer's own warnings were shown when it was made
                warnings.simplefilter("ignore")
                _CACHE[key] = _measure(layer, config)
        except Exception as e:  # noqa: BLE001  any failure means "unknown", never a crash of autocast
            _CACHE[key] = Verdict(None, f"not probed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    return _CACHE[key]


def _measure(layer, config):
    shape = _probe_shape(layer)
    x = np.random.default_rng(0).normal(0.0, SCALE, shape).astype("float16").astype("float32")
    outputs = {}
    weights = None
    for dtype in ("float32", "mixed_float16"):
        clone = type(layer).from_config({**config, "dtype": dtype, "name": f"kmix_probe_{dtype}"})
        clone.build(shape)
        if weights is None:
            weights = clone.get_weights()
        else:
            clone.set_weights(weights)
        kwargs = {"training": True} if "training" in inspect.signature(clone.call).parameters else {}
        out = clone(x, **kwargs)
        if isinstance(out, (list, tuple, dict)):
            raise TypeError("returns more than one tensor")
        outputs[dtype] = keras.ops.convert_to_numpy(keras.ops.cast(out, "float32"))
    reference, half = outputs["float32"], outputs["mixed_float16"]
    peak = float(np.max(np.abs(reference)))
    if not np.all(np.isfinite(reference)) or peak == 0.0:
        raise ValueError("its float32 output is not finite or all zero on the probe")
    if not np.all(np.isfinite(half)):
        return Verdict(False, "statistics in half (probed)", error=float("inf"))
    error = float(np.max(np.abs(half - reference))) / peak
    if error > TOLERANCE:
        return Verdict(False, "statistics in half (probed)", error=error)
    return Verdict(True, "statistics in float32 (probed)", error=error)


def _probe_shape(layer):
    """A small input shape the layer accepts: its build shape, unknown and leading axes cut short."""
    build = layer.get_build_config() or {}
    shape = build.get("input_shape")
    if shape is None:
        raise ValueError("no build shape")
    if isinstance(shape, dict) or (shape and isinstance(shape[0], (list, tuple))):
        raise TypeError("takes more than one input")
    shape = [2 if d is None else int(d) for d in shape]
    for axis in range(len(shape) - 1):
        if np.prod(shape) <= _MAX_ELEMENTS:
            break
        shape[axis] = min(shape[axis], 4)
    return tuple(shape)
