"""Expected failures and the one boundary every entry point goes through (docs/reference/errors.md).

An expected failure is one line, `error: ...`, naming the input and the fix, and a documented exit
code; an unexpected exception still shows its traceback, because that is a bug to report.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

# Exit codes of every command (docs/reference/errors.md is the table users read).
OK = 0
FAILED = 1  # the command ran and its result failed its check (drift, mismatch, a run that did not train)
BAD_INPUT = 2  # arguments, recipe, input files or environment refused before anything was written
OUTPUT_REFUSED = 3  # the output path is unusable or holds something this command will not replace
TIMED_OUT = 4  # an external thing the command waits on (Ray, a subprocess) did not answer in time
INTERRUPTED = 130


class UserError(Exception):
    """Bad input (recipe, flag, path, environment). The CLI prints it as one line, no traceback."""

    exit_code = BAD_INPUT

    def __init__(self, message: str) -> None:
        # Messages quote user input, which may hold newlines or control characters: keep one line.
        super().__init__("".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message))


class OutputError(UserError):
    """An output path the command refuses to write (nothing was written)."""

    exit_code = OUTPUT_REFUSED


class WaitTimeout(UserError):
    """Something outside the command did not answer within its timeout."""

    exit_code = TIMED_OUT


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors, so they print as the same one line as every other."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message}; see {self.prog} --help")


def _os_message(err: OSError) -> str:
    where = f"{err.filename}: " if err.filename else ""
    reason = err.strerror or err.__class__.__name__
    return f"{where}{reason}; check that path, its permissions and the free space"


def boundary(main: Callable[[list[str]], int], argv: Sequence[str]) -> int:
    """Run one command: expected failures become `error: ...` and their exit code."""
    try:
        return main(list(argv))
    except UserError as err:
        message, code = str(err), err.exit_code
    except KeyboardInterrupt:
        message, code = "interrupted", INTERRUPTED
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more on stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except subprocess.TimeoutExpired as err:
        message, code = (
            f"{err.cmd[0] if err.cmd else 'a subprocess'} timed out after {err.timeout} s",
            TIMED_OUT,
        )
    except subprocess.CalledProcessError as err:
        cmd = err.cmd if isinstance(err.cmd, str) else " ".join(map(str, err.cmd[:3]))
        message, code = f"`{cmd} ...` exited {err.returncode}; its output above says why", FAILED
    except OSError as err:  # the machine refused a file operation: not a bug of this program
        message, code = _os_message(err), BAD_INPUT
    print(f"error: {UserError(message)}", file=sys.stderr)
    return code


def entry(main: Callable[[list[str]], int]) -> NoReturn:
    """`if __name__ == "__main__": entry(main)` for every `python -m` module."""
    sys.exit(boundary(main, sys.argv[1:]))
