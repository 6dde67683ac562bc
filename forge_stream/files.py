"""File-system helpers shared by the trainer and the engines."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def link_tree(src: str | Path, dst: str | Path) -> None:
    """Make `dst` a copy of the folder `src` whose files are hard links to `src`'s (copies where the file system
    does not allow a link): it costs no bytes, and it stays whole whatever is later deleted from `src`."""
    def link_or_copy(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(src, dst, copy_function=link_or_copy, dirs_exist_ok=True)
