"""`kmix.autocast`: the user's own model placed by precision, in place (plan -> place -> check)."""

from kmix.placing.autocast import AutocastTable, Placement, autocast

__all__ = ["AutocastTable", "Placement", "autocast"]
