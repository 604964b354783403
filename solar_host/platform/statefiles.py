"""Durable state files (config.json, the jobs store, the reservation store, api_key).

Three rules every state file follows:

- Writes are atomic and fsynced (temp file, fsync, rename, fsync of the directory): a host
  killed in the middle of a write leaves the previous file whole. A state file that is a
  symlink is written through it: the file it links to is replaced, and stays linked.
- Every write keeps the version it replaces as `<file>.prev`, the last good copy. The file being
  replaced is always one this host read and parsed, or wrote itself, so the copy is good. It is a
  hard link to the old inode (files are only ever replaced, never written in place): no copy.
  The host only ever makes a last good copy as a regular file, so one that is a symlink was put
  there from outside: it is replaced, never written or chmod-ed through (it may point anywhere).
- A file that cannot be read or parsed is refused, never replaced: `StateFileError` names the
  file, the error and the last good copy, and the host stops before anything writes.
  `solar-host restore-state` puts the last good copies back (see restore.py).

`GroupCommit` makes many concurrent changes cost one write: each caller waits for the first
write that starts after its change, and that write covers every change made until it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solar_host.platform.envfile import api_key_problem

log = logging.getLogger(__name__)

PRIVATE = 0o600


class StateFileError(RuntimeError):
    """A state file cannot be read or parsed; the host must not start on it."""

    def __init__(self, path: Path, error: str):
        self.path = path
        self.error = error
        super().__init__(describe_damage(path, error))


def real_file(path: Path) -> Path:
    """The file a write of `path` replaces: the target when `path` is a symlink (an operator's
    CONFIG_FILE linked to a persistent disk), so that a write goes through the link and it
    stays a link; `path` itself otherwise. Resolved at each use: the link may be changed."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


def last_good_path(path: Path) -> Path:
    """Where the version before the last write of `path` is kept: beside the file it links to,
    when it is a symlink (where the write renames the new version)."""
    target = real_file(path)
    return target.with_name(target.name + ".prev")


def describe_damage(path: Path, error: str) -> str:
    """One line: the file, what is wrong, and where the last good copy is."""
    prev = last_good_path(path)
    if prev.is_file():
        where = f"last good copy: {prev} (start from it: solar-host restore-state)"
    else:
        where = "no last good copy exists"
    return f"cannot use state file {path}: {error}; nothing was changed; {where}"


def _kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def read_regular(path: Path) -> bytes:
    """The bytes of the regular file `path` (a symlink is followed). What is not a regular
    file is refused without reading it (StateFileError): a FIFO in a state file's place would
    block the start for good, a link to /dev/zero would read until memory runs out. Opened
    non-blocking, so even the open of a FIFO with no writer returns. OSError as `open` gives
    it (FileNotFoundError for a missing file or a dangling link)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise StateFileError(path, f"it is a {_kind_of(mode)}, not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def read_state_bytes(path: Path) -> bytes | None:
    """The file's bytes; None when it does not exist (a first start). Refuses what is there but
    cannot be read (a directory or a FIFO in its place, no permission, an I/O error), and a
    file that is missing while its last good copy exists: writes only ever replace the file, so
    it was removed from outside, and starting empty would lose what it held."""
    try:
        return read_regular(path)
    except FileNotFoundError:
        if last_good_path(path).is_file():
            raise StateFileError(
                path, "the file is missing but its last good copy exists"
            ) from None
        return None
    except OSError as err:
        raise StateFileError(path, err.strerror or str(err)) from None


def decode_text(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise StateFileError(path, f"not UTF-8 text (byte {err.start})") from None


def parse_json(path: Path, raw: bytes) -> Any:
    """The JSON document in a state file's bytes; StateFileError when there is none (bad UTF-8,
    bad JSON, or nesting deeper than the parser's recursion: that too is damage, not a crash)."""
    text = decode_text(path, raw)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise StateFileError(path, f"not valid JSON ({reason})") from None


def sweep_temp_files(path: Path) -> None:
    """Temp files of writes that were killed midway: the real file is whole, drop them."""
    path = real_file(path)  # the temp files are made beside the file a link points to
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()


PREV_SUFFIX = ".prev"


def tighten_mode(path: Path, mode: int = PRIVATE) -> None:
    """Clear permission bits beyond `mode` on an existing file or directory (logged).

    A state file that is a symlink is tightened where it points (an operator's CONFIG_FILE
    linked to a persistent disk). A last good copy (`<file>.prev`) is never followed: the host
    makes it only as a regular file, and a link there could make a root host chmod any file of
    the machine (`config.json.prev -> /etc/passwd`) at every start."""
    follow = not path.name.endswith(PREV_SUFFIX)
    try:
        st = os.stat(path, follow_symlinks=follow)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        log.warning("%s is a symbolic link, not a last good copy the host wrote; left alone", path)
        return
    current = stat.S_IMODE(st.st_mode)
    if current & ~mode:
        try:
            os.chmod(path, current & mode)
        except OSError as err:
            log.warning("cannot tighten the mode of %s (%o): %s", path, current, err)
            return
        log.warning("tightened the mode of %s from %04o to %04o", path, current, current & mode)


def private_dir(path: Path, mode: int = 0o750) -> None:
    """Create `path` (and parents) with `mode`; an existing one is tightened to it."""
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    tighten_mode(path, mode)


def _fsync_dir(directory: Path) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def atomic_write_bytes(
    path: Path,
    data: bytes,
    mode: int = 0o644,
    *,
    keep_previous: bool = False,
    follow_link: bool = True,
) -> None:
    """Write `data` to `path` so that readers see the old or the new file, never a mix.

    With `keep_previous`, the file being replaced becomes `<path>.prev` first. A symlink is
    written through: the temp file, the rename and `.prev` are in its target's directory
    (renaming over the link itself would replace it with a regular file). With
    `follow_link=False` (a last good copy) a symlink at `path` is replaced, not written through.
    """
    if follow_link:
        path = real_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous:
            _link_previous(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _link_previous(path: Path) -> None:
    """`<path>.prev` becomes the current `path` (same inode), atomically."""
    prev = last_good_path(path)
    link_tmp = path.with_name(f".{prev.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link_tmp)
    try:
        os.link(path, link_tmp)
    except FileNotFoundError:
        return  # nothing to keep: the first write
    except OSError as err:
        # A filesystem without hard links (or an immutable file): copy instead (the previous
        # write's bytes). Into `prev` itself: a symlink there is replaced, not written through.
        if err.errno not in (1, 18, 38, 95):  # EPERM, EXDEV, ENOSYS, EOPNOTSUPP
            raise
        try:
            with contextlib.suppress(FileNotFoundError):
                atomic_write_bytes(
                    prev,
                    path.read_bytes(),
                    stat.S_IMODE(path.stat().st_mode),
                    follow_link=False,
                )
        except OSError as copy_err:
            raise _prev_error(copy_err, prev) from copy_err
        return
    try:
        os.replace(link_tmp, prev)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(link_tmp)
        raise _prev_error(err, prev) from err


def _prev_error(err: OSError, prev: Path) -> OSError:
    """The error of a write that could not keep its last good copy, naming the copy: what is
    in its way (a directory, an immutable file) is not the state file the caller names."""
    what = err.strerror or str(err)
    return OSError(
        err.errno,
        f"{what}: cannot keep the last good copy at {prev} (remove what is in its place)",
    )


class GroupCommit:
    """One writer for one file; concurrent changes share writes.

    `encode()` runs on the event loop (the state it reads belongs to the loop) at the start of
    each write, so a write covers every change made before it started; `write(bytes)` runs in a
    worker thread. A caller of `commit()` returns once a write that started after its call has
    finished, and gets that write's error (so it can undo its change).
    """

    def __init__(self, encode: Callable[[], bytes | None], write: Callable[[bytes], None]):
        self._encode = encode
        self._write = write
        self._waiting: list[asyncio.Future[None]] = []
        self._writer: asyncio.Task[None] | None = None
        self.writes = 0

    async def commit(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._run(), name="state-file-writer")
        # Shielded: a caller that goes away (a client disconnect) does not cancel the write.
        await asyncio.shield(fut)

    async def _run(self) -> None:
        while self._waiting:
            covered, self._waiting = self._waiting, []
            error: BaseException | None = None
            try:
                data = self._encode()
                if data is not None:
                    await asyncio.to_thread(self._write, data)
                    self.writes += 1
            except Exception as err:  # handed to every caller this write covered
                error = err
            for fut in covered:
                if fut.done():
                    continue
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)
        self._writer = None

    async def drain(self) -> None:
        """Wait until no write is running or queued."""
        while self._writer is not None and not self._writer.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._writer)


# --- api_key ---------------------------------------------------------------------------------


def parse_api_key(path: Path, raw: bytes) -> str:
    key = decode_text(path, raw).strip()
    if not key:
        raise StateFileError(path, "the file is empty (no API key in it)")
    problem = api_key_problem(key)
    if problem is not None:
        raise StateFileError(path, f"the key {problem}")
    return key


def _copy_key(prev: Path) -> str | None:
    """The key held by the last good copy; None when there is none, it does not parse, or it is
    a symlink (the host never makes one: what it points to is no copy of the key)."""
    if os.path.islink(prev):
        return None
    try:
        return parse_api_key(prev, read_regular(prev))
    except (OSError, StateFileError):
        return None


def check_api_key(path: Path, raw: bytes) -> str:
    """The key in `raw` (the bytes of `path`), refused when it is not the key its last good
    copy holds. The file is written once, with the copy: a key that differs from the copy's
    was cut short or edited, and taking it would lock out every client holding the real key
    (and restart every backend on it). An operator changing the key deletes the copy with the
    edit, or sets API_KEY (README, State files)."""
    key = parse_api_key(path, raw)
    prev = last_good_path(path)
    good = _copy_key(prev)
    if good is not None and good != key:
        raise StateFileError(
            path,
            f"the key ({len(key)} characters) is not the one its last good copy holds "
            f"({len(good)} characters): cut short, or edited (to change the key, delete "
            f"{prev.name} with the edit, or set API_KEY)",
        )
    return key


def read_api_key(path: Path) -> str | None:
    """The stored key; None when no file exists. Refuses an empty or unreadable file and one
    whose key is not its last good copy's (check_api_key). `<file>.prev`, the copy, is made
    when there is none (a file from before copies, or one an operator rotated by deleting the
    copy); an existing copy is never replaced from the file."""
    raw = read_state_bytes(path)
    if raw is None:
        return None
    key = check_api_key(path, raw)
    tighten_mode(path)
    prev = last_good_path(path)
    if os.path.lexists(prev):
        tighten_mode(prev)
        if _copy_key(prev) is None:
            # Left as it is: what it held cannot be told from here, and the key file is the
            # one that passed. `restore-state` would find no copy to start from.
            log.warning("the last good copy %s of the API key cannot be used; left unchanged", prev)
        return key
    with contextlib.suppress(OSError):
        atomic_write_bytes(prev, raw, PRIVATE, follow_link=False)
    return key


def store_api_key(path: Path, key: str) -> None:
    data = (key + "\n").encode()
    atomic_write_bytes(path, data, PRIVATE)
    with contextlib.suppress(OSError):
        # Never through a symlink at the copy: a dangling `api_key.prev -> /elsewhere/x` had
        # the generated key written to /elsewhere/x.
        atomic_write_bytes(last_good_path(path), data, PRIVATE, follow_link=False)
