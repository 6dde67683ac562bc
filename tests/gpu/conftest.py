"""GPU checks run only where a CUDA device exists; elsewhere these files are not collected. vLLM is not looked for
in this environment: the tests install it into its own (`forge-stream engine install-vllm`, target gpu)."""

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_vllm_*.py"]
