#!/usr/bin/env bash
# One vLLM rollout engine of forge-stream on a GPU host, with LMCache as the shared KV tier.
#   LMCACHE_HOST=... MODEL=/shared/models/base CHECKPOINTS=/shared/forge/checkpoints KAFKA=k0:9092 RUN=main \
#     PORT=8100 infra/vllm/serve-worker.sh
# On the LMCache host, once:   lmcache_server 0.0.0.0 65432   (from the vLLM runtime: forge-stream engine install-vllm)
# Then point the gateway at each engine (--engine http://host:8100). `forge-stream up cluster --host gpu-N` runs the
# same command from topologies/cluster.yaml.
#
# It listens on 127.0.0.1 unless BIND says otherwise; beyond loopback (BIND=0.0.0.0, for gateways on other hosts) the
# engine refuses to start without FORGE_ENGINE_TOKEN, which it then requires on every route but /health (give the
# gateways the same token: `gateway serve --engine-token`, or FORGE_ENGINE_TOKEN; `forge-stream up` generates it into
# its home's credentials.json).
#
# `forge-stream engine vllm` installs the pinned runtime if needed (vllm==0.32.0 and lmcache on GPU hosts), starts
# vLLM on a Unix socket of its own (its dev control routes, which reload weights, are the engine process's alone),
# and serves the engine protocol on PORT: every answer carries the policy version that produced it. It follows
# forge.policy for RUN and loads each new checkpoint inside CHECKPOINTS, the trainer's store (readable at the same
# path here: shared FS), proving it (weight checksums, probe log-probs) before it is announced; the LMCache tier is
# reset on each load.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:?set MODEL to a HuggingFace directory}"
KAFKA="${KAFKA:?set KAFKA to the bootstrap servers}"
CHECKPOINTS="${CHECKPOINTS:?set CHECKPOINTS to the checkpoint store the trainer writes (a shared folder)}"
PORT="${PORT:-8100}"
RUN="${RUN:-default}"
LMCACHE_HOST="${LMCACHE_HOST:-127.0.0.1}"
BIND="${BIND:-127.0.0.1}"
config="$(mktemp --suffix=.yaml)"
sed "s#lm://lmcache-host:#lm://${LMCACHE_HOST}:#" "$here/lmcache.yaml" > "$config"
export LMCACHE_CONFIG_FILE="$config"
exec forge-stream engine vllm --model "$MODEL" --host "$BIND" --port "$PORT" --dtype bfloat16 \
  --bootstrap-servers "$KAFKA" --policy-run "$RUN" --checkpoint-dir "$CHECKPOINTS" \
  --vllm-arg=--gpu-memory-utilization=0.85 \
  '--vllm-arg=--kv-transfer-config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}' \
  "$@"
