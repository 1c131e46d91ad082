"""The kernel (layer L0, with `agent_rl.config`): errors by boundary, tracing names, the
encoding of per-token facts every layer shares (policy versions, "no expert"), and the process
settings every command shares (the garbage collector's, CPU priority), and the keep-alive HTTP/1.1
client of the hot paths to the engines (`http1`: the router's and the engine client's). It imports nothing
of ours, so any process can load it alone."""
