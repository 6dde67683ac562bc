#!/usr/bin/env bash
# One vLLM rollout worker for forge-stream, with LMCache as the shared KV tier.
#   LMCACHE_HOST=... MODEL=/shared/ckpt/base PORT=8000 infra/vllm/serve-worker.sh
# On the LMCache host, once:   lmcache_server 0.0.0.0 65432
# Then point the gateway at each worker (--engine http://host:8000) and run the weight sync:
#   forge-stream engine vllm-sync --worker http://host:8000 [--worker ...] --run default --bootstrap-servers k:9092
# MODEL and every checkpoint the trainer publishes must be readable at the same path on each worker (shared FS).
# Needs vllm==0.32.0 (pyproject's [gpu] extra) and lmcache.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:?set MODEL to a HuggingFace directory}"
PORT="${PORT:-8000}"
LMCACHE_HOST="${LMCACHE_HOST:-127.0.0.1}"
config="$(mktemp --suffix=.yaml)"
sed "s#lm://lmcache-host:#lm://${LMCACHE_HOST}:#" "$here/lmcache.yaml" > "$config"

# VLLM_SERVER_DEV_MODE=1 exposes the control routes vllm-sync uses: /is_sleeping, /pause, /resume,
# /collective_rpc (update_config + reload_weights from the checkpoint directory), /update_weight_version,
# /weight_info and /reset_prefix_cache. They are unauthenticated: keep the port on a private network.
# Token ids need no flag: the gateway asks for `return_token_ids: true` and logprobs in each request.
# --logprobs-mode processed_logprobs: logprobs of the distribution actually sampled from (after temperature
# and top_p), which the trainer uses as pi_old; the gateway records them as such (--engine-logprobs-mode).
export VLLM_SERVER_DEV_MODE=1
export LMCACHE_CONFIG_FILE="$config"
exec vllm serve "$MODEL" --port "$PORT" \
  --enable-prefix-caching \
  --logprobs-mode processed_logprobs \
  --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}' \
  --enable-auto-tool-choice --tool-call-parser hermes \
  "$@"
# Not passed: --weight-transfer-config '{"backend":"nccl"}'. Its backends (nccl, ipc) receive tensors from a
# trainer that holds them on a GPU; forge-stream's trainer writes checkpoint directories instead, and the
# shared-disk backend (vllm PR #52152) is not released. Add it when the trainer pushes over NCCL.
