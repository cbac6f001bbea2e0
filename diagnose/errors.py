"""diagnose's error type, in a module with no dependencies (the CLI imports it at start-up)."""


class RunError(ValueError):
    """A run bundle (or config file) is missing, corrupt or of an unknown schema version."""
