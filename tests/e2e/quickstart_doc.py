"""The quick start's commands as docs/vllm.md writes them: each fenced ``bash`` block that
follows a ``<!-- quickstart: NAME -->`` line. ``setup`` runs once, ``env`` in every terminal
(before each other block), ``prefill``, ``decode`` and ``proxy`` each in a terminal of its
own (they serve until stopped), ``client`` sends a request. README.md shows some of the same
blocks under the same markers."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm.md"
README = ROOT / "README.md"
NAMES = ("setup", "env", "prefill", "decode", "proxy", "client")
_BLOCK = re.compile(r"^<!-- quickstart: (\w+) -->\n```bash\n(.*?)^```$", re.M | re.S)


def blocks(path: Path = DOC) -> dict[str, str]:
    """Marker name -> the block's text; a name marked twice is an error (which one ran?)."""
    found: dict[str, str] = {}
    for name, text in _BLOCK.findall(path.read_text()):
        if name in found:
            raise ValueError(f"{path.name}: two blocks marked quickstart: {name}")
        found[name] = text
    return found


def exported(env_block: str) -> dict[str, str]:
    """The ``VAR=value`` pairs of the env block's ``export`` lines whose value is a literal."""
    values = {}
    for line in env_block.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            for word in words[1:]:
                name, equals, value = word.partition("=")
                if equals and re.fullmatch(r"[A-Za-z_]\w*", name) and "$" not in value:
                    values[name] = value
    return values


def ports(text: str) -> list[int]:
    """The TCP ports the blocks name (``--port N``, ``--rendezvous-port N``, ``host:N``)."""
    found = re.findall(r"(?:--(?:rendezvous-)?port[ =]|127\.0\.0\.1:|localhost:)(\d{2,5})\b", text)
    return sorted({int(p) for p in found})
