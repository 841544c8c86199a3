"""Model architectures the engine runs."""
