"""The one error type users see: a single line that names the key and the fix, then exit 2."""


class UserError(Exception):
    """Bad input (recipe, flag, path, environment). The CLI prints it as one line, no traceback."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # Messages quote user input, which may hold newlines or control characters: keep one line.
        super().__init__("".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message))
