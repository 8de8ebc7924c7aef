"""DecodeEndpoint's text and bytes forms: what a rendezvous passes from Decode to Prefill."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h.errors import ConfigError, PortError
from rd2h.wire.endpoint import DecodeEndpoint

HOSTS = st.one_of(
    st.from_regex(r"[a-z0-9][a-z0-9.-]{0,30}", fullmatch=True),
    st.ip_addresses().map(str),
)
ENDPOINTS = st.builds(DecodeEndpoint, HOSTS, st.integers(1, 65535), st.integers(1, 64))


@given(ENDPOINTS)
def test_text_and_bytes_round_trip(endpoint: DecodeEndpoint) -> None:
    assert DecodeEndpoint.parse(str(endpoint)) == endpoint
    assert DecodeEndpoint.from_bytes(endpoint.to_bytes()) == endpoint


def test_forms() -> None:
    assert str(DecodeEndpoint("decode-0.svc", 5600, 2)) == "decode-0.svc:5600/2"
    v6 = DecodeEndpoint("::1", 5600, 4)
    assert str(v6) == "[::1]:5600/4" and v6.address(3) == "tcp://[::1]:5603"
    assert DecodeEndpoint.parse("[fe80::1%eth0]:80/1").host == "fe80::1%eth0"
    assert DecodeEndpoint("10.0.0.2", 5600, 2).address(1) == "tcp://10.0.0.2:5601"
    with pytest.raises(PortError):
        DecodeEndpoint("h", 65535, 2).address(1)


@pytest.mark.parametrize(
    "text",
    ["", "host", "host:5600", "host:5600/", "host:0/1", "host:70000/1", "host:5600/0", ":5600/1",
     "::1:5600/1", "[host]:5600/1", "host:5600/1 ", "h/st:1/1", "host:-1/1", "host:5600/1/2"],
)
def test_bad_text_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        DecodeEndpoint.parse(text)


def test_bad_values_are_config_errors() -> None:
    for args in (("", 1, 1), ("h", 0, 1), ("h", 1, 0), ("h", True, 1), ("a b", 1, 1), (5, 1, 1)):
        with pytest.raises(ConfigError):
            DecodeEndpoint(*args)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        DecodeEndpoint.from_bytes("host:1/1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        DecodeEndpoint.from_bytes(b"h\xffst:1/1")
