"""`kmix.autocast`: the user's model placed by precision, in place: facts, plan, place, twin, settle, repair, check."""

from kmix.placing.autocast import AutocastTable, Placement, autocast

__all__ = ["AutocastTable", "Placement", "autocast"]
