"""The seccomp filter every bubblewrap and Docker sandbox runs under, compiled once per process.

A denylist on top of the namespaces (bubblewrap) or Docker's own profile: no socket families
but AF_UNIX (AF_INET/INET6/NETLINK too for specs that ask for the network; never vsock, packet,
alg ...), no new namespaces (unshare, setns, clone with namespace flags; clone3 answers ENOSYS
so libc falls back to clone, whose flags we can inspect), no mount family, keyring, bpf, perf,
kernel modules, reboot/kexec, userfaultfd, io_uring. Nothing may reach into another process:
ptrace, pidfd_getfd, process_vm_readv/writev, process_madvise and kcmp are denied, so tool code
cannot copy the worker's descriptors or touch its memory (the worker is also non-dumpable and
of another uid; see worker.py). Calls of other architectures (32-bit syscalls) kill the caller.
The BPF program is written with libseccomp (through pyseccomp); bubblewrap loads it with
`--seccomp FD`, the Docker worker loads it itself before it serves.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from agent_rl.kernel.errors import SandboxError

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise",
    "process_mrelease", "kcmp", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount",
    "fsconfig", "move_mount", "open_tree", "mount_setattr", "unshare", "setns", "keyctl",
    "add_key", "request_key", "bpf", "perf_event_open", "init_module", "finit_module",
    "delete_module", "reboot", "kexec_load", "kexec_file_load", "userfaultfd", "swapon",
    "swapoff", "syslog", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip
FAMILIES = (socket.AF_UNIX,)
"""Socket families tool code may create: the worker's own needs (its socket, the REPL's)."""
NETWORK_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK)
"""For specs with the network: what name resolution and TCP/UDP need (netlink: getaddrinfo)."""
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                  0x40000000, 0x00000080)


def write_filter(path: Path, *, network: bool = False) -> Path:
    """Compile the filter to `path` (replacing what is there: it takes milliseconds, and a stale
    file from an older version must not survive) and return it; `network=True` also allows the
    families in NETWORK_FAMILIES (for specs that ask for the network)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as e:
        raise SandboxError(
            f"cannot load libseccomp ({e}): install libseccomp2 and the pyseccomp package"
        ) from e
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(eperm, name)
        except (RuntimeError, ValueError, OSError):
            continue  # a syscall this kernel or libseccomp does not know cannot be called either
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NS_FLAGS:
        f.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    allowed = NETWORK_FAMILIES if network else FAMILIES
    for call in ("socket", "socketpair"):
        for rule in _refused_families(seccomp, allowed):
            f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, rule)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        f.export_bpf(out)
    tmp.replace(path)
    return path


def _refused_families(seccomp: object, allowed: tuple[int, ...]) -> list[object]:
    """Argument conditions, one per rule, that together match every family not in `allowed`:
    each gap between allowed values, and everything above the largest (the whole 64-bit
    register is compared, so high bits set on an allowed value are refused too)."""
    Arg, EQ, GT = seccomp.Arg, seccomp.EQ, seccomp.GT  # type: ignore[attr-defined]
    rules, low = [], 0
    for family in sorted(allowed):
        rules += [Arg(0, EQ, value) for value in range(low, family)]
        low = family + 1
    return [*rules, Arg(0, GT, max(allowed))]
