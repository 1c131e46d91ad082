#!/usr/bin/env bash
# Start a private Docker engine for the sandbox tests and print the DOCKER_HOST to use:
#   eval "$(.ci/start-dockerd.sh)"
# State lives under $AGENT_RL_DOCKERD_DIR (default /tmp/agent-rl-dockerd), the engine has no
# bridge network and does not touch iptables (sandboxes run with network_mode="none"), so it
# coexists with anything else on the host. Idempotent: an engine already answering is reused.
# Needs root and dockerd (Debian: apt-get install docker.io).
set -euo pipefail
dir="${AGENT_RL_DOCKERD_DIR:-/tmp/agent-rl-dockerd}"
sock="unix://$dir/docker.sock"
mkdir -p "$dir"
answers() { docker -H "$sock" version --format '{{.Server.Version}}' >/dev/null 2>&1; }
if ! answers; then
  nohup dockerd --data-root "$dir/root" --exec-root "$dir/exec" --pidfile "$dir/dockerd.pid" \
    -H "$sock" --bridge=none --iptables=false --ip6tables=false \
    >"$dir/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 1 120); do
    answers && break
    sleep 0.5
  done
  if ! answers; then
    echo "dockerd did not answer within 60 s; its log:" >&2
    tail -n 30 "$dir/dockerd.log" >&2
    exit 1
  fi
fi
echo "export DOCKER_HOST=$sock"
