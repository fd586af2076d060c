"""The one error type users see: a single line that names the key and the fix, then exit 2."""


class UserError(Exception):
    """Bad input (recipe, flag, path, environment). The CLI prints it as one line, no traceback."""

    exit_code = 2
