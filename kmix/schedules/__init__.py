"""kmix.schedules (filled in by its issue)."""
