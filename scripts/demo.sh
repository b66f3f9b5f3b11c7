#!/usr/bin/env bash
# `make demo`: bring the whole mesh up on its embedded defaults (each service its own
# process), ask it real questions the way a user and an engineer would, then drain it.
set -euo pipefail
cd "$(dirname "$0")/.."
LOGS=var/demo-logs
mkdir -p "$LOGS"

# The edge (Envoy on :8080) takes this key; any client outside the mesh must present one.
export AIMESH_EDGE__API_KEYS='["demo-key"]'
# DEMO_TLS=1 (`make demo-tls`): mutual TLS between every process, Envoy included, from a
# throwaway CA; the aimesh commands and grpcurl below present the operator's certificate,
# and clients of the edge reach it over TLS, trusting that CA (curl --cacert, grpcurl
# -cacert, the openai SDK's httpx client).
UP_TLS=()
DIRECT=(-plaintext)
export EDGE=http://127.0.0.1:8080 EDGE_CA=
EDGE_CURL=()
EDGE_GRPCURL=(-plaintext)
if [ "${DEMO_TLS:-0}" = 1 ]; then
  PKI=var/demo-tls
  UP_TLS=(--tls --tls-dir "$PKI")
  export AIMESH_TLS__CERT_FILE=$PKI/aimesh-cli.pem AIMESH_TLS__KEY_FILE=$PKI/aimesh-cli.key \
    AIMESH_TLS__CA_FILE=$PKI/ca.pem
  DIRECT=(-cacert "$PKI/ca.pem" -cert "$PKI/aimesh-cli.pem" -key "$PKI/aimesh-cli.key")
  export EDGE=https://127.0.0.1:8080 EDGE_CA=$PKI/ca.pem
  EDGE_CURL=(--cacert "$EDGE_CA")
  EDGE_GRPCURL=(-cacert "$EDGE_CA")
fi
aimesh up --edge "${UP_TLS[@]}" --log-dir "$LOGS" &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT

# The first run converts the embedded model once (about 20 s); later runs start in seconds.
for _ in $(seq 1 600); do
  aimesh health >/dev/null 2>&1 && break
  kill -0 $UP 2>/dev/null || { echo "aimesh up exited; logs in $LOGS"; exit 1; }
  sleep 0.5
done
aimesh health
for _ in $(seq 1 120); do
  curl -sf "${EDGE_CURL[@]}" "$EDGE/healthz" >/dev/null && break
  kill -0 $UP 2>/dev/null || { echo "aimesh up exited; logs in $LOGS"; exit 1; }
  sleep 0.5
done

echo; echo "== aimesh generate --chat: tokenizer -> prefill -> KV pull -> decode -> text in the router"
aimesh generate --chat --max-new-tokens 80 "How do I copy a nested list in Python?"

echo; echo "== the same mesh as JSON, with per-stage timing and the trace id"
aimesh generate --json --max-new-tokens 16 "The capital of France is"

echo; echo "== grpcurl: JSON straight into the generation service"
grpcurl "${DIRECT[@]}" -max-time 60 \
  -d '{"prompt": "Three primary colours are", "stopping": {"max_new_tokens": 12}}' \
  127.0.0.1:50060 aimesh.llm.v1.GenerationService/Generate | grep '"text"' || true

echo; echo "== bad input: INVALID_ARGUMENT with field violations"
grpcurl "${DIRECT[@]}" -d '{"prompt": "", "sampling": {"temperature": -1}}' \
  127.0.0.1:50060 aimesh.llm.v1.GenerationService/Generate || true

echo; echo "== through Envoy ($EDGE): JSON with curl, a server stream arrives as a JSON array"
curl -sS "${EDGE_CURL[@]}" -H 'authorization: Bearer demo-key' -d '{"prompt": "The capital of France is",
  "sampling": {"temperature": 0}, "stopping": {"maxNewTokens": 6}}' "$EDGE/v1/generate"
echo
echo "== through Envoy: gRPC with grpcurl (no reflection at the edge, so the protos are named)"
grpcurl "${EDGE_GRPCURL[@]}" -H 'authorization: Bearer demo-key' -max-time 60 \
  -import-path protos -import-path third_party/googleapis -proto aimesh/llm/v1/generation.proto \
  -d '{"prompt": "Two plus two is", "stopping": {"max_new_tokens": 4}}' \
  127.0.0.1:8080 aimesh.llm.v1.GenerationService/Generate | grep '"text"' || true
echo "== through Envoy without a key: refused at the edge"
curl -sS "${EDGE_CURL[@]}" -o /dev/null -w 'HTTP %{http_code}\n' -d '{"inputs": ["hi"]}' "$EDGE/v1/embed"

echo; echo "== the openai SDK, unmodified, through Envoy to the gateway: models, a streamed chat, embeddings, an image"
python - <<'PY'
import base64
import os
import ssl

import httpx
from openai import OpenAI

# Over TLS (DEMO_TLS=1) the SDK's httpx client trusts the edge's CA.
ca = os.environ["EDGE_CA"]
http_client = httpx.Client(verify=ssl.create_default_context(cafile=ca)) if ca else None
client = OpenAI(base_url=f"{os.environ['EDGE']}/v1", api_key="demo-key", http_client=http_client)
print("models:", [model.id for model in client.models.list()])
stream = client.chat.completions.create(
    model="SmolLM2-135M-Instruct",
    messages=[{"role": "user", "content": "Name three primary colours."}],
    max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    elif chunk.usage:
        print(f"\n(usage: {chunk.usage.prompt_tokens} prompt + "
              f"{chunk.usage.completion_tokens} completion tokens)")
vectors = client.embeddings.create(
    model="sentence-transformers/all-MiniLM-L6-v2", input=["a cat sat on the mat"]
)
print("embedding dimensions:", len(vectors.data[0].embedding))
image = client.images.generate(model="digits", prompt="7", n=1, response_format="b64_json")
png = base64.b64decode(image.data[0].b64_json)
print(f"image: a {len(png)}-byte PNG" if png.startswith(b"\x89PNG") else "image: not a PNG")
PY

echo; echo "== /v1/rerank in Cohere's and Jina's shape, through Envoy to the gateway"
curl -sS "${EDGE_CURL[@]}" "$EDGE/v1/rerank" -H 'authorization: Bearer demo-key' \
  -H 'content-type: application/json' -d '{"model": "minilm-late-interaction",
  "query": "how do I delete a directory tree?", "top_n": 2, "documents": [
  "json.loads parses a JSON document", "shutil.rmtree deletes a directory tree",
  "heapq.heappush pushes an item onto a heap"]}'
echo

echo; echo "== the knowledge base: the stdlib's own docs, embedded once (about a minute the first time)"
aimesh ingest
aimesh search --rerank --top-k 3 "how do I copy a nested list?"

echo; echo "== aimesh ask: the agent searches the knowledge base and answers with citations"
aimesh ask --seed 1 "How do I make a deep copy of a nested list in Python?"

echo; echo "== aimesh ask: a question that needs the calculator"
aimesh ask --seed 1 "What is (17*23)+4?"

echo; echo "== aimesh imagine: the project's own digits DDPM, then a terrain heightfield (ONNX Runtime)"
aimesh imagine --model digits --prompt seven --n 4 --seed 7 --out var/demo-images
aimesh imagine --model terrain --condition difficulty=70 --out var/demo-images/terrain.png --json

echo; echo "== grpcurl: one diffusion job's event stream (queued, progress, image, summary)"
grpcurl "${DIRECT[@]}" -max-time 60 \
  -d '{"model": "digits", "prompt": "3", "steps": 10, "seed": 1}' \
  127.0.0.1:50080 aimesh.diffusion.v1.DiffusionService/Generate

ECHO=127.0.0.1:50100
echo; echo "== the mesh runtime itself: a 3-hop echo chain under a 2 s budget, one trace and request id"
grpcurl "${DIRECT[@]}" -max-time 2 -d "{\"hops\": [\"$ECHO\", \"$ECHO\"], \"delay_ms\": 50}" \
  $ECHO aimesh.echo.v1.EchoService/RelayUnary

echo; echo "== LLM metrics (Prometheus, decode on :51063, router on :51060)"
curl -s http://127.0.0.1:51063/metrics | grep -E '^aimesh_llm_(num_requests|kv_cache)' || true
curl -s http://127.0.0.1:51060/metrics | grep -E '^aimesh_llm_time_to_first_token_seconds_(count|sum)' || true

echo; echo "== SIGTERM: every service drains and exits"
kill -TERM $UP
wait $UP
trap - EXIT
echo "demo done; service logs in $LOGS"
