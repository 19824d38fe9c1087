"""Whether a normalization layer computes its statistics in float32 under a half policy, measured once per class.

Built from its config under "float32" and "mixed_float16" with the same weights and called on |x| ~ `SCALE`
(squares past 65504): float32 statistics <=> a finite half output within `TOLERANCE` of the float32 one.
"""

import collections
import inspect
import json
import warnings

import keras
import numpy as np

from kmix.placing import trace

SCALE = 1000.0  # |x| of the probe's inputs: squares near 1e6, past float16's 65504
TOLERANCE = 2e-2  # float16 output rounding (2^-11 relative) with room to spare
_MAX_ELEMENTS = 2**16
_CACHE = {}  # (class, config without name and dtype) -> Verdict


Verdict = collections.namedtuple("Verdict", "float32 detail error", defaults=(None,))
Verdict.__doc__ = """What the probe found for one class: `float32` True (float32 statistics under a half
policy), False (half) or None (not probed); a `detail` for the table; the half output's largest `error`
relative to the float32 one's largest value (inf when non-finite, None when not probed)."""


def probe(layer):
    """The `Verdict` for a built normalization `layer`'s class and config (measured once, then cached)."""
    try:
        config = {k: v for k, v in layer.get_config().items() if k not in ("name", "dtype")}
    except NotImplementedError:  # made with a non-serializable argument (a policy map as dtype)
        config = {}  # the class's defaults: the same arithmetic
    key = (type(layer), json.dumps(config, sort_keys=True, default=repr))
    if key not in _CACHE:
        with warnings.catch_warnings():  # the layer's own warnings were shown when it was made
            warnings.simplefilter("ignore")
            verdict, e = trace.attempt(_measure, layer, config)
        _CACHE[key] = verdict or Verdict(None, f"not probed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    return _CACHE[key]


def _measure(layer, config):
    shape = _probe_shape(layer)
    x = np.random.default_rng(0).normal(0.0, SCALE, shape).astype("float16").astype("float32")
    outputs, weights = {}, None
    for dtype in ("float32", "mixed_float16"):
        clone = type(layer).from_config({**config, "dtype": dtype, "name": f"kmix_probe_{dtype}"})
        clone.build(shape)
        weights = clone.get_weights() if weights is None else weights
        clone.set_weights(weights)
        out = clone(x, **({"training": True} if "training" in inspect.signature(clone.call).parameters else {}))
        if isinstance(out, (list, tuple, dict)):
            raise TypeError("returns more than one tensor")
        outputs[dtype] = keras.ops.convert_to_numpy(keras.ops.cast(out, "float32"))
    reference, half = outputs["float32"], outputs["mixed_float16"]
    peak = float(np.max(np.abs(reference)))
    if not np.all(np.isfinite(reference)) or peak == 0.0:
        raise ValueError("its float32 output is not finite or all zero on the probe")
    error = float(np.max(np.abs(half - reference))) / peak if np.all(np.isfinite(half)) else float("inf")
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
