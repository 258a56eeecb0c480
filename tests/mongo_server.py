"""A MongoDB wire-protocol server for the integration tests.

The tests start SecantusDB (``python -m secantus``) themselves on a free loopback port and stop it
by its PID; with ``FASTDATA_TEST_MONGO_URI`` set they use that server (a real ``mongod``) instead.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pymongo

URI_ENV = "FASTDATA_TEST_MONGO_URI"

_clients: dict[str, pymongo.MongoClient] = {}


def database(uri: str) -> pymongo.database.Database:
    """The database a test URI names, through one client per server, closed by
    :func:`close_clients` when the tests end."""
    server = uri.rsplit("/", 1)[0] if uri.count("/") > 2 else uri
    if server not in _clients:
        _clients[server] = pymongo.MongoClient(server, serverSelectionTimeoutMS=5000)
    return _clients[server][uri.rsplit("/", 1)[1]]


def close_clients() -> None:
    while _clients:
        _clients.popitem()[1].close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SecantusServer:
    """One SecantusDB process; ``start()`` and ``stop()`` may be called again (same port, data)."""

    def __init__(self, storage: Path | str = ":memory:", port: int | None = None) -> None:
        self.storage = str(storage)
        self.port = port or free_port()
        self.uri = f"mongodb://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"secantus-{self.port}.log"

    def start(self, timeout: float = 60.0) -> SecantusServer:
        cmd = [sys.executable, "-m", "secantus", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--storage-path", self.storage, "--log-level", "WARNING"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"secantus exited with {self.proc.returncode}; see {self.log}")
            client = pymongo.MongoClient(self.uri, serverSelectionTimeoutMS=500)
            try:
                client.admin.command("ping")
                return self
            except pymongo.errors.PyMongoError:
                time.sleep(0.2)
            finally:
                client.close()
        self.stop()
        raise RuntimeError(f"secantus did not answer on port {self.port} in {timeout} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
