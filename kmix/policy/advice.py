"""Transitional: the placement records now live on the variables (`kmix._state`)."""

from kmix._state import record_model, restore_records as restore, snapshot  # noqa: F401
