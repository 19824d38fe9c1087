"""kmix.callbacks (filled in by its issue)."""
