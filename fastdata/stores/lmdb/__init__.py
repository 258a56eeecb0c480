"""The LMDB backend: ``layout`` (keys and files), ``env`` (the per-process environment
registry, read-ahead, the append epoch), ``writer``, ``reader``, ``file`` (page checks), ``open``.

Layout of a store folder, documented in ``docs/format.md``: ``data.mdb`` (the store),
``lock.mdb`` (LMDB's own), ``writer.lock`` (the writer lock), ``readers.epoch`` (the append epoch)
and, while a replacement is being built, ``.replacement/`` (every such name is made by
``stores/names.py``, and no store may take one). Keys in ``data.mdb``:

- ``0000000000`` ... ``NNNNNNNNNN``: the image bytes of each record, as they are (plus a JPEG
  end-of-image repair), keys zero-padded so a cursor walks them in index order;
- ``#0000000000`` ...: each record's header (JSON: name, label, size, crc32, format, repaired);
- ``__labels__``: the labels, one little-endian int32 per record;
- ``__len__``: the record count as ASCII decimal; ``__keys__``: the record keys, newline-separated;
- ``__names__``: every record's name, in index order, joined by NUL bytes (what ``--append``
  compares a folder with);
- ``#progress``: conversion progress (JSON), saved with every committed batch;
- ``#skipped/0000000000`` ...: each source file the conversion left out (JSON: name, reason),
  written once, with the batch during which it was skipped;
- ``__fastdata__``: the metadata (JSON), written last: a store without it is incomplete.

Environments are owned by a per-process registry (below); readers hold a share of one.
"""
