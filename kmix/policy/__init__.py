"""Precision policies: opt levels, `set_policy` / `policy_scope`, `autocast`, `memory_report`."""

from kmix.policy.autocast import AutocastTable, Placement, autocast
from kmix.policy.memory import MemoryReport, memory_report
from kmix.policy.placement import policy_map
from kmix.policy.policy import Policy
from kmix.policy.scope import active_policy, policy_scope, set_policy

__all__ = [
    "AutocastTable",
    "MemoryReport",
    "Placement",
    "Policy",
    "active_policy",
    "autocast",
    "memory_report",
    "policy_map",
    "policy_scope",
    "set_policy",
]
