"""keras-hub backbones built tiny: encoders (see `tests.hub_zoo`)."""

BUILDERS = {}
