"""Model architectures the engine serves."""
