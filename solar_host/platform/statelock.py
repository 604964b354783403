"""One host per state directory: an exclusive lock beside CONFIG_FILE (and in LOG_DIR).

Two hosts on one `config.json` would each re-adopt, restart and sweep the same backends, and
their saves would overwrite each other. The kernel's `flock` decides who owns a directory: the
lock dies with its process (a SIGKILLed host never leaves a stale lock behind), and the pid
written into the lock file lets the loser name the winner.

The lock file is the only file a host touches before it knows it is alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCK_NAME = ".solar-host.lock"


class StateLocked(Exception):
    """Another process holds the lock of a directory this host needs."""

    def __init__(self, directory: Path, holder: int | None):
        self.directory = directory
        self.holder = holder
        who = f"pid {holder}" if holder else "another process"
        super().__init__(
            f"{directory} is in use by another solar-host ({who} holds {directory / LOCK_NAME}); "
            "stop it first, or give this host its own CONFIG_FILE and LOG_DIR directories"
        )


def lock_path(directory: Path) -> Path:
    return directory / LOCK_NAME


def holder_pid(directory: Path) -> int | None:
    """The pid recorded by the current holder of `directory`'s lock, if readable."""
    try:
        text = lock_path(directory).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def is_locked(directory: Path) -> bool:
    """True when a live process holds `directory`'s lock (probed without keeping it)."""
    try:
        fd = os.open(lock_path(directory), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _try_lock(directory: Path) -> int:
    """An fd holding `directory`'s exclusive lock; raises StateLocked when it is taken."""
    # 0750 as the host keeps its directories (LOG_DIR is first made here): one made 0755
    # would be tightened, with a warning, at the host's first start.
    directory.mkdir(parents=True, exist_ok=True, mode=0o750)
    fd = os.open(lock_path(directory), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateLocked(directory, holder_pid(directory)) from None
    except BaseException:
        os.close(fd)
        raise
    # Ours now: record who we are for the next one who asks (and for `solar-host handover`).
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@dataclass
class StateLock:
    """The locks of one host's directories, taken together and released together."""

    directories: list[Path]
    _fds: list[int] = field(default_factory=list)

    @classmethod
    def for_dirs(cls, *dirs: Path) -> StateLock:
        unique: list[Path] = []
        for d in dirs:
            resolved = Path(os.path.abspath(d))
            with contextlib.suppress(OSError):
                resolved = resolved.resolve()
            if resolved not in unique:
                unique.append(resolved)
        return cls(unique)

    @classmethod
    def for_host(cls, settings: Any) -> StateLock:
        """The directories one host owns: CONFIG_FILE's (and, when it is a link, its target's),
        LOG_DIR and JOBS_DIR (its store and workspaces are as much the host's)."""
        config = settings.config_file
        return cls.for_dirs(
            config.parent,
            Path(os.path.realpath(config)).parent,
            settings.log_dir,
            settings.jobs_dir,
        )

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def acquire(self) -> None:
        """Take every lock, or none (raises StateLocked or OSError)."""
        if self._fds:
            return
        fds: list[int] = []
        try:
            for d in self.directories:
                fds.append(_try_lock(d))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._fds = fds

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the last fd of the open file drops the flock
