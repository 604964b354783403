"""Apply a Landlock ruleset, then become the backend.

Run as `python -I -S landlock_exec.py FD LC_CTYPE PATH ARGV...`. The host builds the ruleset
(confinement.Ruleset) and hands its descriptor down; this program restricts itself with it and
execs PATH with ARGV (ARGV[0] as the backend was given it). The restriction holds across exec,
for the backend and everything it starts.

LC_CTYPE is the value the backend's environment had for it ("=value"), or "" for none. Python
started in the C locale sets LC_CTYPE=C.UTF-8 in its own environment (PEP 538), and -I ignores
PYTHONCOERCECLOCALE: without putting the host's value back, a confined backend would run in
another locale than the same backend unconfined.

Why a program and not subprocess's preexec_fn: a preexec_fn forces subprocess from vfork onto
fork(), which copies the page tables of the whole host while it holds the GIL (94 ms a spawn for
a 1.5 GB process, against 0.26 ms), so 200 starts at once stalled the event loop. This runs in
the child instead, in an isolated interpreter (-I -S: no site, nothing imported but _ctypes).
Standard library only: it is run by path, not imported.
"""

import _ctypes
import os
import sys

_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_SYS_LANDLOCK_RESTRICT_SELF = 446
EXIT_NOT_CONFINED = 126
# Capabilities that would let a backend of a host run as root step around the ruleset: read
# another process's memory and environment (SYS_PTRACE: Landlock lets it trace the host), open
# files by handle (DAC_READ_SEARCH), make device nodes or do raw I/O (MKNOD, SYS_RAWIO), mount,
# load modules or BPF programs, bypass the LSMs (SYS_ADMIN, SYS_MODULE, BPF, PERFMON,
# MAC_*), reboot. Dropped from the bounding set before exec, so root's backend never has them.
_DROP_CAPS = (2, 16, 17, 19, 21, 22, 27, 32, 33, 38, 39)


# The two libc calls, through the C module under ctypes: importing ctypes itself costs 4 ms of
# every start (struct, endianness, the type zoo), _ctypes 0.7 ms.
class _Int(_ctypes._SimpleCData):
    _type_ = "i"


class _LibcCall(_ctypes.CFuncPtr):
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = _Int


class _Libc:
    _handle = _ctypes.dlopen(None, 0)  # the program's own symbols, libc among them


def _clear_inheritable() -> None:
    """Empty the inheritable set (and with it the ambient one), which exec would otherwise
    carry past the bounding set. Usually empty already; some container runtimes fill it."""
    caps = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("CapInh:", "CapPrm:", "CapEff:")):
                name, value = line.split(":")
                caps[name] = int(value, 16)
    if not caps.get("CapInh"):
        return
    import struct  # only here: most starts never need it

    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    low, high = 0xFFFFFFFF, 32
    eff, prm = caps.get("CapEff", 0), caps.get("CapPrm", 0)
    data = struct.pack("=6I", eff & low, prm & low, 0, eff >> high, prm >> high, 0)
    _LibcCall(("capset", _Libc))(header, data)


def main(args: list[str]) -> int:
    fd, lc_ctype, path, argv = int(args[0]), args[1], args[2], args[3:]
    env = dict(os.environ)
    if lc_ctype.startswith("="):
        env["LC_CTYPE"] = lc_ctype[1:]
    else:
        env.pop("LC_CTYPE", None)
    prctl, syscall = _LibcCall(("prctl", _Libc)), _LibcCall(("syscall", _Libc))
    if (
        prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        or syscall(_SYS_LANDLOCK_RESTRICT_SELF, fd, 0) != 0
    ):
        reason = os.strerror(_ctypes.get_errno())
        print(f"solar-host: cannot confine the backend: {reason}", file=sys.stderr)
        return EXIT_NOT_CONFINED
    os.close(fd)
    if os.geteuid() == 0:
        for cap in _DROP_CAPS:  # EINVAL for one this kernel does not know: nothing to drop
            prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
        _clear_inheritable()
    os.execve(path, argv, env)  # raises only if the program vanished since the host looked
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
