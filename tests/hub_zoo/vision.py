"""keras-hub backbones built tiny: vision (see `tests.hub_zoo`)."""

BUILDERS = {}
