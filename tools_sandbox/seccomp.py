"""The seccomp filter every bubblewrap sandbox runs under, compiled once per process.

A denylist on top of the namespaces: no network sockets (AF_INET/INET6/NETLINK/PACKET), no new
namespaces (unshare, setns, clone with namespace flags; clone3 answers ENOSYS so libc falls
back to clone, whose flags we can inspect), no ptrace or reading other processes' memory, no
mount family, keyring, bpf, perf, kernel modules, reboot/kexec, userfaultfd, io_uring. The
namespaces already make most of these harmless; the filter removes the kernel attack surface.
The BPF program is written with libseccomp (through pyseccomp) and fed to `bwrap --seccomp FD`.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from agent_rl.errors import SandboxError

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree", "mount_setattr", "unshare",
    "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "init_module",
    "finit_module", "delete_module", "reboot", "kexec_load", "kexec_file_load", "userfaultfd",
    "swapon", "swapoff", "syslog", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)
DENIED_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                  0x40000000, 0x00000080)


def write_filter(path: Path, *, network: bool = False) -> Path:
    """Compile the filter to `path` (replacing what is there: it takes milliseconds, and a stale
    file from an older version must not survive) and return it; `network=True` leaves sockets
    of every family allowed (for specs that ask for the network)."""
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
    for family in () if network else DENIED_FAMILIES:
        f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.EQ, family))
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        f.export_bpf(out)
    tmp.replace(path)
    return path
