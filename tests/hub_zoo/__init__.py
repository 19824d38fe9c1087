"""Every keras-hub `*Backbone` class built tiny from constructor arguments (no presets, no downloads).

`ZOO` maps a backbone class name (`"GemmaBackbone"`) to a builder: a function
of no arguments that builds the backbone under the current global dtype
policy and returns `(backbone, x)`, `x` a deterministic input batch of numpy
arrays shaped and valued as the model expects (token ids below the
vocabulary, padding masks with padding, images in the model's range).
Calling a builder twice builds the same architecture, so the weights of one
build load into another (`set_weights`).
"""

from tests.hub_zoo import decoders, encoders, multimodal, vision

ZOO = {**decoders.BUILDERS, **encoders.BUILDERS, **vision.BUILDERS, **multimodal.BUILDERS}
