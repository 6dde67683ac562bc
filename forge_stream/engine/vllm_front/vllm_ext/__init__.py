"""Code that runs inside vLLM's own processes (its runtime's environment, not the project's): the directory is put on
the vLLM server's PYTHONPATH, and `forge_worker` is imported there as a top-level module. It imports only vLLM and
torch."""
