"""Issue 9 trust model end to end: CURVE keys per role, and a request bound to the key of the
Prefill that the rendezvous named. Two real KVSources in this process hold two authorized
client keys (so their engine session ids are the same: only the key tells them apart);
Decode is a KVSink on loopback with the server key.

On 87b7601 ``expect`` bound nothing: the second Prefill's announcement completed the
request with its own bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zmq.auth
from layers import layer_tensors

from rd2h.api import KVSink, KVSource
from rd2h.outcome import TerminalState
from rd2h.wire.endpoint import DecodeEndpoint

LAYERS = ("l0", "l1")
BLOCK = 16  # tokens per block


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("curve")
    made: dict[str, Path] = {}
    for name in ("decode", "alice", "mallory"):
        public, secret = zmq.auth.create_certificates(root, name)
        made[name], made[name + "_secret"] = Path(public), Path(secret)
    authorized = root / "authorized"
    authorized.mkdir()
    for name in ("alice", "mallory"):
        (authorized / f"{name}.key").write_bytes(made[name].read_bytes())
    made["authorized"] = authorized
    return made


def prefill_options(keys: dict[str, Path], who: str) -> dict[str, object]:
    return {"curve_secret_key": str(keys[who + "_secret"]), "curve_server_key": str(keys["decode"])}


def test_only_the_prefill_holding_the_expected_key_may_announce_a_request(keys: dict[str, Path], kv_port: int) -> None:
    dst = {name: layer_tensors(False) for name in LAYERS}
    alice_src = {name: layer_tensors(True, seed=i) for i, name in enumerate(LAYERS)}
    mallory_src = {name: layer_tensors(True, seed=10 + i) for i, name in enumerate(LAYERS)}
    alice_key = zmq.auth.load_certificate(keys["alice"])[0].decode()
    endpoint = DecodeEndpoint("127.0.0.1", kv_port, 1)
    decode_options = {"curve_secret_key": str(keys["decode_secret"]), "curve_authorized_keys": str(keys["authorized"])}
    with KVSink(dst, kv_port=kv_port, channel_options=decode_options) as sink:
        sink.expect("r", [1, 2], prefill=alice_key)
        with KVSource(mallory_src, block_size=BLOCK, channel_options=prefill_options(keys, "mallory")) as mallory:
            mallory.add_request("r", endpoint, main_block_ids=[0, 1], num_tokens=2 * BLOCK)
            assert mallory.send_all({"r": 2 * BLOCK}) == {}
            outcome = mallory.wait_finished(["r"], 30)["r"]
            assert outcome.state is TerminalState.FAILED and "may not announce" in str(outcome.error)
        assert sink.take() == {}  # untouched on Decode
        assert not any(t.main[0].any() for t in dst.values())
        with KVSource(alice_src, block_size=BLOCK, channel_options=prefill_options(keys, "alice")) as alice:
            alice.add_request("r", endpoint, main_block_ids=[0, 1], num_tokens=2 * BLOCK)
            assert alice.send_all({"r": 2 * BLOCK}) == {}
            assert alice.wait_finished(["r"], 30)["r"].state is TerminalState.DONE
        assert sink.wait(["r"], 30)["r"].state is TerminalState.DONE
    for name in LAYERS:
        assert np.array_equal(dst[name].main[0][1:3], alice_src[name].main[0][0:2])
