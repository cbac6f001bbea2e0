"""diagnose's error type, in a module with no dependencies (the CLI imports it at start-up)."""


class RunError(ValueError):
    """A run bundle (or config file) is missing, corrupt or of an unknown schema version."""


def runs_arg_error(runs: list[str], follow: bool) -> str | None:
    """What is wrong with a command line's RUN arguments (``diagnose``, ``tui``), or None."""
    if len(runs) > 2:
        return "give one run, or a baseline and a candidate"
    if follow and len(runs) != 1:
        return "--follow takes one run"
    return None
