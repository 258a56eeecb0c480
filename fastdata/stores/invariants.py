"""The invariants of a finished store, stated once: every writer checks them before it marks a
store complete (``StoreWriter.finish``) and ``verify`` checks them on a store (docs/stores.md,
"What a finished store guarantees"; ``docs/guarantees.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..packed import PackedStrings
from ..records import SkippedFile, StoreMeta, name_bytes

if TYPE_CHECKING:
    import numpy as np

__all__ = ["invariant_failures"]


def invariant_failures(
    meta: StoreMeta,
    labels: np.ndarray,
    names: bytes | PackedStrings | None,
    skipped: Sequence[SkippedFile] | None,
) -> list[str]:
    """Which invariants of a finished store the given parts break (``names`` and ``skipped``
    are checked when given). Costs one sort of the names by hash: O(n log n), no object per
    record held.

    1. one label per record; 2. every label a class index (-1 in a store without classes);
    3. one name per record; 4. no name twice (no image stored twice); 5. no skipped entry
    twice; 6. no skipped entry also stored; 7. the metadata counts the skipped entries.
    """
    import numpy as np

    out = []
    if len(labels) != meta.count:
        out.append(f"one label per record: {len(labels)} labels for {meta.count} records")
    elif not meta.labelled:
        if len(labels) and (np.asarray(labels) != -1).any():
            out.append("every label -1 in a store without classes: a record has a label")
    elif len(labels) and (int(np.min(labels)) < 0 or int(np.max(labels)) >= len(meta.classes)):
        out.append(
            f"every label a class index: a label lies outside the {len(meta.classes)} classes"
        )
    packed = None
    if names is not None:
        packed = PackedStrings.from_joined(names) if isinstance(names, bytes) else names
        if len(packed) != meta.count:
            out.append(f"one name per record: {len(packed)} names for {meta.count} records")
        else:
            first = packed.repeats()
            twice = np.flatnonzero(first != np.arange(len(packed)))
            if len(twice):
                i = int(twice[0])
                out.append(
                    f"every image stored once: records {int(first[i])} and {i} are both "
                    f"{packed[i].decode('utf-8', 'surrogateescape')}"
                )
    if skipped is not None:
        listed = PackedStrings([name_bytes(s.name) for s in skipped])
        first = listed.repeats()
        twice = np.flatnonzero(first != np.arange(len(listed)))
        if len(twice):
            name = skipped[int(twice[0])].name
            out.append(f"each skipped file listed once: {name} is listed twice")
        if packed is not None and len(listed):
            stored = np.flatnonzero(packed.find(listed) >= 0)
            if len(stored):
                out.append(f"a skipped file is not stored: {skipped[int(stored[0])].name} is both")
        if meta.skipped_count != len(skipped):
            out.append(
                f"the metadata counts the skipped files: it says {meta.skipped_count}, "
                f"the list holds {len(skipped)}"
            )
    return out
