"""kmix.layers (filled in by its issue)."""
