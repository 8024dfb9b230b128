"""The harness's output files, replaced whole: each text is written beside its file first
(``PATH.tmp``) and renamed over it only once every text of the set is written, so a reader never
sees half a file and a full disk leaves the files of a run before as they were."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Mapping


class WriteError(OSError):
    """Writing one of a set of output files failed; ``path`` names it, and no file of the set
    was replaced. Its text is ``writing PATH: <the OS's error>``."""

    def __init__(self, path: str, cause: OSError) -> None:
        super().__init__(f"writing {path}: {cause}")
        self.path = path


def replace(files: Mapping[str, str]) -> None:
    """Replaces every ``path`` of ``files`` with its text, all or none: a path that is a folder
    is refused first; each text goes to ``path.tmp``; an ``OSError`` there removes every ``.tmp``
    of the set and is raised as :class:`WriteError`, the files untouched; then the ``.tmp``
    files are renamed into place."""
    if not isinstance(files, Mapping) or not all(isinstance(p, str) and isinstance(t, str) for p, t in files.items()):
        raise TypeError("outfiles.replace needs a mapping of path strings to text strings")
    for path in files:
        if os.path.isdir(path):
            raise WriteError(path, IsADirectoryError(errno.EISDIR, "Is a directory"))
    for path, text in files.items():
        try:
            with open(path + ".tmp", "w") as f:
                f.write(text)
        except OSError as e:
            for other in files:
                with contextlib.suppress(OSError):
                    os.remove(other + ".tmp")
            raise WriteError(path, e) from e
    for path in files:
        os.replace(path + ".tmp", path)


def replace_one(path: str, text: str) -> None:
    """:func:`replace` of one file."""
    replace({path: text})
