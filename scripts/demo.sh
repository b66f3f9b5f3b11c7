#!/usr/bin/env bash
# `make demo`: bring the mesh up on its embedded defaults, exercise it the way an engineer
# would (health, grpcurl, a call chain across hops), then drain it with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
LOGS=var/demo-logs
mkdir -p "$LOGS"

aimesh up --log-dir "$LOGS" &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT

for _ in $(seq 1 600); do
  aimesh health >/dev/null 2>&1 && break
  kill -0 $UP 2>/dev/null || { echo "aimesh up exited; logs in $LOGS"; exit 1; }
  sleep 0.5
done
aimesh health

ECHO=127.0.0.1:50100
echo; echo "== grpcurl: what the echo process serves (reflection)"
grpcurl -plaintext $ECHO list

echo; echo "== a call chain: caller -> echo -> echo -> echo, 2 s budget set at the edge"
echo "   (each hop reports the deadline it saw and the trace id it joined)"
grpcurl -plaintext -max-time 2 -d "{\"hops\": [\"$ECHO\", \"$ECHO\"], \"delay_ms\": 50}" \
  $ECHO aimesh.echo.v1.EchoService/RelayUnary

echo; echo "== bad input: INVALID_ARGUMENT with field violations"
grpcurl -plaintext -d '{"delay_ms": -1, "response_status": {"code": 99}}' \
  $ECHO aimesh.echo.v1.EchoService/Echo || true

echo; echo "== metrics (Prometheus exposition)"
curl -s http://127.0.0.1:51100/metrics | grep '^aimesh_rpc_server_handled_total' || true

echo; echo "== SIGTERM: every service drains and exits"
kill -TERM $UP
wait $UP
trap - EXIT
echo "demo done; service logs in $LOGS"
