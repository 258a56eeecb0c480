"""A reader stopped in the middle of a read, for as long as it takes, across several appends,
gets the bytes it would have got: no time margin (see NOTE [ Appends against readers ])."""

from __future__ import annotations

import json
from pathlib import Path

from fastdata import convert, open_store

from ...conftest import jpeg_bytes, write
from ...procs import script, wait_for

# Opens the store argv[1], begins reading every record and stops inside the read transaction
# (after its first record) until argv[3] exists; then checks what it read.
STOPPED_READER = """
    import json, os, sys, time, zlib
    from pathlib import Path
    from fastdata.stores.lmdb import lease
    from fastdata.stores.lmdb.reader import LMDBStore

    store, started, go = sys.argv[1:4]
    reader = LMDBStore(store)
    n = len(reader)
    real = lease.address  # taken of each value looked up, just before it is copied
    calls = [0]
    def address(view):
        calls[0] += 1
        if calls[0] == 2:  # inside the transaction, one record copied
            Path(started).touch()
            while not os.path.exists(go):
                time.sleep(0.01)
        return real(view)
    lease.address = address
    records = reader.read_records(range(n))
    bad = [r.index for r in records if zlib.crc32(r.data) != r.header.crc32]
    print(json.dumps({"n": n, "bad": bad, "calls": calls[0],
                      "names": [r.header.name for r in records]}))
"""


def _images(root: Path, cls: str, n: int, seed: int) -> None:
    for i in range(n):
        write(root / cls / f"{i:04d}.jpg", jpeg_bytes(8, 8, seed=seed + i))


def test_a_stopped_reader_reads_right_across_three_appends(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "s.lmdb"
    _images(src, "a", 300, 0)
    convert(src, dst)
    expected = [f"a/{i:04d}.jpg" for i in range(300)]
    started, go = tmp_path / "started", tmp_path / "go"
    reader = script(STOPPED_READER, dst, started, go)
    wait_for(started, reader)
    for k, cls in enumerate(("b", "c", "d")):  # every append frees pages the next reuses
        _images(src, cls, 200, 1000 * (k + 1))
        assert convert(src, dst, append=True, commit_records=8, workers=1).count == 300 + 200 * (
            k + 1
        )
    go.touch()
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    seen = json.loads(out)
    assert seen["n"] == 300 and seen["bad"] == [] and seen["names"] == expected
    assert seen["calls"] > 2 * 300  # (a record and a header each) begun again: a new transaction
    final = open_store(dst)
    assert len(final) == 900 and final.read_named([0])[0][0] == "a/0000.jpg"
