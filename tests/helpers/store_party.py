"""A process on a host of its own (tests/helpers/netns_cluster.py) in a job's network: the
rendezvous service, or a party that reaches every port of the job but lacks its secret.

``store_party.py serve PORT``: hosts a c10d TCPStore on every address until its stdin closes, as
a shared rendezvous service would (the agents find the port taken and connect as clients; the store
outlives the job, so status can be read after it ended). Prints ``ready`` once listening.

``store_party.py attack HOST:PORT``: a plain TCPStore client of the job's store and a peer-tier
client with a guessed secret, driven by the test one command per line on stdin, one JSON answer per
line on stdout (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``):

- ``read KEY``: the value (hex) as resilrun wrote it, less the c10d backend's one-byte frame;
  also ``body``, the JSON under the MAC when it parses (a MAC hides nothing);
- ``write KEY HEX``: set the value (framed as resilrun's c10d backend frames it);
- ``replay KEY HEX``: write it back every few milliseconds until ``stop`` (a replay that keeps
  coming, so readers mostly find it);
- ``hold KEY[,KEY...]``: set each counter back to 5 in a tight loop until ``stop`` (counters carry
  no MAC: a node's heartbeat held still);
- ``probe ADDR``: ask the replica server at ADDR for its inventory and a snapshot, and push it one,
  with the guessed secret; ``errors`` says what each attempt got;
- ``stop``: end the loops.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from resilrun.rendezvous.sealed import MAGIC, TAG_BYTES
from resilrun.tiers.peer import ReplicationError, fetch, inventory, push
from tests.conftest import make_snapshot

GUESS = b"a-guessed-secret-of-thirty-two-b"
_FRAME = b"v"  # resilrun's c10d backend frames every value with one byte (rendezvous/c10d.py)


def serve(port: int) -> None:
    store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes it (or the host is killed)
    del store


class Party:
    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        self.endpoint = (host, int(port))
        self.store = self._connect()
        self._stop = threading.Event()
        self._loops: list[threading.Thread] = []

    def _connect(self) -> TCPStore:
        return TCPStore(self.endpoint[0], self.endpoint[1], is_master=False, timeout=timedelta(seconds=10))

    def read(self, key: str) -> dict[str, Any]:
        value = self.store.get(key)[len(_FRAME) :]
        body = value[len(MAGIC) + TAG_BYTES :] if value.startswith(MAGIC) else value
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        return {"value": value.hex(), "body": parsed}

    def write(self, key: str, value_hex: str) -> dict[str, Any]:
        self.store.set(key, _FRAME + bytes.fromhex(value_hex))
        return {}

    def replay(self, key: str, value_hex: str) -> dict[str, Any]:
        value = _FRAME + bytes.fromhex(value_hex)
        self._loop(lambda store: store.set(key, value), pause_s=0.005)
        return {}

    def hold(self, counters: str) -> dict[str, Any]:
        keys = counters.split(",")

        def hold_still(store: TCPStore) -> None:
            for key in keys:
                store.set(key, b"5")

        self._loop(hold_still, pause_s=0.002)
        return {}

    def _loop(self, act: Any, pause_s: float) -> None:
        store = self._connect()  # a connection of its own: the command loop stays free

        def run() -> None:
            while not self._stop.is_set():
                act(store)
                time.sleep(pause_s)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._loops.append(thread)

    def probe(self, address: str) -> dict[str, Any]:
        wait = timedelta(seconds=5)
        replica = make_snapshot({"weight": torch.zeros(8)})
        attempts = {
            "inventory": lambda: inventory(address, GUESS, wait),
            "fetch": lambda: fetch(address, GUESS, 0, 3, wait),
            "push": lambda: push(address, GUESS, 0, 10**6, 2, replica, {}, wait),
        }
        errors = {}
        for name, attempt in attempts.items():
            try:
                attempt()
                errors[name] = None  # it worked: the test fails on it
            except ReplicationError as exc:
                errors[name] = exc.message
        return {"errors": errors}

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        for thread in self._loops:
            thread.join(5)
        self._loops.clear()
        self._stop.clear()
        return {}


def attack(endpoint: str) -> None:
    party = Party(endpoint)
    print(json.dumps({"ok": True}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        try:
            answer = {"ok": True, **getattr(party, command)(*args)}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the test as an answer
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    party.stop()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        attack(sys.argv[2])
