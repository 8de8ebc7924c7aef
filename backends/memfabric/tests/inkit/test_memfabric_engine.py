"""memfabric engine behaviour on the real wheel, beyond the conformance suite.

memfabric's engine is process-wide state (and 1.3.0 leaves a closed Prefill engine unusable),
so every scenario runs in a fresh child process of its own (this process already has the
kit's environment, and children inherit it) and prints one JSON line of findings.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

PRELUDE = """
import json, os, signal, sys, time
import numpy as np
from rd2h.errors import BackendUnavailableError, ConfigError, PeerGoneError, RegionError, TransferError, TransferTimeout
from rd2h.interfaces import Region
from rd2h.plugins import load_engine
from rd2h.testing.peer import PeerProcess
STORE = "tcp://127.0.0.1:1"
def engine(role, **kw):
    return load_engine("memfabric", role, **{"store_url": STORE, "timeout": 3.0, **kw})
def peer(seed=1, sizes=(4 << 20, 2 << 20)):
    return PeerProcess("memfabric", sizes=sizes, seed=seed, options={"store_url": STORE, "timeout": 3.0})
def arrays(*cols):
    return [np.asarray(c, dtype=np.int64) for c in cols]
def stop(pid):  # SIGSTOP, then wait until the kernel shows it stopped: kill() returns earlier
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in "Tt":
                return
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} did not stop")
def error(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None
"""


def scenario(body: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``body`` in a fresh interpreter; it ends with ``out = {...}``."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out), flush=True)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"scenario failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["_stdout"] = proc.stdout
    return result


def test_decode_pulls_64k_blocks_bit_exact_across_merged_registrations() -> None:
    out = scenario(
        """
        n, blk = 96, 64 << 10
        dst = np.zeros(n * blk, dtype=np.uint8)
        e = engine("decode")
        half = dst.nbytes // 2  # two adjacent registrations become one
        e.register([Region(dst.ctypes.data, half)])
        e.register([Region(dst.ctypes.data + half, half)])
        with peer(sizes=(8 << 20, 2 << 20)) as p:
            s = e.connect(p.metadata)
            ids = np.random.default_rng(3).permutation((8 << 20) // blk)[:n]
            local, remote, lengths = arrays(dst.ctypes.data + np.arange(n) * blk, p.regions[0][0] + ids * blk, [blk] * n)
            e.read_batch(s, local, remote, lengths)
            want = p.expected(0).reshape(-1, blk)[ids].reshape(-1)
            out = {
                "exact": bool(np.array_equal(dst, want)),
                "registered": [[r.addr, r.length] for r in e.registered_regions],
                "whole": [dst.ctypes.data, dst.nbytes],
                "peer": s.peer_id, "peer_session": p.session_id,
                "data_op": e.data_op, "caps": str(type(e).capabilities),
            }
        e.close()
        """
    )
    assert out["exact"]
    assert out["registered"] == [out["whole"]]
    assert out["peer"] == out["peer_session"]
    assert out["data_op"] == "host_tcp"  # "auto" on a machine without an NPU
    # memfabric's own log goes to logging, not to our stdout
    assert out["_stdout"].strip().splitlines() == [line for line in out["_stdout"].strip().splitlines() if line.startswith("RESULT ")]


def test_one_engine_per_process_shared_by_configuration() -> None:
    out = scenario(
        """
        buf = np.zeros(1 << 20, dtype=np.uint8)
        e1 = engine("decode")
        e2 = engine("decode")
        out = {"same_session": e1.session_id == e2.session_id}
        out["other_role"] = error(lambda: engine("prefill"))
        out["other_device"] = error(lambda: engine("decode", device_id=3))
        out["npu_region"] = error(lambda: e1.register([Region(buf.ctypes.data, 4096, kind="npu:0")]))
        e1.register([Region(buf.ctypes.data, buf.nbytes)])
        e2.register([Region(buf.ctypes.data, buf.nbytes // 2)])
        with peer() as p:
            s2 = e2.connect(p.metadata)
            one = arrays([buf.ctypes.data], [p.regions[0][0]], [4096])
            e1.close()  # e2 keeps the shared engine (and its own registration) alive
            e2.read_batch(s2, *one)
            out["after_e1_closed"] = bool(np.array_equal(buf[:4096], p.expected(0)[:4096]))
            out["e2_outside_own_registration"] = error(lambda: e2.read_batch(s2, *arrays([buf.ctypes.data + buf.nbytes // 2], [p.regions[0][0]], [4096])))
            e2.close()
            e3 = engine("decode")  # a decode engine may start again after the last close
            e3.register([Region(buf.ctypes.data, buf.nbytes)])
            buf[:] = 0
            e3.read_batch(e3.connect(p.metadata), *one)
            out["reinit_reads"] = bool(np.array_equal(buf[:4096], p.expected(0)[:4096]))
            e3.close()
        """
    )
    assert out["same_session"]
    kind, text = out["other_role"]
    assert kind == "ConfigError" and "role" in text and "role=decode" in text and "role=prefill" in text
    kind, text = out["other_device"]
    assert kind == "ConfigError" and "device_id" in text and "device_id=3" in text
    assert out["npu_region"][0] == "TransferError" and "host memory only" in out["npu_region"][1]
    assert "npu:0 memory" in out["npu_region"][1] and "memfabric" in out["npu_region"][1]
    assert out["after_e1_closed"]
    assert out["e2_outside_own_registration"][0] == "RegionError"
    assert out["reinit_reads"]


def test_prefill_side_cannot_read_nor_restart_in_process() -> None:
    out = scenario(
        """
        buf = np.ones(1 << 20, dtype=np.uint8)
        p = engine("prefill")
        meta = p.register([Region(buf.ctypes.data, buf.nbytes)])
        out = {"connect": error(lambda: p.connect(meta))}
        p.close()
        p.close()
        out["restart"] = error(lambda: engine("prefill"))
        """
    )
    assert out["connect"][0] == "TransferError" and "decode" in out["connect"][1]
    kind, text = out["restart"]
    assert kind == "BackendUnavailableError" and "new process" in text


def test_stalled_peer_times_out_and_its_session_refuses_reads() -> None:
    out = scenario(
        """
        dst = np.zeros(4 << 20, dtype=np.uint8)
        e = engine("decode", timeout=2.0)
        e.register([Region(dst.ctypes.data, dst.nbytes)])
        with peer() as p:
            s = e.connect(p.metadata)
            n, blk = 64, 64 << 10
            batch = arrays(dst.ctypes.data + np.arange(n) * blk, p.regions[0][0] + np.arange(n) * blk, [blk] * n)
            e.read_batch(s, *batch)
            stop(p.pid)
            t = time.monotonic()
            first = error(lambda: e.read_batch(s, *batch))
            took = time.monotonic() - t
            t = time.monotonic()
            again = error(lambda: e.read_batch(s, *batch))
            again_took = time.monotonic() - t
            os.kill(p.pid, signal.SIGCONT)
            s2 = e.connect(p.metadata)  # a new session to the resumed peer works
            dst[:] = 0
            e.read_batch(s2, *batch)
            resumed = bool(np.array_equal(dst[: n * blk], p.expected(0)[: n * blk]))
        t = time.monotonic()
        e.close()
        from rd2h_memfabric import _native
        out = {"first": first, "took": took, "again": again, "again_took": again_took,
               "resumed": resumed, "close_took": time.monotonic() - t, "wedged": _native._wedged}
        """
    )
    assert out["first"][0] == "TransferTimeout", out
    assert 1.9 < out["took"] < 4.0, out
    assert out["again"][0] == "PeerGoneError" and out["again_took"] < 0.5, out
    assert out["resumed"], out
    assert out["close_took"] < 20 and not out["wedged"], out


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_close_after_peer_is_gone_is_bounded(how: str) -> None:
    out = scenario(
        f"""
        dst = np.zeros(1 << 20, dtype=np.uint8)
        e = engine("decode")
        e.register([Region(dst.ctypes.data, dst.nbytes)])
        p = peer()
        s = e.connect(p.metadata)
        e.read_batch(s, *arrays([dst.ctypes.data], [p.regions[0][0]], [4096]))
        p.kill() if "{how}" == "kill" else p.close()
        gone = error(lambda: e.read_batch(s, *arrays([dst.ctypes.data], [p.regions[0][0]], [4096])))
        t = time.monotonic()
        e.close()
        out = {{"gone": gone, "close_took": time.monotonic() - t}}
        """
    )
    assert out["gone"][0] == "PeerGoneError", out
    assert out["close_took"] < 16, out  # CLOSE_GRACE_S, then the engine is given up on


def test_a_call_stuck_past_close_wedges_the_process_not_the_caller() -> None:
    out = scenario(
        """
        dst = np.zeros(1 << 20, dtype=np.uint8)
        e = engine("decode", timeout=2.0)
        e.register([Region(dst.ctypes.data, dst.nbytes)])
        with peer() as p:
            s = e.connect(p.metadata)
            one = arrays([dst.ctypes.data], [p.regions[0][0]], [4096])
            e.read_batch(s, *one)
            stop(p.pid)
            first = error(lambda: e.read_batch(s, *one))
            t = time.monotonic()
            e.close()  # the stuck read is still inside memfabric: close gives up after its grace
            close_took = time.monotonic() - t
            again = error(lambda: engine("decode"))
            os.kill(p.pid, signal.SIGCONT)
        out = {"first": first, "close_took": close_took, "again": again}
        """
    )
    assert out["first"][0] == "TransferTimeout", out
    assert 14 < out["close_took"] < 18, out  # CLOSE_GRACE_S
    kind, text = out["again"]
    assert kind == "TransferError" and "restart the process" in text, out
