#!/usr/bin/env bash
# On one GPU, in under ten minutes: the shared KV tier (LMCache's server, CUDA IPC to the engines) with real vLLM.
#   bash tests/gpu/kv_tier_check.sh            (from the repository, in its virtualenv)
# 1. tests/vllm/test_shared_kv_tier.py's checks that need no kill: `up` of the tier and two engines on the tiny model, a
#    prompt one engine computed read from the tier by the other, and no KV of one policy version served to another
#    (after a reload both engines serve v1; the prompt stored at v0 is no hit, and log-probs match v1's weights).
# 2. `forge-stream bench kv-tier` on SmolLM2 at 1K and 4K tokens, one round: time to first token from the tier
#    against recompute, stale_hits (must be 0), failed_calls_on_tier_loss (must be 0). Its JSON goes to
#    $OUT/kv_tier.json (or ./kv_tier_gpu.json) for the closing note.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}"
forge-stream engine install-vllm --target gpu
python -m pytest -q -x tests/vllm/test_shared_kv_tier.py -k "supervised or read_from_the_tier or never_served" -p no:cacheprovider
forge-stream bench kv-tier --model smollm2-135m --sizes 1024,4096 --rounds 1 --json --log-dir "$out/kv_tier_logs" \
  | tee "$out/kv_tier.json"
python - "$out/kv_tier.json" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
assert result["stale_hits"] == 0, result["stale_hits"]
assert result["failed_calls_on_tier_loss"] == 0, result["failed_calls_on_tier_loss"]
for row in result["sizes"]:
    print(f"{row['context_tokens']} tokens: tier {row['ttft_tier_s']:.3f}s, recompute {row['ttft_recompute_s']:.3f}s "
          f"({row['speedup']:.1f}x), {row['hit_tokens']} tokens from the tier, {row['retrieve_mb_per_s']} MB/s, "
          f"log-prob diff {row['logprob_diff']}")
PY
