"""Model architectures the engine runs."""


class StepInterrupted(Exception):
    """A forward pass stopped between layers because its caller asked it to."""
