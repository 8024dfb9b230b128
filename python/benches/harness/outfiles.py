"""The harness's output files, replaced whole: each text is written beside its file first
(``PATH.tmp``) and renamed over it only once every text of the set is written, so a reader never
sees half a file and a full disk leaves the files of a run before as they were."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Mapping


class WriteError(OSError):
    """Writing one of a set of output files failed; ``path`` names it. No file of the set was
    replaced, unless a rename failed part way (:func:`replace`). Its text is ``writing PATH:
    <the OS's error>``."""

    def __init__(self, path: str, cause: OSError) -> None:
        super().__init__(f"writing {path}: {cause}")
        self.path = path


def replace(files: Mapping[str, str]) -> None:
    """Replaces every ``path`` of ``files`` with its text (UTF-8), all or none: a path that is
    a folder is refused first; each text goes to ``path.tmp``; a failure there (a full disk,
    an interrupt) removes every ``.tmp`` of the set, the files untouched, and an ``OSError`` is
    raised as :class:`WriteError`; then the ``.tmp`` files are renamed into place. A rename
    failing past that check (the folder gone read-only) removes the ``.tmp`` files left and is
    a :class:`WriteError` too; the files renamed before it stay new."""
    if not isinstance(files, Mapping) or not all(isinstance(p, str) and isinstance(t, str) for p, t in files.items()):
        raise TypeError("outfiles.replace needs a mapping of path strings to text strings")
    for path in files:
        if os.path.isdir(path):
            raise WriteError(path, IsADirectoryError(errno.EISDIR, "Is a directory"))
    paths = list(files)
    for path in paths:
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(files[path])
        except BaseException as e:
            _remove_tmp(paths)
            if isinstance(e, OSError):
                raise WriteError(path, e) from e
            raise
    for i, path in enumerate(paths):
        try:
            os.replace(path + ".tmp", path)
        except OSError as e:
            _remove_tmp(paths[i:])
            raise WriteError(path, e) from e


def _remove_tmp(paths: list[str]) -> None:
    """Removes each ``path.tmp`` there is."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")


def replace_one(path: str, text: str) -> None:
    """:func:`replace` of one file."""
    replace({path: text})
