"""kmix.policy (filled in by its issue)."""
