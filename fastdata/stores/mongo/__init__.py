"""The MongoDB backend: ``connection`` (options, the per-process client, retries), ``layout``
(BSON codec, skipped lists), ``claim`` (the writer claim), ``writer``, ``reader``. Every
collection and document name is made by ``stores/names.py``, and no store may take one.

A store is one collection with one document per image::

    {"_id": 17, "name": "cat/0017.jpg", "label": 0, "size": 118233, "crc32": 2874011234,
     "format": "jpeg", "repaired": false, "scan_end": 118231, "data": BinData(...)}

Images too large for one document (over ``GRIDFS_THRESHOLD``) live in the store's GridFS bucket
``<collection>.gridfs.<id>`` under the id ``"<id>:<index>"``, and their document carries
``"gridfs_id"`` instead of ``"data"``. The metadata (same fields as the LMDB store's, plus the
labels as one little-endian int32 array) is the document ``{"_id": "<collection>"}`` in the
collection ``__fastdata__``, written last; conversion progress is ``"<collection>:progress"`` there.

Clients are created lazily, once per process, and never cross a fork or a pickle. Network errors
are retried with a bounded, growing backoff; when the server stays away the error names the URI
(password masked) and what was being read.
"""
