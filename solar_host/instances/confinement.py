"""Backends read only what they need (the model roots, their runtime and the system's shared
files) and write only their caches, temporary files and devices, enforced by the kernel
(Landlock, Linux 5.13 and later).

The roots check (model_store/roots.py) judges every path a config names when it is created and
again at start, but a backend opens its files later: a symlink re-pointed in between (by a job
that can write a model root or the HF cache) was followed. Landlock closes that window. The
host builds a ruleset naming the trees a backend may read, and landlock_exec.py applies it to
the thread that spawns the backend; it then holds for the backend and everything it starts, at
every open. A path the ruleset does not name is EACCES, whatever link
leads there.

Writes are confined by the same ruleset (BACKEND_WRITE_CONFINEMENT, on by default): a backend
that a crafted model file or remote code takes over can still fill its caches, but cannot
change the host's state, its code, a model, another instance's prompt cache or the user's
files. Rights add up along a path, so a tree inside a writable one (a model root under /tmp)
is writable too.

BACKEND_READ_CONFINEMENT: `auto` (the default) confines where the kernel supports it and says
once in the log where it does not; `required` refuses to start a backend unconfined; `off`
turns it off (and with it the write confinement). BACKEND_READ_PATHS and BACKEND_WRITE_PATHS
add trees an unusual installation needs (a CUDA toolkit in a home directory, a cache elsewhere).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solar_host.backends.base import CACHE_VARS
from solar_host.instances import landlock_exec
from solar_host.platform.libc import libc as c_library

log = logging.getLogger(__name__)

# <linux/landlock.h>, x86-64 and arm64 syscall numbers (the same on both).
_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
ACCESS_WRITE_FILE = 1 << 1
ACCESS_READ_FILE = 1 << 2
ACCESS_READ_DIR = 1 << 3
# Changing a directory's entries: removing, and making files, directories, sockets, pipes and
# links (ABI 1). Device nodes (MAKE_CHAR 1<<6, MAKE_BLOCK 1<<11) are handled but never granted:
# a root backend could otherwise make a node for a disk in TMPDIR and write it raw.
ACCESS_MAKE_DEVICE = (1 << 6) | (1 << 11)
ACCESS_CHANGE_DIR = sum(1 << bit for bit in range(4, 13)) & ~ACCESS_MAKE_DEVICE
# Truncating a file (ABI 3+); without it handled, truncate(2) is allowed everywhere.
ACCESS_TRUNCATE = 1 << 14
# Moving or hard-linking a file into another directory (ABI 2+). A ruleset that does not
# handle it makes every such move fail with EXDEV, which breaks caches that write a file in a
# temporary directory and rename it into place (triton's, for one). Handled and granted on the
# allowed trees, moves between them work, and a move out of a tree the backend may not read
# into one it may is still refused.
ACCESS_REFER = 1 << 13
READ_ONLY = ACCESS_READ_FILE | ACCESS_READ_DIR
READ_RIGHTS = READ_ONLY | ACCESS_REFER
# The rights a rule on a single file (not a directory) may carry.
FILE_RIGHTS = ACCESS_READ_FILE | ACCESS_WRITE_FILE | ACCESS_TRUNCATE


def handled_access(abi: int, writes: bool = False) -> int:
    """What a ruleset for this ABI restricts (and grants on the writable trees): reads, and
    with `writes` every change to a file or directory too."""
    handled = READ_ONLY | (ACCESS_REFER if abi >= 2 else 0)
    if writes:
        handled |= ACCESS_WRITE_FILE | ACCESS_CHANGE_DIR | (ACCESS_TRUNCATE if abi >= 3 else 0)
        handled |= ACCESS_MAKE_DEVICE
    return handled


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
# Under the backend's HOME, to read: runtimes installed for the user, their vendor files.
HOME_TREES = (
    ".local/lib",
    ".local/share/vulkan",
    ".config/vulkan",
)
# What any backend may write (and read) of the system.
SYSTEM_WRITABLE = ("/var/tmp",)
# Of /dev, the devices runtimes open (read-write): shared memory, the null and random devices,
# terminals, GPUs (NVIDIA, DRM for Vulkan, AMD's kfd), RDMA for NCCL, huge pages. Never all of
# /dev: a backend of a host run as root would read and write every disk raw.
DEV_ENTRIES = (
    "shm",
    "null",
    "zero",
    "full",
    "random",
    "urandom",
    "tty",
    "ptmx",
    "pts",
    "mqueue",
    "hugepages",
    "dri",
    "kfd",
    "infiniband",
    "accel",
    "nvidia-caps",
    "nvidia-caps-imex-channels",
)
DEV_PREFIXES = ("nvidia",)  # nvidiactl, nvidia0..N, nvidia-uvm, nvidia-modeset, ...
# Under HOME, the caches the runtimes keep (HF, torch, triton, CUDA's JIT, DeepGEMM).
HOME_WRITABLE = (".cache", ".triton", ".nv", ".deep_gemm")


class ConfinementUnavailable(RuntimeError):
    """BACKEND_READ_CONFINEMENT=required and the kernel cannot confine."""


@functools.cache
def abi_version() -> int:
    """Landlock's ABI version on this kernel, 0 where there is none (too old, or disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        version = c_library().syscall(
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
class AccessPolicy:
    """The trees and single files a backend may read, and the trees it may also write;
    everything else is refused. With `confine_writes` False, writing is not restricted at all
    (and the writable trees are only read)."""

    trees: tuple[str, ...]
    files: tuple[str, ...]
    writable: tuple[str, ...] = ()
    confine_writes: bool = False
    # Single files it may write (none the host names today: a backend's log is a pipe to its
    # log relay, which `> /dev/stderr` reopens through /proc/self/fd without a rule).
    writable_files: tuple[str, ...] = ()
    # Trees a writable path may lead into through a link, besides the writable trees that lie
    # in no other (BACKEND_WRITE_PATHS, the operator's): see Ruleset.build.
    anchors: tuple[str, ...] = ()
    # Directories it may list but not read the files of: those above the host's own state
    # inside a tree it may read (HostState), whose other entries are allowed one by one.
    listable: tuple[str, ...] = ()


# Names of the host's own files beside config.json (and their .prev, .damaged-*, temporary
# and .host-id companions, which begin the same way).
STATE_FILE_PREFIXES = (
    "api_key",
    "reservations.json",
    "memory-measurements.json",
    ".solar-host.lock",
)
# Entries a tree holding the host's state may list before the split gives up on it.
MAX_SPLIT_ENTRIES = 10_000


@dataclass(frozen=True)
class HostState:
    """The host's own files: config.json and its companions, the API key, the reservation
    ledger, the backends' key files, its logs, its jobs and its env file. No backend reads
    them, even where they lie in a tree backends may read: installed from a checkout, the
    host's state directory is often the checkout, which its import path names (an editable
    install) and whose .env, config.json and api_key a backend could then read."""

    config_file: Path
    log_dir: Path
    jobs_dir: Path
    env_file: Path | None = None

    @functools.cached_property
    def _real(self) -> tuple[str, list[str], list[str]]:
        config = os.path.realpath(self.config_file)
        folder = os.path.dirname(config)
        whole = [
            os.path.join(folder, "backend-keys"),
            *map(os.path.realpath, (self.log_dir, self.jobs_dir)),
        ]
        if self.env_file is not None:
            whole.append(os.path.realpath(self.env_file))
        names = [os.path.basename(config), *STATE_FILE_PREFIXES]
        return folder, whole, names

    def holds(self, real: str) -> bool:
        """Whether the real path `real` is (or lies in) the host's state."""
        folder, whole, names = self._real
        if any(inside(real, w) for w in whole):
            return True
        if os.path.dirname(real) != folder:
            return False
        base = os.path.basename(real)
        # The file, its companions (config.json.prev, .host-id, .damaged-<time>) and the
        # temporary files its writes rename into place (.config.json.<random>.tmp).
        return any(base == n or base.startswith((n + ".", "." + n + ".")) for n in names)

    def beneath(self, real: str) -> bool:
        """Whether some of the host's state lies beneath the real directory `real`."""
        folder, whole, _ = self._real
        return any(inside(p, real) and p != real for p in (folder, *whole)) or real == folder

    def split(self, trees: Iterable[str]) -> tuple[list[str], list[str]]:
        """`trees` less the host's state: (trees to read, directories only to list). A tree
        holding state is listed and its entries judged one by one, down to the state."""
        readable: list[str] = []
        listable: list[str] = []
        budget = [MAX_SPLIT_ENTRIES]

        def visit(tree: str) -> None:
            real = os.path.realpath(tree)
            if self.holds(real):
                return
            if not self.beneath(real):
                readable.append(tree)
                return
            listable.append(tree)
            try:
                names = sorted(os.listdir(tree))
            except OSError:
                return
            for name in names:
                budget[0] -= 1
                if budget[0] < 0:
                    log.warning("backends may not read the rest of %s: too many entries", tree)
                    return
                visit(os.path.join(tree, name))

        for tree in trees:
            visit(tree)
        return readable, listable


# Cache variables huggingface_hub expands as paths (its constants.py: `~/hf` and `$HOME/hf` are
# documented forms): judged expanded, as the backend will open them. Others (transformers'
# HF_MODULES_CACHE, Triton's, torch's) are read literally by their programs, and so judged.
HUB_EXPANDED = frozenset({"HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"})


def access_policy(
    *,
    roots: Sequence[Path],
    argv: Sequence[str],
    env: Mapping[str, str],
    private_files: Iterable[str] = (),
    extra_reads: Iterable[str] = (),
    extra_writes: Iterable[str] = (),
    confine_writes: bool = True,
    host_state: HostState | None = None,
) -> AccessPolicy:
    """What a backend started as `argv` with environment `env` needs to read and write, never
    `host_state` (HostState) but where a model root holds it.

    No tree the backend may write lies in (or is) a model root: a cache variable pointed there
    (by an instance config's extra_env, which the roots check lets name a path in a model
    root) is read there, not written, so one backend cannot rewrite the models of others."""
    from solar_host.model_store.roots import expand_path, hub_caches

    # Paths from the backend's environment count only when absolute: a relative one would be
    # opened here against the host's working directory (its state: config.json, its keys),
    # not where the backend resolves it.
    home = env.get("HOME") or os.path.expanduser("~")
    writable: list[str] = list(SYSTEM_WRITABLE)
    writable += _dev_entries()
    if os.path.isabs(home):
        writable += [os.path.join(home, t) for t in HOME_WRITABLE]
    writable += [c for c in map(str, hub_caches(env)) if os.path.isabs(c)]
    for name in CACHE_VARS:
        value = env.get(name) or ""
        if name in HUB_EXPANDED:  # opened as huggingface_hub opens them: `~`, `$VAR` expanded
            value = expand_path(value, env)
        if os.path.isabs(value):
            writable.append(value)
    if not env.get("TMPDIR"):
        writable.append("/tmp")
    extra_writes = list(extra_writes)
    writable += extra_writes
    guarded = [os.path.realpath(p) for p in roots]
    writable = [w for w in writable if not _within_any(os.path.realpath(w), guarded, w)]

    trees: list[str] = list(SYSTEM_TREES)
    trees += [os.path.join("/etc", e) for e in ETC_ENTRIES]
    if os.path.isabs(home):
        trees += [os.path.join(home, t) for t in HOME_TREES]
    # The Python the host runs (our HF server and the test backends are this interpreter),
    # and where solar_host itself is installed (site-packages, or a source checkout).
    trees += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    trees.append(str(Path(__file__).resolve().parents[2]))
    # Its import path, which .pth files and --system-site-packages extend, less its first
    # entry: the host's working directory or script directory, nothing a backend imports.
    trees += [p for p in sys.path[1:] if p]
    for name in ("PYTHONPATH", "LD_LIBRARY_PATH"):
        trees += [p for p in env.get(name, "").split(os.pathsep) if os.path.isabs(p)]
    trees += _program_trees(argv[0], env, home) if argv else []
    trees += list(extra_reads)
    # "/" would allow everything (an empty PYTHONPATH entry, a program in the root): the
    # operator who wants that says so, with BACKEND_READ_CONFINEMENT=off or a model root.
    trees = [t for t in dict.fromkeys(map(os.path.abspath, trees)) if t != "/"]
    listable: list[str] = []
    if host_state is not None:
        trees, listable = host_state.split(trees)
    kept = [os.path.abspath(r) for r in roots] + trees
    written = [t for t in map(os.path.abspath, writable) if t != "/"]
    return AccessPolicy(
        tuple(dict.fromkeys(kept)),
        tuple(dict.fromkeys(private_files)),
        tuple(dict.fromkeys(written)),
        confine_writes,
        anchors=tuple(os.path.abspath(p) for p in extra_writes if os.path.abspath(p) != "/"),
        listable=tuple(dict.fromkeys(listable)),
    )


def _dev_entries() -> list[str]:
    out = [os.path.join("/dev", e) for e in DEV_ENTRIES]
    with contextlib.suppress(OSError):
        out += [os.path.join("/dev", e) for e in os.listdir("/dev") if e.startswith(DEV_PREFIXES)]
    return out


def inside(path: str, tree: str) -> bool:
    """Whether `path` is `tree` or lies beneath it (both absolute, as given)."""
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def _within_any(real: str, guarded: Sequence[str], given: str) -> bool:
    for g in guarded:
        if inside(real, g):
            log.warning(
                "backends may not write %s: it lies in the model root %s (only read there)",
                given,
                g,
            )
            return True
    return False


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


def escapes(policy: AccessPolicy) -> Callable[[str], str | None]:
    """A check for the paths of `policy`: where a path leads, when it lies inside a writable
    tree (which a backend may have changed) but leads out of every tree a backend may write;
    None otherwise. The trees' own real paths are worked out once, not once per rule.

    Backends may write their caches, and some allowed trees live inside others (the HF hub
    cache in ~/.cache): a backend could replace ~/.cache/huggingface with a link to ~/.ssh,
    and every backend started after it, under this host or the next, would be allowed
    ~/.ssh. A writable tree that lies in no other one (~/.cache itself, TMPDIR) can only be
    moved by the operator, and so can BACKEND_WRITE_PATHS: those are where a nested path may
    lead. An operator whose hub cache is a link out of ~/.cache lists its target there."""
    writable = frozenset(policy.writable)

    def nested(path: str) -> bool:  # beneath another writable tree
        return any(parent in writable for parent in _ancestors(path))

    tops = [w for w in policy.writable if not nested(w)]
    havens = [os.path.realpath(t) for t in [*tops, *policy.anchors]]

    def leads_out(path: str) -> str | None:
        if not nested(path):
            return None
        real = os.path.realpath(path)
        return None if any(inside(real, h) for h in havens) else real

    return leads_out


def _ancestors(path: str) -> Iterator[str]:
    """The directories above `path` (absolute), nearest first."""
    while (parent := os.path.dirname(path)) != path:
        yield parent
        path = parent


def prepare_writable(policy: AccessPolicy) -> None:
    """Create the writable trees that do not exist yet (~/.triton before the first triton
    kernel, a TRITON_CACHE_DIR): a rule needs an existing directory, and a confined backend
    could not make one in the directory above."""
    if not policy.confine_writes:
        return
    leads_out = escapes(policy)
    for path in policy.writable:
        # Never through a link a backend planted (the rule would be refused anyway).
        if not os.path.lexists(path) and leads_out(path) is None:
            with contextlib.suppress(OSError):
                os.makedirs(path, 0o700, exist_ok=True)


class Ruleset:
    """A Landlock ruleset built in the host; confined_popen applies it to a spawning thread."""

    def __init__(self, fd: int, skipped: list[str]):
        self.fd = fd
        self.skipped = skipped  # allowed paths that did not exist

    @classmethod
    def build(cls, policy: AccessPolicy) -> Ruleset:
        """Raise OSError where the kernel refuses (no Landlock)."""
        libc = c_library()
        handled = handled_access(abi_version(), policy.confine_writes)
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
            granted = handled & ~ACCESS_MAKE_DEVICE
            rules = [(p, handled & READ_RIGHTS) for p in policy.trees]
            rules += [(p, granted) for p in policy.writable]
            rules += [(p, ACCESS_READ_DIR) for p in policy.listable]
            rules += [(p, ACCESS_READ_FILE) for p in policy.files]
            rules += [(p, granted & FILE_RIGHTS) for p in policy.writable_files]
            leads_out = escapes(policy)
            for path, access in rules:
                escaped = leads_out(path)
                if escaped is not None:
                    log.warning(
                        "not allowing backends %s: it lies in a tree they may write and leads "
                        "out of it, to %s (a link a backend could have planted; if it is "
                        "yours, add its target to BACKEND_WRITE_PATHS)",
                        path,
                        escaped,
                    )
                    skipped.append(path)
                elif not cls._add(libc, fd, path, access):
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
            return False  # absent here (no /lib32): nothing to allow
        try:
            if not stat.S_ISDIR(os.fstat(target).st_mode):
                access &= FILE_RIGHTS  # a file takes file rights only
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


def confined_popen(
    argv: Sequence[str],
    env: Mapping[str, str],
    ruleset: Ruleset,
    popen: Callable[[str], subprocess.Popen[Any]],
) -> subprocess.Popen[Any]:
    """`popen(program)` (subprocess.Popen of `argv` with `program` as its executable) under
    `ruleset`, applied by landlock_exec.py to the thread that spawns it. The program is looked
    up here, on the backend's PATH, so a missing one fails the spawn as it would unconfined
    (FileNotFoundError), not as EACCES on a PATH entry the ruleset does not name."""
    import shutil

    program = argv[0]
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    return landlock_exec.spawn_confined(ruleset.fd, lambda: popen(found))


@functools.cache
def _say_unavailable_once() -> None:
    log.warning(
        "backends run unconfined (reads and writes): this kernel has no Landlock of ABI 2 or later "
        "(Linux 5.19+ with landlock among its LSMs); the model-roots check at start still "
        "applies"
    )


def ruleset_for(mode: str, policy: AccessPolicy) -> Ruleset | None:
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
        prepare_writable(policy)
        return Ruleset.build(policy)
    except OSError as err:
        if mode == "required":
            raise ConfinementUnavailable(f"cannot confine the backend: {err}") from None
        log.warning("backend starts unconfined (reads and writes): %s", err)
        return None
