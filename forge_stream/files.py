"""File-system helpers shared by the trainer and the engines."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from forge_stream.proc import alive

log = logging.getLogger(__name__)


def link_tree(src: str | Path, dst: str | Path) -> None:
    """Make `dst` a copy of the folder `src` whose files are hard links to `src`'s (copies where the file system
    does not allow a link): it costs no bytes, and it stays whole whatever is later deleted from `src`."""
    def link_or_copy(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(src, dst, copy_function=link_or_copy, dirs_exist_ok=True)


def in_store(store: str | Path | None, path: str | Path) -> Path | None:
    """`path` with its symbolic links resolved, if it lies inside the folder `store` (resolved too); None if it does
    not, and always without a store. The rule for every checkpoint an engine loads, over HTTP or from forge.policy:
    a checkpoint store is trusted, a path is not."""
    if store is None:
        return None
    target = Path(path).resolve()
    return target if target.is_relative_to(Path(store).resolve()) else None


def remove_orphaned(folder: Path, prefix: str) -> None:
    """Remove the folders `<prefix><pid>-*` in `folder` of processes that are gone (killed before they could): an
    engine's held checkpoints would otherwise outlive the trainer's rotation on disk."""
    for path in folder.glob(f"{prefix}*"):
        try:
            pid = int(path.name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue  # not named by a process
        if not alive(pid):
            log.info("removing %s, left by a process that is gone", path)
            shutil.rmtree(path, ignore_errors=True)
