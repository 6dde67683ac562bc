"""The checkpoints a vLLM engine holds (forge_stream.engine.vllm_front.app): a trainer may delete a checkpoint while
an engine still loads it, or would need it to roll back, so the engine loads from a folder of its own with the
checkpoint's files (hard links, a copy across file systems), kept while vLLM serves it. The folders live under
`<cache>/engine-held-<pid>-*`; those of an engine that is gone are removed when the next one starts
(forge_stream.files.remove_orphaned).
`weights_fingerprint` tells a version whose weights are the served ones (renamed, not reloaded).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from forge_stream.files import link_tree


def hold_checkpoint(checkpoint: str, root: Path, version: int) -> Path:
    """A folder of this engine's own under `root` with the files of `checkpoint` (hard links, or copies where the
    file system does not allow them): it stays whole whatever the trainer deletes. OSError if `checkpoint` is gone
    or unreadable (nothing is left behind then)."""
    held = Path(tempfile.mkdtemp(prefix=f"v{version:06d}-", dir=root))
    try:
        link_tree(checkpoint, held)
    except (OSError, shutil.Error) as exc:
        shutil.rmtree(held, ignore_errors=True)
        raise OSError(f"cannot hold {checkpoint}: {exc}") from exc
    return held


def weights_fingerprint(model_dir: str | Path) -> str | None:
    """sha256 over the bytes of the folder's *.safetensors files (in name order); None without any. safetensors
    writes the same tensors to the same bytes, so equal fingerprints are equal weights."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


HOLDS_PREFIX = "engine-held-"  # + the engine's pid: the folders of held checkpoints in the cache directory

