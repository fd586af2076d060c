"""One policy for every path a command reads or writes (docs/reference/errors.md).

Outputs are checked before any work starts, so a mistyped `--out` fails in a second and not after an
hour of merging: an output must not be a file where a directory goes (or the reverse), must not sit
under a file, must be writable, and a non-empty directory is reused only when the command can tell it
made it (`reuse` says why not otherwise). Every artefact is written to a temp name beside its target
and renamed into place, so a reader sees the old file or the new one and an interrupted command
leaves at most a hidden `*.partial` temp, never a truncated artefact. Inputs are read through
`read_text`/`read_json`/`read_yaml`, which turn undecodable or malformed files into one-line errors
naming the file. Nothing here imports torch: preflight and render use it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from engine.errors import OutputError, UserError

PARTIAL = ".partial"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists() or parent.is_symlink():
            return parent
    return Path("/")


def _writable(directory: Path) -> bool:
    """Probe by creating a file: os.access says yes to root on a read-only mount or a sysfs."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", suffix=PARTIAL, dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _check_location(path: Path, flag: str, want: str) -> Path:
    path = Path(path).expanduser().absolute()
    existing = _nearest_existing(path)
    if existing != path and not existing.is_dir():
        raise OutputError(f"{flag} {path}: {existing} is a file, so nothing can be created under it; "
                          "pass a path in a directory")  # fmt: skip
    if existing == path:
        is_dir = path.is_dir()
        if want == "dir" and not is_dir:
            raise OutputError(f"{flag} {path} exists and is not a directory; pass a directory path")
        if want == "file" and is_dir:
            raise OutputError(f"{flag} {path} is a directory; pass a file path")
    directory = existing if existing != path or want == "dir" else path.parent
    if not _writable(directory):
        raise OutputError(f"{flag} {path}: {directory} is read-only for this user; pass a writable path")
    return path


def check_out_file(
    path: Path | str, flag: str = "--out", *, reuse: Callable[[Path], str | None] | None = None
) -> Path:
    """The absolute path of a file the command will (re)write, or OutputError saying why not.

    An existing file is replaced only when `reuse(path)` returns None (it is this command's own kind
    of file); without `reuse` an existing file is refused.
    """
    path = _check_location(Path(path), flag, "file")
    if path.exists():
        reason = "it exists and this command does not replace files" if reuse is None else reuse(path)
        if reason:
            raise OutputError(f"{flag} {path}: {reason}; pass a new path or move that file away")
    return path


def check_out_dir(
    path: Path | str, flag: str = "--out", *, reuse: Callable[[Path], str | None] | None = None
) -> Path:
    """The absolute path of a directory the command will create or fill, or OutputError saying why not.

    A non-empty directory is reused only when `reuse(path)` returns None, i.e. it holds this
    command's own earlier output and nothing the command would replace without having made it.
    """
    path = _check_location(Path(path), flag, "dir")
    if path.is_dir() and any(path.iterdir()):
        reason = "it is not empty" if reuse is None else reuse(path)
        if reason:
            raise OutputError(f"{flag} {path}: {reason}; pass a new or empty directory")
    return path


def foreign_files(directory: Path, ours: Sequence[str], marker: str) -> str | None:
    """`reuse` policy for commands that write named files into a directory others may share.

    Unrelated files are fine (they are left alone). Files this command would overwrite are fine only
    when `marker` (the completion record written last) is present: otherwise they were not written by
    a finished run of this command (a partial or foreign copy).
    """
    clash = sorted(name for name in ours if (directory / name).exists())
    if clash and not (directory / marker).is_file():
        return f"holds {', '.join(clash)} but no {marker}: partially written or not made by this command"
    return None


def _temp_beside(path: Path, directory: bool) -> Path:
    prefix, parent = f".{path.name}.", path.parent
    if directory:
        return Path(tempfile.mkdtemp(prefix=prefix, suffix=PARTIAL, dir=parent))
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=PARTIAL, dir=parent)
    os.close(fd)
    return Path(name)


@contextlib.contextmanager
def atomic_path(path: Path | str, mode: int = 0o666) -> Iterator[Path]:
    """Yield a temp path beside `path` for a writer that wants a file name (parquet, tar); rename it
    over `path` when the block succeeds, remove it otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(path, directory=False)
    try:
        yield tmp
        tmp.chmod(mode & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Path | str, data: str | bytes, mode: int = 0o666) -> Path:
    """Write `data` to a temp file beside `path`, flush it to disk, and rename it over `path`."""
    with atomic_path(path, mode) as tmp, tmp.open("wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())
    return Path(path)


@contextlib.contextmanager
def publish_dir(out: Path | str, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh temp directory beside `out`; rename it to `out` only when the block succeeds.

    `out` must be absent or empty, unless `replace` (the caller checked it owns what is there): the
    old directory is then swapped out and removed after the new one is in place.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(out, directory=True)
    try:
        yield tmp
        tmp.chmod(0o777 & ~_UMASK)
        old = None
        if out.is_dir() and replace and any(out.iterdir()):
            old = _temp_beside(out, directory=True)
            os.replace(out, old)
        elif out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        try:
            os.rename(tmp, out)
        except OSError as err:
            if old is not None:
                os.replace(old, out)
            raise OutputError(f"{out} appeared while it was being written ({err.strerror}); retry") from err
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive(lock_file: Path, what: str, fix: str) -> Iterator[None]:
    """Hold `lock_file` (flock) for the block, or OutputError naming the holder. The kernel drops the
    lock when its holder dies, however it dies: no stale lock to clean up after a SIGKILL or a lost node.
    Where the filesystem has no flock (some Lustre mounts), a warning says the guard is off."""
    with open(lock_file, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise OutputError(f"{what}: in use by {holder}; {fix}") from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            sys.stderr.write(f"warning: {what}: no file lock here ({err.strerror}): not guarded\n")
            locked = False
        if locked:  # who holds it, for the next one's message: a full disk costs only the note
            with contextlib.suppress(OSError):
                handle.truncate(0)
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n")
                handle.flush()
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def stage_in(out: Path | str, prefix: str = ".staged.") -> Path:
    """A fresh hidden temp directory inside `out` (created if missing), published later by `move_into`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, suffix=PARTIAL, dir=out))


def move_into(stage: Path, out: Path, last: Sequence[str] = (), missing_only: bool = False) -> list[str]:
    """Rename every file of `stage` into `out` (`last` ones last), then remove `stage`; returns the names.

    Only the names the stage holds are replaced: anything else in `out` stays as it was. With
    `missing_only`, a name `out` already has is not replaced but left in `stage`, which then stays.
    """
    names = sorted((p.name for p in stage.iterdir()), key=lambda name: (name in last, name))
    moved = [name for name in names if not (missing_only and (out / name).exists())]
    for name in moved:
        os.replace(stage / name, out / name)
    if len(moved) == len(names):
        stage.rmdir()
    return moved


@contextlib.contextmanager
def staged(out: Path | str, last: Sequence[str] = ()) -> Iterator[Path]:
    """Yield a hidden temp directory inside `out`; on success move its files into `out` (`last` last).

    For outputs that are files in a shared directory: a failure leaves `out` as it was (and removes
    `out` again when this call created it).
    """
    out = Path(out)
    created = not out.exists()
    stage = stage_in(out)
    try:
        yield stage
        move_into(stage, out, last)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def read_text(path: Path | str, what: str, fix: str) -> str:
    """A UTF-8 text input, or UserError naming it (missing, a directory, unreadable, not UTF-8)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} {path}: no such file; {fix}") from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a directory, not a file; {fix}") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {path}: not UTF-8 text (byte {err.start}); {fix}") from None
    except OSError as err:
        raise UserError(f"{what} {path}: cannot read ({err.strerror}); {fix}") from None


def read_json(path: Path | str, what: str, fix: str, expect: type = dict) -> Any:
    """A JSON input of the expected top-level type, or UserError naming the file and line."""
    text = read_text(path, what, fix)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{what} {path}: not valid JSON ({err.msg} at line {err.lineno}); {fix}") from None
    if not isinstance(data, expect):
        raise UserError(f"{what} {path}: a JSON {expect.__name__} was expected, got "
                        f"{type(data).__name__}; {fix}")  # fmt: skip
    return data


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML where a repeated key is an error: PyYAML silently keeps the last value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` entries may be overridden
                continue
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark
                )
            if isinstance(key, (str, int, float, bool)):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_problem(err: yaml.YAMLError) -> str:
    """`line N: problem` of a YAML error, one line."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark else ""
    return where + (getattr(err, "problem", None) or "malformed YAML")


def read_yaml(path: Path | str, what: str, fix: str, loader: type = UniqueKeyLoader) -> Any:
    """A YAML input (repeated keys refused), or UserError naming the file and line."""
    text = read_text(path, what, fix)
    try:
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as err:
        raise UserError(f"{what} {path}: not valid YAML ({yaml_problem(err)}); {fix}") from None
