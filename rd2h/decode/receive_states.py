"""States and transition table of Decode's receive tracker (pure), and its per-request and
per-peer records; the tracker itself is :mod:`rd2h.decode.receive_tracker`.

Per request::

    WAITING --read--> RECEIVING --all contributors final and covered--> CONFIRMING
       |                 |                                                   |
       |                 +--(only peers that never confirm)--> DONE <--confirmed--+
       |
       +--fail/deadline/peer gone/Prefill failed it--> FAILED  (from any live state)
       +--abort--> ABORTED  (from WAITING and RECEIVING; in CONFIRMING an abort changes nothing)

CONFIRMING waits for each contributor that speaks rd2h protocol 4 to say the request ended
DONE on its side (``settled``): it says so only after it got Decode's reply to the final
layer, so a Prefill that gave up on a slow Decode never sees that Decode report DONE.
Once that reply said READ_DONE, Prefill reports the request DONE whatever Decode's caller
does next; an abort then would leave Decode ABORTED against Prefill's DONE, so it is a
no-op and the request ends as Prefill confirms it. A terminal state absorbs every later
event (the first reason is kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from rd2h.decode.completeness import Coverage
from rd2h.decode.rank_reads import Destinations
from rd2h.errors import RD2HError
from rd2h.outcome import TerminalState
from rd2h.statemachine import step

__all__ = ["ReceiveState", "ReceiveEvent", "TRANSITIONS", "TERMINAL", "RequestRecord", "PeerState", "PeerRecord"]


# -- per-request state ------------------------------------------------------------------------


class ReceiveState(Enum):
    WAITING = "waiting"  # expected: destinations known, nothing read yet
    RECEIVING = "receiving"  # some layer read
    CONFIRMING = "confirming"  # every byte read; waits for the contributors to confirm
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class ReceiveEvent(Enum):
    READ = "a layer read"
    COMPLETE = "every contributor final and covered"
    READ_ALL = "every contributor final and covered, some yet to confirm"
    CONFIRMED = "every contributor confirmed"
    FAIL = "a failure"
    ABORT = "abort"


_S, _E = ReceiveState, ReceiveEvent
TRANSITIONS = {
    (_S.WAITING, _E.READ): _S.RECEIVING,
    (_S.WAITING, _E.COMPLETE): _S.DONE,
    (_S.WAITING, _E.READ_ALL): _S.CONFIRMING,
    (_S.WAITING, _E.FAIL): _S.FAILED,
    (_S.WAITING, _E.ABORT): _S.ABORTED,
    (_S.RECEIVING, _E.READ): _S.RECEIVING,
    (_S.RECEIVING, _E.COMPLETE): _S.DONE,
    (_S.RECEIVING, _E.READ_ALL): _S.CONFIRMING,
    (_S.CONFIRMING, _E.CONFIRMED): _S.DONE,
    (_S.CONFIRMING, _E.FAIL): _S.FAILED,
    (_S.CONFIRMING, _E.ABORT): _S.CONFIRMING,  # the final layer was answered READ_DONE: see above
    (_S.RECEIVING, _E.FAIL): _S.FAILED,
    (_S.RECEIVING, _E.ABORT): _S.ABORTED,
    # terminal states absorb whatever is still in flight; the first outcome stands
    **{(s, e): s for s in (_S.DONE, _S.FAILED, _S.ABORTED) for e in _E},
}
TERMINAL = {_S.DONE: TerminalState.DONE, _S.FAILED: TerminalState.FAILED, _S.ABORTED: TerminalState.ABORTED}
_ENDED = tuple(TERMINAL)


@dataclass(slots=True, eq=False)
class RequestRecord:
    ext_id: str
    destinations: Destinations
    written: Destinations  # what it writes, from its first block on (held while it lives): not a cached prefix
    coverage: Coverage
    started: float
    deadline: float | None
    state: ReceiveState = ReceiveState.WAITING
    error: RD2HError | None = None
    ratio: int | None = None  # the contributor group size, from the first readiness
    finals: set[int] = field(default_factory=set)  # members whose final signal was believed
    # member -> this rank's layers its believed finals cover: all of them from a peer that is no
    # pipeline stage; a stage's final covers its own (the member is complete once they add up)
    final_layers: dict[int, frozenset[str]] = field(default_factory=dict)
    peers: set[bytes] = field(default_factory=set)  # identities that announced it
    unconfirmed: set[bytes] = field(default_factory=set)  # final contributors yet to confirm
    nbytes: int = 0
    reading: bool = False  # a read may be writing its destinations now
    serial: int = 0  # tells this request apart from an earlier one of the same id
    expected_peer: str | None = None  # the only Prefill identity that may announce it

    def apply(self, event: ReceiveEvent, error: RD2HError | None = None) -> None:
        new = step(TRANSITIONS, self.state, event, "request %r", self.ext_id)
        if new is ReceiveState.FAILED and self.state is not ReceiveState.FAILED:
            self.error = error
        self.state = new

    @property
    def terminal(self) -> bool:
        return self.state in _ENDED  # a tuple: identity tests, no Enum.__hash__ (in Python) on the hot path


# -- per-peer state ---------------------------------------------------------------------------


class PeerState(Enum):
    ADMITTED = "admitted"  # its mf_meta was accepted: it may announce
    REFUSED = "refused"  # its mf_meta was refused: every readiness fails with the reason


@dataclass(slots=True)
class PeerRecord:
    state: PeerState
    p_session: str
    error: RD2HError | None = None
    proven: frozenset[str] = frozenset()  # identities it proved (engine session id, CURVE key)
    confirms: bool = True  # it sends ``settled`` (rd2h protocol 4); a reference peer does not
    stage: int | None = None  # its pipeline stage (mf_meta's pp_rank), None when it is no stage
    stage_layers: frozenset[str] | None = None  # a stage: the layers of this rank it holds
