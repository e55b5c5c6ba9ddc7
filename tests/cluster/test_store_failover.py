"""The fleet store's master, then one of its data nodes, SIGKILLed while requests are in flight:
a greedy stream, a seeded n = 2 stream and a JSON-schema chat stream. None of them fails and
each gives the undisturbed run's text (the hand-off goes through the prefill worker's own node,
not the store); a second wave sent while the process is down is served too (a prefix the store
cannot answer for is recomputed). The restarted master rebuilds its index from the data nodes'
inventories; a restarted data node gets back the copies of the blocks that fell under
--replicas while it was gone. Nothing is left held anywhere afterwards.

One store of three processes (a master placing every block on 2 nodes, two data nodes), one
prefill and one decode worker, a router: each its own `pdserve <role>` process.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from helpers.cluster_util import Roles, wait_until

from pdserve import security
from pdserve.kvstore.client import StoreClient

SCHEMA = {"type": "object", "required": ["items"], "properties": {
    "items": {"type": "array", "minItems": 12, "items": {"type": "string"}}}}
REQUESTS = {
    "greedy": ("/v1/completions", {"prompt": "def fibonacci(n): " * 20, "max_tokens": 400,
                                   "temperature": 0, "ignore_eos": True}),
    "seeded-n2": ("/v1/completions", {"prompt": "import os\nclass Config: " * 12,
                                      "max_tokens": 300, "temperature": 1.0, "seed": 7, "n": 2,
                                      "ignore_eos": True}),
    "json-schema": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "list things " * 30}], "max_tokens": 200,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
            "name": "things", "schema": SCHEMA}}}),
}


@pytest.fixture(scope="module")
def roles(llama_dir, tmp_path_factory):
    roles = Roles(llama_dir, tmp_path_factory.mktemp("store-failover-logs"), num_data_nodes=2,
                  replicas=2)
    roles.start_all()
    try:
        roles.wait_ready()
        assert wait_until(lambda: master_stats(roles).get("num_nodes") == 2, 60)
        yield roles
    finally:
        roles.stop()


@pytest.fixture(scope="module")
def reference(roles) -> dict[str, list[str]]:
    """Each request's choices' texts, undisturbed (run twice: the second from the store's
    prefixes, which must not change them)."""
    texts = {name: choice_texts(roles, path, body) for name, (path, body) in REQUESTS.items()}
    for name, (path, body) in REQUESTS.items():
        assert choice_texts(roles, path, body) == texts[name]
    assert texts["json-schema"][0].startswith("{")  # the schema's grammar (cut at max_tokens)
    return texts


def master_stats(roles) -> dict:
    with security.using(security.ClusterKey.load(roles.key_path)):
        client = StoreClient(None, f"tcp://127.0.0.1:{roles.master_port}", transport="zmq",
                             timeout_s=2)
    try:
        return client.stats()
    except Exception:  # down, or still starting
        return {}
    finally:
        client.close()


def choice_texts(roles, path: str, body: dict) -> list[str]:
    r = httpx.post(f"{roles.base_url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["text"] if "text" in c else c["message"]["content"] for c in choices]


class Stream(threading.Thread):
    """One streamed request, its choices' text gathered as it arrives."""

    def __init__(self, roles, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = f"{roles.base_url}{path}", {**body, "stream": True}
        self.pieces: dict[int, list[str]] = {}
        self.error: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = str(chunk["error"])
                        return
                    for choice in chunk["choices"]:
                        delta = choice.get("text", choice.get("delta", {}).get("content"))
                        self.pieces.setdefault(choice["index"], []).append(delta or "")
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.started.set()

    def texts(self) -> list[str]:
        return ["".join(self.pieces[i]) for i in sorted(self.pieces)]


def kill_under_load(roles, reference, victim: str) -> None:
    """Streams under way, SIGKILL `victim`, a second wave meanwhile: every text the
    reference's."""
    streams = {name: Stream(roles, path, body) for name, (path, body) in REQUESTS.items()}
    for stream in streams.values():
        stream.start()
    for stream in streams.values():
        assert stream.started.wait(60)
    roles.kill(victim)
    for name, (path, body) in REQUESTS.items():  # the second wave, with the victim down
        assert choice_texts(roles, path, body) == reference[name], name
    for name, stream in streams.items():
        stream.join(120)
        assert stream.error is None, (name, stream.error)
        assert stream.texts() == reference[name], name


def test_requests_in_flight_outlive_the_master_and_its_restart_rebuilds_the_index(
        roles, reference):
    indexed = master_stats(roles)["num_master_blocks"]
    assert indexed > 0  # the reference's prompts were written down to the store
    kill_under_load(roles, reference, "master")
    roles.start_store("master")
    # soft state: the data nodes find the new master and send their inventories
    assert wait_until(lambda: master_stats(roles).get("num_nodes") == 2
                      and master_stats(roles).get("num_master_blocks", 0) >= indexed, 60)
    for name, (path, body) in REQUESTS.items():
        assert choice_texts(roles, path, body) == reference[name], name
    roles.assert_nothing_leaked()


def test_requests_in_flight_outlive_a_data_node_and_its_blocks_are_copied_back(
        roles, reference):
    kill_under_load(roles, reference, "data-1")
    # the master drops the node after its TTL; what it held now has one copy left
    assert wait_until(lambda: master_stats(roles).get("num_nodes") == 1, 30)
    roles.start_store("data-1")
    # back, empty: the blocks under --replicas 2 are copied onto it again
    assert wait_until(lambda: master_stats(roles).get("num_indexed.store-1", 0) > 0, 60), \
        master_stats(roles)
    for name, (path, body) in REQUESTS.items():
        assert choice_texts(roles, path, body) == reference[name], name
    roles.assert_nothing_leaked()
