"""Host-side exec wrapper that puts a sandbox's first process in place (stdlib only).

Run as `python -I -S launcher.py SPEC_JSON -- ARGV...` by the server, as root. It joins the
sandbox's cgroups, drops to the sandbox's own unprivileged uid and gid (with `euid`/`egid`: those
as effective ids, the others as real and saved ones, which is how the rlimit backend's worker
holds tool code's uid; see worker.py), arms a parent-death signal, and execs ARGV (bwrap, or
the worker itself for the rlimit backend). Doing this in a
separate process instead of a `preexec_fn` keeps the server's process creation thread-safe, and
joining the cgroups before ARGV starts means nothing the sandbox forks can escape them.

The parent-death signal is set after the uid change, which would clear it, and the parent is
re-checked afterwards, so a server that dies during launch cannot leave an orphan. Exits 125
when setup fails, with the reason on stderr.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1


def die(msg: str) -> None:
    sys.stderr.write(f"agent-rl sandbox launcher: {msg}\n")
    os._exit(125)


def main() -> None:
    try:
        spec = json.loads(sys.argv[1])
        argv = sys.argv[sys.argv.index("--") + 1 :]
        parent = os.getppid()
        for procs in spec.get("cgroups", []):
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        for name, value in spec.get("rlimits", {}).items():
            resource.setrlimit(getattr(resource, "RLIMIT_" + name.upper()), (value, value))
        if "gid" in spec:
            os.setgroups([])
            os.setresgid(spec["gid"], spec.get("egid", spec["gid"]), spec["gid"])
        if "uid" in spec:
            os.setresuid(spec["uid"], spec.get("euid", spec["uid"]), spec["uid"])
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            die(f"prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
        if os.getppid() != parent:
            die("the server exited during launch")
        os.execve(argv[0], argv, spec.get("env", {}))  # argv[0] is absolute: no PATH search
    except (OSError, ValueError, IndexError) as e:
        die(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
