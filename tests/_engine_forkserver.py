"""Run by the engine environment's python (tests/_engine_scripts.py starts it): imports SGLang
and the model classes the tests' engine-side scripts use once, then runs each script it is sent
in a forked child, which starts with those imports done. A request is one JSON line on stdin,
{"argv": [script or "-c", code, args...], "stdout": path, "stderr": path}; the reply one JSON
line on stdout, {"returncode": n}. This process starts no thread before forking."""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

PRELOAD = (
    "torch", "safetensors.torch", "transformers", "sglang.srt.server_args",
    "sglang.srt.distributed.parallel_state", "sglang.srt.layers.moe",
    "sglang.srt.weight_sync.tensor_bucket", "sglang.srt.models.qwen2", "sglang.srt.models.qwen3",
    "sglang.srt.models.qwen2_eagle", "sglang.srt.models.qwen3_moe_mtp",
    "sglang.srt.models.deepseek_v2", "sglang.srt.models.deepseek_nextn",
    "sglang.srt.models.glm4_moe", "sglang.srt.models.glm4_moe_nextn",
)  # fmt: skip


def run(argv: list[str]) -> int:
    """In the child: `python argv...` as the interpreter would run it; its exit status."""
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "w")
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            code = run(request["argv"])
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


if __name__ == "__main__":
    main()
