"""GPU checks run only where vLLM and a CUDA device exist; elsewhere these files are not collected."""

import importlib.util

import torch

_HAS_VLLM_GPU = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
collect_ignore_glob = [] if _HAS_VLLM_GPU else ["test_vllm_*.py"]
