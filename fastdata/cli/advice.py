"""What ``verify`` advises for a damaged store: the commands that repair it, each one runnable
as printed, and none that would give a store other than the one it had (the same records under
other labels, or fewer records)."""

from __future__ import annotations

import json
import os
import re
import shlex
from typing import Any

__all__ = ["repairs"]


def repairs(store: str, collection: str | None, meta: Any, *, decode: bool) -> str:
    """The advice for the damaged store ``store`` (``collection``: its MongoDB collection) whose
    metadata is ``meta`` (None for a store of another tool), in which ``verify`` found records
    that do not decode (``decode``) or other damage: the sound records copied out with
    ``export``, which leaves out what ``verify`` named (with ``--decode``, what does not
    decode too: ``--verify-decode`` for a conversion); the
    conversion again from the store's source, where that gives the same store. A store that
    grew by ``--append`` is not converted again from its source: that would number its
    classes anew, and leave out what the appends added from other sources."""
    if collection is not None:
        from ..stores.uri import command_words

        target = command_words(store, collection)
        name = re.sub(r"[^\w.-]+", "_", collection)
    else:  # absolute paths: the commands run from any folder (I11)
        target = shlex.quote(os.path.abspath(store))
        name = os.path.splitext(os.path.abspath(store))[0]
    sound = _free(os.path.abspath(f"{name}-sound"))
    export = f"fastdata export {target} {shlex.quote(sound)} --skip-damaged"
    copy_out = f"copy out the records that are sound with `{export}{' --decode' * decode}`"
    source = meta.source if meta is not None else ""
    if not source:
        return f"damaged; {copy_out}, or convert it again from its source."
    if meta.appended_from:
        renumbered = (
            "its classes would be numbered in sorted order, not in the order the appends left "
            "them, and "
            if meta.class_order != "sorted"
            else ""
        )
        return (
            f"damaged; {copy_out}. Converting its source ({source}) again would not rebuild it: "
            f"it grew by --append, so {renumbered}what the appends added from other sources "
            "would be missing."
        )
    if not os.path.exists(source):
        return f"damaged; {copy_out}, or convert it again from its source ({source}, not found)."
    if not _classes_kept(meta, source):
        return (
            f"damaged; {copy_out}. Converting its source ({source}) again may number its "
            "classes otherwise (a class list given with --classes is not recorded)."
        )
    words = ["fastdata", "convert", shlex.quote(source), target, "--overwrite"]
    if decode:
        words.append("--verify-decode")
    if meta.sidecars:
        words += ["--sidecars", shlex.quote(",".join(meta.sidecars))]
    if meta.fields:
        words += ["--fields", shlex.quote(meta.schema.describe(","))]
    return f"damaged; {copy_out}, or convert it again from its source with `{' '.join(words)}`."


def _free(path: str) -> str:
    """``path``, or ``path-2``, ``path-3``...: the first that names nothing yet."""
    candidate, k = path, 1
    while os.path.lexists(candidate):
        k += 1
        candidate = f"{path}-{k}"
    return candidate


def _classes_kept(meta: Any, source: str) -> bool:
    """Whether converting ``source`` again gives the store's classes in the store's order: a
    folder's are sorted; a manifest's are too, or numbered, or listed on its first line."""
    classes = list(meta.classes)
    if meta.layout != "manifest" or not meta.labelled or classes == sorted(classes):
        return True
    if classes == [str(k) for k in range(len(classes))]:
        return True
    try:
        with open(source, "rb") as f:
            head = json.loads(f.readline(1 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(head, dict) and head.get("classes") == classes
