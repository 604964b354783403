"""Backends read only what they need: the model roots, their runtime and the system's shared
files, enforced by the kernel (Landlock, Linux 5.13 and later).

The roots check (model_store/roots.py) judges every path a config names when it is created and
again at start, but a backend opens its files later: a symlink re-pointed in between (by a job
that can write a model root or the HF cache) was followed. Landlock closes that window. The
host builds a ruleset naming the trees a backend may read, and the backend is started through
landlock_exec.py, which applies it and execs the backend; it then holds for the backend and
everything it starts, at every open. Writing is not restricted (caches, temporary files), and
a path the ruleset does not name is EACCES, whatever link leads there.

BACKEND_READ_CONFINEMENT: `auto` (the default) confines where the kernel supports it and says
once in the log where it does not; `required` refuses to start a backend unconfined; `off`
turns it off. BACKEND_READ_PATHS adds trees an unusual installation needs (a CUDA toolkit in
a home directory, say).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# <linux/landlock.h>, x86-64 and arm64 syscall numbers (the same on both).
_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
ACCESS_READ_FILE = 1 << 2
ACCESS_READ_DIR = 1 << 3
# Moving or hard-linking a file into another directory (ABI 2+). A ruleset that does not
# handle it makes every such move fail with EXDEV, which breaks caches that write a file in a
# temporary directory and rename it into place (triton's, for one). Handled and granted on the
# allowed trees, moves between them work, and a move out of a tree the backend may not read
# into one it may is still refused.
ACCESS_REFER = 1 << 13
READ_ONLY = ACCESS_READ_FILE | ACCESS_READ_DIR


def handled_access(abi: int) -> int:
    """What a ruleset for this ABI restricts (and grants on the allowed trees)."""
    return READ_ONLY | (ACCESS_REFER if abi >= 2 else 0)


# What any backend may read of the system: its libraries, devices, kernel interfaces.
SYSTEM_TREES = (
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/bin",
    "/sbin",
    "/opt",
    "/proc",
    "/sys",
    "/dev",
    "/var/tmp",
    "/run/nvidia-persistenced",
    "/run/systemd/resolve",
)
# Of /etc, what runtimes read (the dynamic linker, names, time, TLS roots, GPU vendor files);
# never shadow files, SSH keys, TLS private keys, or the host's own env file.
ETC_ENTRIES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "ld.so.preload",
    "alternatives",
    "localtime",
    "timezone",
    "passwd",
    "group",
    "nsswitch.conf",
    "hosts",
    "host.conf",
    "resolv.conf",
    "gai.conf",
    "services",
    "protocols",
    "ssl/certs",
    "ssl/openssl.cnf",
    "ca-certificates",
    "ca-certificates.conf",
    "pki/tls/certs",
    "pki/ca-trust",
    "crypto-policies",
    "mime.types",
    "locale.alias",
    "locale.conf",
    "os-release",
    "lsb-release",
    "debian_version",
    "machine-id",
    "hostname",
    "vulkan",
    "OpenCL",
    "nvidia",
    "glvnd",
    "nccl.conf",
    "fonts",
)
# Under the backend's HOME: the caches the runtimes keep (HF, torch, triton, CUDA's JIT).
HOME_TREES = (
    ".cache",
    ".triton",
    ".nv",
    ".deep_gemm",
    ".local/lib",
    ".local/share/vulkan",
    ".config/vulkan",
)


class ConfinementUnavailable(RuntimeError):
    """BACKEND_READ_CONFINEMENT=required and the kernel cannot confine."""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def abi_version() -> int:
    """Landlock's ABI version on this kernel, 0 where there is none (too old, or disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        version = _libc().syscall(
            _SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)
        )
    except (OSError, AttributeError):
        return 0
    return max(int(version), 0)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # packed in the kernel's header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@dataclass(frozen=True, slots=True)
class ReadPolicy:
    """The trees and single files a backend may read; everything else is refused."""

    trees: tuple[str, ...]
    files: tuple[str, ...]


def read_policy(
    *,
    roots: Sequence[Path],
    argv: Sequence[str],
    env: Mapping[str, str],
    private_files: Iterable[str] = (),
    extra: Iterable[str] = (),
) -> ReadPolicy:
    """What a backend started as `argv` with environment `env` needs to read."""
    from solar_host.model_store.roots import hub_caches

    trees: list[str] = list(SYSTEM_TREES)
    trees += [os.path.join("/etc", e) for e in ETC_ENTRIES]
    home = env.get("HOME") or os.path.expanduser("~")
    trees += [os.path.join(home, t) for t in HOME_TREES]
    trees += [str(c) for c in hub_caches(env)]
    if env.get("HF_HOME"):
        trees.append(env["HF_HOME"])
    trees.append(env.get("TMPDIR") or "/tmp")
    # The Python the host runs (our HF server and the test backends are this interpreter),
    # and where solar_host itself is installed (site-packages, or a source checkout).
    trees += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    trees.append(str(Path(__file__).resolve().parents[2]))
    # Its import path, which .pth files and --system-site-packages extend, less its first
    # entry: the host's working directory or script directory, nothing a backend imports.
    trees += [p for p in sys.path[1:] if p]
    for name in ("PYTHONPATH", "LD_LIBRARY_PATH"):
        trees += [p for p in env.get(name, "").split(os.pathsep) if p]
    trees += _program_trees(argv[0], env, home) if argv else []
    trees += list(extra)
    # "/" would allow everything (an empty PYTHONPATH entry, a program in the root): the
    # operator who wants that says so, with BACKEND_READ_CONFINEMENT=off or a model root.
    kept = [os.path.abspath(r) for r in roots]
    kept += [t for t in map(os.path.abspath, trees) if t != "/"]
    return ReadPolicy(tuple(dict.fromkeys(kept)), tuple(dict.fromkeys(private_files)))


def _program_trees(program: str, env: Mapping[str, str], home: str) -> list[str]:
    """The backend program's own directory (for a build tree, the `build` above `build/bin`,
    where its shared libraries are), as given and after links."""
    import shutil

    found = shutil.which(program, path=env.get("PATH")) if os.sep not in program else program
    if not found:
        return []
    out = []
    for path in dict.fromkeys((os.path.abspath(found), os.path.realpath(found))):
        parent = os.path.dirname(path)
        above = os.path.dirname(parent)
        wide = os.path.basename(parent) == "bin" and above not in ("/", home)
        out.append(above if wide else parent)
    return out


class Ruleset:
    """A Landlock ruleset built in the host; `restrict` applies it in a forked child."""

    def __init__(self, fd: int, skipped: list[str]):
        self.fd = fd
        self.skipped = skipped  # allowed paths that did not exist

    @classmethod
    def build(cls, policy: ReadPolicy) -> Ruleset:
        """Raise OSError where the kernel refuses (no Landlock)."""
        libc = _libc()
        handled = handled_access(abi_version())
        attr = _RulesetAttr(handled)
        fd = libc.syscall(
            _SYS_CREATE_RULESET,
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
            ctypes.c_uint32(0),
        )
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
        skipped: list[str] = []
        try:
            for path, access in [(p, handled) for p in policy.trees] + [
                (p, ACCESS_READ_FILE) for p in policy.files
            ]:
                if not cls._add(libc, fd, path, access):
                    skipped.append(path)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, skipped)

    @staticmethod
    def _add(libc: ctypes.CDLL, ruleset: int, path: str, access: int) -> bool:
        try:
            target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return False  # absent here (no /lib32, no ~/.triton): nothing to allow
        try:
            if not stat.S_ISDIR(os.fstat(target).st_mode):
                access &= ACCESS_READ_FILE  # a file takes file rights only
            rule = _PathBeneathAttr(access, target)
            if (
                libc.syscall(
                    _SYS_ADD_RULE,
                    ruleset,
                    _RULE_PATH_BENEATH,
                    ctypes.byref(rule),
                    ctypes.c_uint32(0),
                )
                < 0
            ):
                err = ctypes.get_errno()
                raise OSError(err, f"landlock_add_rule {path}: {os.strerror(err)}")
        finally:
            os.close(target)
        return True

    def close(self) -> None:
        os.close(self.fd)


def confined_command(argv: Sequence[str], env: Mapping[str, str], ruleset: Ruleset) -> list[str]:
    """The command that runs `argv` under `ruleset` (landlock_exec.py, by path). The program
    is looked up here, on the backend's PATH, so a missing one fails the spawn as it would
    unconfined (FileNotFoundError), not later as an exit code."""
    import shutil

    program = argv[0]
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    launcher = str(Path(__file__).with_name("landlock_exec.py"))
    lc_ctype = env.get("LC_CTYPE")
    lc_arg = "" if lc_ctype is None else f"={lc_ctype}"
    return [sys.executable, "-I", "-S", launcher, str(ruleset.fd), lc_arg, found, *argv]


@functools.cache
def _say_unavailable_once() -> None:
    log.warning(
        "backends run without read confinement: this kernel has no Landlock of ABI 2 or later "
        "(Linux 5.19+ with landlock among its LSMs); the model-roots check at start still "
        "applies"
    )


def ruleset_for(mode: str, policy: ReadPolicy) -> Ruleset | None:
    """The ruleset to spawn a backend under, or None to spawn it unconfined (`off`, or `auto`
    on a kernel without Landlock). Raises ConfinementUnavailable for `required`."""
    if mode == "off":
        return None
    abi = abi_version()
    if abi < 1:
        if mode == "required":
            raise ConfinementUnavailable(
                "BACKEND_READ_CONFINEMENT=required, but this kernel has no Landlock"
            )
        _say_unavailable_once()
        return None
    if abi < 2 and mode == "auto":
        # Landlock's first version refuses every move of a file into another directory,
        # which breaks caches that rename into place: only `required` confines there.
        _say_unavailable_once()
        return None
    try:
        return Ruleset.build(policy)
    except OSError as err:
        if mode == "required":
            raise ConfinementUnavailable(f"cannot confine the backend: {err}") from None
        log.warning("backend starts without read confinement: %s", err)
        return None
