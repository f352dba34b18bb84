#!/usr/bin/env bash
# A two-"node" torchrun job on this machine: examples/torchrun_two_nodes.py with tp=2.
#
# Starts two torchrun launches in the background, as two machines would:
#     torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr 127.0.0.1 --master-port P ...
#     torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1 --master-addr 127.0.0.1 --master-port P ...
# and waits for both. If either fails, the other is stopped and the script fails; if they
# are not done within $TIMEOUT seconds (default 150), both are stopped and the script fails.
# Each node's output is prefixed with [node0] / [node1].
#
# Usage:
#     bash examples/torchrun_two_nodes.sh            # 10 steps
#     bash examples/torchrun_two_nodes.sh --small    # 3 steps (CI)
# Arguments are passed to the Python script. Environment: TORCHRUN (default: the repository's
# .venv/bin/torchrun, else torchrun on PATH), PYTHON (for picking a free port), TIMEOUT.
set -uo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
if [[ -z "${TORCHRUN:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/torchrun" ]]; then TORCHRUN="$REPO/.venv/bin/torchrun"
    else TORCHRUN=$(command -v torchrun || true); fi
fi
if [[ -z "$TORCHRUN" || ! -x "$TORCHRUN" ]]; then
    echo "torchrun not found: install torch, or set TORCHRUN=/path/to/torchrun" >&2
    exit 2
fi
PYTHON=${PYTHON:-$(dirname "$TORCHRUN")/python}
[[ -x "$PYTHON" ]] || PYTHON=python3
TIMEOUT=${TIMEOUT:-150}
# A rank whose peer died raises after this many seconds instead of waiting in a collective.
export GRAPHPAR_TIMEOUT_S=${GRAPHPAR_TIMEOUT_S:-60}
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

echo "two nodes on 127.0.0.1:$PORT with $TORCHRUN (timeout ${TIMEOUT}s)"
pids=()
for node in 0 1; do
    # setsid: each node is its own process group, so stopping it stops its workers too
    setsid "$TORCHRUN" --nnodes 2 --nproc-per-node 1 --node-rank "$node" \
        --master-addr 127.0.0.1 --master-port "$PORT" \
        examples/torchrun_two_nodes.py "$@" > >(sed -u "s/^/[node$node] /") 2>&1 &
    pids+=($!)
done

stop_all() {
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null; done
    sleep 3
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null; done
}
trap 'echo "interrupted: stopping both nodes" >&2; stop_all; exit 130' INT TERM

# Wait for both, polling so that one node failing (or the timeout) stops the other at once.
finished=(0 0)
start=$SECONDS
while (( finished[0] + finished[1] < 2 )); do
    for i in 0 1; do
        (( finished[i] )) && continue
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            wait "${pids[$i]}"
            rc=$?
            finished[i]=1
            if (( rc != 0 )); then
                echo "node $i failed with exit code $rc: stopping the other node" >&2
                stop_all
                wait
                exit 1
            fi
        fi
    done
    if (( SECONDS - start > TIMEOUT )); then
        echo "timed out after ${TIMEOUT}s: stopping both nodes" >&2
        stop_all
        wait
        exit 1
    fi
    sleep 0.5
done
wait   # the output filters
echo "both nodes finished: PASS"
