class DFlashError(Exception):
    """A user-facing error: its message names the problem and the fix."""
