"""Where ``export`` writes the images of a store converted from a manifest, and the names it
keeps for itself there (:data:`EXPORTED_MANIFEST`, :data:`EXPORT_MARK`): a manifest's paths
mapped one to one onto paths inside the export folder (:func:`export_name`)."""

from __future__ import annotations

__all__ = ["EXPORTED_MANIFEST", "EXPORT_MARK", "export_name"]

EXPORTED_MANIFEST = "manifest.jsonl"
"""What ``export`` writes beside the images of a store converted from a manifest."""

EXPORT_MARK = ".fastdata-export"
"""What ``export`` writes in its folder while it exports a store converted from a manifest,
before any image, and removes once the manifest is written: how an ``export --resume`` knows
that a ``manifest.jsonl`` there is its own, not the user's."""


_RESERVED = frozenset({"_root", "_up", "_", EXPORTED_MANIFEST, EXPORT_MARK})


def export_name(name: str) -> str:
    """Where ``export`` writes the image a manifest named ``name``, relative to the export
    folder, so that every image lands inside it and no two names ever land on one file:

    - a plain relative path is kept as it is;
    - an absolute path goes under ``_root/``, each leading ``..`` becomes ``_up/``;
    - a path whose (remaining) first part is itself ``_root``, ``_up``, ``_``,
      ``manifest.jsonl`` or ``.fastdata-export`` is escaped under ``_/``.

    The mapping is one to one: ``_root`` and ``_up`` appear only as the prefix, and ``_/`` marks
    the rest as literal.
    """
    parts = [p for p in name.split("/") if p not in ("", ".")]
    prefix: list[str] = ["_root"] if name.startswith("/") else []
    while parts and parts[0] == "..":
        prefix.append("_up")
        parts.pop(0)
    parts = ["_up" if p == ".." else p for p in parts]  # not in a normalised name; kept safe
    if parts and parts[0] in _RESERVED:
        prefix.append("_")
    return "/".join(prefix + parts)
