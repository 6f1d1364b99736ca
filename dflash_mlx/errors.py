class DFlashError(Exception):
    """A user-facing error: its message names the problem and the fix."""


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception as one short line, for messages that quote it."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
