"""Choosing a route: which policy and compilation train fastest here, measured, with the reasons.

A route is a policy (`"float32"`, `"O1-bfloat16"`, `"O1-float16"`) and a
`jit_compile`. Everything that picks one lives in this package:

- `facts`: the device's facts (GPUs and tensor cores, the CPU's
  half-precision features, oneDNN), which explain a route but decide nothing;
- `probe`: a transformer MLP's training step per dtype and compilation, the
  measurement `kmix.recommend()` decides from without a model;
- `device`: `kmix.device`, the facts and the probe as one public namespace;
- `timing`: interleaved rounds, and the round-by-round ratio with its
  confidence bound that every comparison reads;
- `trials`: the user's own training step built and timed on each route;
- `rule`: the decision, a pure function of the timings;
- `recommendation`: `kmix.recommend` and `kmix.Recommendation`;
- `onednn`: whether `TF_ENABLE_ONEDNN_OPTS=1` would be faster (two processes);
- `doctor`: `python -m kmix doctor`, the report of it all.

Imports run one way: facts <- probe <- trials <- recommendation <- doctor,
with timing and rule below them all.
"""
