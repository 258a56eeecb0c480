"""The README's and every docs page's code runs as written, on a folder of photos of mixed sizes.

Each page's ``python`` blocks run, in order, in one new process whose home and working folder are
a fresh tmp_path holding ``~/data/train``; then its ``fastdata ...`` command lines run, each
block's in a folder of its own. A page under ``docs/`` reads what the README's blocks make (the
store ``train.lmdb``), so the README's blocks run first, in a process of their own. The MongoDB
address in the docs (``mongodb://db1:27017/images``) is replaced by the test server's, where the
README's folder is converted into the collection ``train`` first. A block that is not meant to run
(an output, a recipe being replaced) takes another fence (``text``, ``py``).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest
from bson import Binary

from fastdata import convert

from .conftest import jpeg_bytes, write
from .mongo_server import database
from .procs import REPO

pytestmark = [pytest.mark.mongo, pytest.mark.slow]

DOC_URI = "mongodb://db1:27017/images"


def blocks(path: Path, language: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def photos(home: Path, kind: str) -> Path:
    """~/data/train: three classes named as the quick start's sample names them, of JPEGs of
    many sizes as real photos come ("photos"), or made as the quick start makes its sample."""
    root = home / "data" / "train"
    if kind == "sample":
        from fastdata.images.synthetic import make_image_folder

        return make_image_folder(root, classes=3, per_class=25)
    rng = np.random.default_rng(0)
    for c in range(3):
        for i in range(25):
            w, h = (int(x) for x in rng.integers(80, 320, size=2))
            write(root / f"class_{c:02d}" / f"{i:03d}.jpg", jpeg_bytes(w, h, seed=c * 100 + i))
    return root


def run(code: str, cwd: Path, env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{code}\n---\n{result.stdout}\n{result.stderr}"


@pytest.fixture(params=["photos", "sample"])
def docs_env(
    tmp_path: Path, mongo_uri: str, request: pytest.FixtureRequest
) -> tuple[Path, dict[str, str]]:
    home = tmp_path / "home"
    photos(home, request.param)
    env = dict(os.environ, HOME=str(home), MONGO_URI=mongo_uri)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return home, env


def python_code(page: str) -> str:
    return "\n".join(textwrap.dedent(block) for block in blocks(REPO / page, "python"))


def command_lines(page: str) -> list[tuple[int, str]]:
    return [
        (n, line.split("#")[0].strip())
        for n, block in enumerate(blocks(REPO / page, "bash"))
        for line in block.splitlines()
        # the quick start's own store is made by scripts/quickstart.sh, and docs/mongodb.md's
        # "Try it" commands start a server of their own (tested below); a line with [...] is a
        # synopsis
        if line.startswith("fastdata ") and "[" not in line and "sample-data" not in line
    ]


def legacy_sources(home: Path, mongo_uri: str) -> None:
    """What docs/migrating.md's snippets start from: a pickle LMDB store, a collection of
    ``img_name`` / ``bson_img`` documents and its JSON index."""
    legacy = lmdb.open(str(home / "legacy.lmdb"), subdir=False, map_size=1 << 24)
    keys = []
    with legacy.begin(write=True) as txn:
        for i in range(6):
            key = str(i).encode()
            txn.put(key, pickle.dumps((jpeg_bytes(seed=i), i % 2)))
            keys.append(key)
        txn.put(b"__keys__", pickle.dumps(keys))
    legacy.close()
    paths = ["cat/1.jpg", "cat/2.jpg", "dog/1.jpg"]
    coll = database(mongo_uri)["legacy"]
    coll.insert_many(
        [{"img_name": p, "bson_img": Binary(jpeg_bytes(seed=i))} for i, p in enumerate(paths)]
    )
    (home / "index.json").write_text(json.dumps({"path_list": paths, "label_list": [0, 0, 1]}))


SOURCES = {"docs/migrating.md": legacy_sources}

PAGES = [
    page
    for page in ["README.md", *(f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md")))]
    if python_code(page) or command_lines(page)
]


def test_the_pages_with_code_are_all_run() -> None:
    """(So that a page's code cannot leave the test by a change of fence or of folder.)"""
    expected = {"README.md", "cli", "fields", "format", "growing", "loader", "migrating", "mongodb"}
    assert {Path(page).stem if page != "README.md" else page for page in PAGES} >= expected


@pytest.mark.parametrize("page", PAGES)
def test_every_page_runs(page: str, docs_env: tuple[Path, dict[str, str]], mongo_uri: str) -> None:
    home, env = docs_env
    server = mongo_uri.rsplit("/", 1)[0]
    db = database(f"{server}/images")
    db.client.drop_database(db.name)  # (each kind of data runs the blocks anew)
    convert(home / "data" / "train", f"{server}/images", collection="train")
    if page != "README.md":
        run(python_code("README.md"), home, env)  # what the page reads: train.lmdb
    if page in SOURCES:
        SOURCES[page](home, mongo_uri)
    code = python_code(page)
    if code:
        run(code.replace(DOC_URI, f"{server}/images"), home, env)
    for n, command in command_lines(page):
        cli_dir = home / f"{Path(page).stem}-block-{n}"  # each block's lines in a folder of its own
        cli_dir.mkdir(exist_ok=True)
        args = shlex.split(command.replace(DOC_URI, f"{server}/images"))[1:]
        args = [os.path.expanduser(a.replace("~", str(home))) for a in args]
        if args[0] == "convert" and "mongodb://" in " ".join(args):
            args.append("--overwrite")  # made above already
        result = subprocess.run(
            [sys.executable, "-m", "fastdata", *args],
            cwd=cli_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"{page}: {command}\n{result.stdout}\n{result.stderr}"


def test_the_mongodb_try_it_paragraph_runs_as_printed(tmp_path: Path) -> None:
    """docs/mongodb.md's "Try it with MongoDB" commands, in order, against the server they start
    (on a free port: the printed 27017 may be taken here), on the quick start's sample."""
    from fastdata.images.synthetic import make_image_folder

    from .mongo_server import free_port

    text = (REPO / "docs" / "mongodb.md").read_text(encoding="utf-8")
    section = text.split("## Try it with MongoDB", 1)[1].split("\n## ", 1)[0]
    (block,) = blocks_of(section, "bash")
    lines = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert lines[0] == "pip install --pre secantusdb"  # (installed here by the test extras)
    port = str(free_port())
    home = tmp_path / "home"
    make_image_folder(home / "sample-data" / "images", classes=3, per_class=30)  # 1 batch+
    env = dict(os.environ, HOME=str(home), PYTHONPATH=str(REPO))
    server_words = shlex.split(lines[1].rstrip("&").replace("27017", port))
    server_words = [os.path.expanduser(w.replace("~", str(home))) for w in server_words]
    assert server_words[:3] == ["python", "-m", "secantus"]
    server = subprocess.Popen(
        [sys.executable, *server_words[1:]], cwd=home, env=env, stderr=subprocess.PIPE, text=True
    )
    log: list[str] = []
    ready = threading.Event()  # set once the server says it listens (or ends)

    def follow() -> None:  # (reads the server's log to its end, so that it never blocks)
        for said in server.stderr:  # type: ignore[union-attr]
            log.append(said)
            if "listening on" in said:
                ready.set()
        ready.set()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    try:
        ready.wait(120)  # (a bound in case it hangs: it says so at once, or ends)
        assert any("listening on" in said for said in log), "".join(log)
        for line in lines[2:]:  # each once, as printed: the server is up
            words = shlex.split(line.replace("27017", port))
            if words[0] == "fastdata":
                words = [sys.executable, "-m", "fastdata", *words[1:]]
            elif words[0] == "python":
                words = [sys.executable, str(REPO / words[1]), *words[2:], "--workers", "0"]
            result = subprocess.run(
                words, cwd=home, env=env, capture_output=True, text=True, timeout=600
            )
            assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
    finally:
        server.terminate()
        server.wait(10)
        follower.join(10)  # (the log's end: the server is gone)
        server.stderr.close()  # type: ignore[union-attr]
    assert (home / "sample-data" / "back.lmdb" / "data.mdb").exists()


def blocks_of(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)
