"""The README's and docs/migrating.md's code runs as written, on a folder of photos of mixed sizes.

Every ``python`` block runs, in order, in one new process whose home and working folder are a
fresh tmp_path holding ``~/data/train``; the README's ``fastdata ...`` command lines run too. The
MongoDB address in the docs (``mongodb://db1:27017/images``) is replaced by the test server's.
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


def photos(home: Path) -> Path:
    """~/data/train: three classes of JPEGs of many sizes, as real photos come."""
    rng = np.random.default_rng(0)
    root = home / "data" / "train"
    for c in range(3):
        for i in range(25):
            w, h = (int(x) for x in rng.integers(80, 320, size=2))
            write(root / f"class_{c}" / f"{i:03d}.jpg", jpeg_bytes(w, h, seed=c * 100 + i))
    return root


def run(code: str, cwd: Path, env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{code}\n---\n{result.stdout}\n{result.stderr}"


@pytest.fixture
def docs_env(tmp_path: Path, mongo_uri: str) -> tuple[Path, dict[str, str]]:
    home = tmp_path / "home"
    photos(home)
    env = dict(os.environ, HOME=str(home), MONGO_URI=mongo_uri)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return home, env


def test_every_readme_block_runs(docs_env: tuple[Path, dict[str, str]], mongo_uri: str) -> None:
    home, env = docs_env
    server = mongo_uri.rsplit("/", 1)[0]
    convert(home / "data" / "train", f"{server}/images", collection="train")
    code = "\n".join(blocks(REPO / "README.md", "python"))
    run(code.replace(DOC_URI, f"{server}/images"), home, env)
    commands = [
        (n, line.split("#")[0].strip())
        for n, block in enumerate(blocks(REPO / "README.md", "bash"))
        for line in block.splitlines()
        # the quick start's own store is made by scripts/quickstart.sh, not here
        if line.startswith("fastdata ") and "[" not in line and "sample-data" not in line
    ]
    assert len(commands) >= 8
    for n, command in commands:
        cli_dir = home / f"block-{n}"  # each block's command lines in a folder of their own
        cli_dir.mkdir(exist_ok=True)
        args = shlex.split(command.replace(DOC_URI, f"{server}/images"))[1:]
        args = [os.path.expanduser(a.replace("~", str(home))) for a in args]
        if args[0] == "convert" and "mongodb://" in " ".join(args):
            args.append("--overwrite")  # the Python block above made it already
        result = subprocess.run(
            [sys.executable, "-m", "fastdata", *args],
            cwd=cli_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"


def test_every_migration_snippet_runs(
    docs_env: tuple[Path, dict[str, str]], mongo_uri: str
) -> None:
    home, env = docs_env
    convert(home / "data" / "train", home / "train.lmdb")
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
    snippets = blocks(REPO / "docs" / "migrating.md", "python")
    assert len(snippets) == 5
    run("\n".join(textwrap.dedent(s) for s in snippets), home, env)
