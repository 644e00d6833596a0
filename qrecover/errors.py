"""The one exception type users see: a message that names the bad value and the fix."""


class QRecoverError(Exception):
    """Bad input or a refused operation. The CLI prints the message (no traceback) and exits 2."""
