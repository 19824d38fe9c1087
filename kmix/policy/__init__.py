"""Precision policies: `kmix.Policy`, `set_policy` / `policy_scope`, `memory_report`."""

from kmix.policy.memory import MemoryReport, memory_report
from kmix.policy.policy import Policy
from kmix.policy.scope import active_policy, policy_scope, set_policy

__all__ = [
    "MemoryReport",
    "Policy",
    "active_policy",
    "memory_report",
    "policy_scope",
    "set_policy",
]
