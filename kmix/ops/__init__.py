"""kmix.ops (filled in by its issue)."""
