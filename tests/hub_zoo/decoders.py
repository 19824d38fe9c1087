"""keras-hub backbones built tiny: decoders (see `tests.hub_zoo`)."""

BUILDERS = {}
