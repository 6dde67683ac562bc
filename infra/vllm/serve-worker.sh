#!/usr/bin/env bash
# One vLLM rollout engine of forge-stream on a GPU host, with LMCache as the shared KV tier.
#   KV_TIER=127.0.0.1:6555 MODEL=/shared/models/base CHECKPOINTS=/shared/forge/checkpoints KAFKA=k0:9092 RUN=main \
#     PORT=8100 infra/vllm/serve-worker.sh
# The tier is an LMCache server on the same host (KV handed over by CUDA IPC), started before the engine; with
# `forge-stream up cluster --host gpu-N` both come from topologies/cluster.yaml (its `kv_tier:` service: the
# server's command line, with a second level on a Redis-protocol store that every host's server shares).
# Then point the gateway at each engine (--engine http://host:8100).
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
# path here: shared FS), proving it (weight checksums, probe log-probs) before it is announced. Every request is
# salted by run and policy version (vLLM's cache_salt, which LMCache's keys carry): no version reads another's KV.
set -euo pipefail
MODEL="${MODEL:?set MODEL to a HuggingFace directory}"
KAFKA="${KAFKA:?set KAFKA to the bootstrap servers}"
CHECKPOINTS="${CHECKPOINTS:?set CHECKPOINTS to the checkpoint store the trainer writes (a shared folder)}"
PORT="${PORT:-8100}"
RUN="${RUN:-default}"
KV_TIER="${KV_TIER:-127.0.0.1:6555}"
BIND="${BIND:-127.0.0.1}"
exec forge-stream engine vllm --model "$MODEL" --host "$BIND" --port "$PORT" --dtype bfloat16 \
  --bootstrap-servers "$KAFKA" --policy-run "$RUN" --checkpoint-dir "$CHECKPOINTS" \
  --kv-tier "$KV_TIER" --vllm-arg=--gpu-memory-utilization=0.85 \
  "$@"
