"""Transitional alias (removed once kmix.placing imports `kmix.optimizers.wrap.warn_if_unscaled`)."""

from kmix.optimizers.wrap import warn_if_unscaled  # noqa: F401
