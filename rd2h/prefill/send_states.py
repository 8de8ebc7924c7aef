"""States and transition tables of the Prefill send tracker (pure).

Requests (``RequestState``)::

    ACTIVE --final chunk announced on the last layer--> FINAL --quiet--> DONE
    ACTIVE/FINAL --a failure--> FAILING --quiet--> FAILED
    ACTIVE/FINAL --abort--> ABORTING --quiet--> ABORTED

"Quiet" means no readiness naming the request is unanswered by any endpoint: Decode may
still be reading its blocks until then, and the caller frees them once it is reported.
FAILING and ABORTING requests are announced no more. Each request reaches one of DONE,
FAILED, ABORTED exactly once, as an :class:`~rd2h.outcome.Outcome` handed out once
(``take``/``collect``); then no state of it is left and its id may be added again.
In-flight readiness names request *instances*, never ids, so a late reply about an
earlier request can never touch a later one with the same id.

Endpoints (``EndpointState``)::

    NEW --send (mf_meta first)--> INTRODUCED
    NEW/INTRODUCED --META_REQUIRED--> REVIVED --everything in flight sent again (mf_meta first)--> REINTRODUCED
    NEW/INTRODUCED/REINTRODUCED --oldest readiness unanswered past reply_timeout--> SILENT
    NEW/INTRODUCED/REVIVED/REINTRODUCED --the channel dropped its connection--> REVIVED
    SILENT --a new request names it--> REVIVED --send (mf_meta first)--> REINTRODUCED
    REINTRODUCED --every mf_meta acknowledged--> INTRODUCED

A SILENT endpoint's readiness counts as answered, the requests naming it fail with
:class:`~rd2h.errors.ReplyTimeout` and the connection is dropped. A connection the channel
dropped (its frames waited past the send timeout) took every readiness in flight there with
it: each counts as answered and its requests fail with the channel's error; a SILENT endpoint
stays so. After a revival (or a lost connection), replies that come before Decode
acknowledges the new mf_meta answer abandoned readiness (the dialer keeps its identity
across reconnects) and are dropped as stale. So are those after
META_REQUIRED: a Decode that restarted while Prefill still wrote to its old connection lost
what was written there and answers the rest META_REQUIRED, in order; as a reply is paired
with the oldest readiness of its layer, every readiness in flight is sent again.
"""

from __future__ import annotations

from enum import Enum

from rd2h.outcome import TerminalState

__all__ = [
    "RequestState",
    "RequestEvent",
    "REQUEST_TRANSITIONS",
    "ANNOUNCED",
    "DRAINING",
    "TERMINAL",
    "EndpointState",
    "EndpointEvent",
    "ENDPOINT_TRANSITIONS",
    "NEEDS_META",
    "STALE",
]


class RequestState(Enum):
    ACTIVE = "active"  # announced step by step
    FINAL = "final"  # its final chunk went out on the last layer; replies pending
    FAILING = "failing"  # failed; waits until no readiness naming it is unanswered
    ABORTING = "aborting"  # aborted by the caller; waits likewise
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class RequestEvent(Enum):
    FINAL_SENT = "final chunk announced on the last layer"
    FAIL = "fail"
    ABORT = "abort"
    QUIET = "no readiness unanswered"


_R, _RE = RequestState, RequestEvent
REQUEST_TRANSITIONS = {
    (_R.ACTIVE, _RE.FINAL_SENT): _R.FINAL,
    (_R.ACTIVE, _RE.FAIL): _R.FAILING,
    (_R.FINAL, _RE.FAIL): _R.FAILING,
    (_R.FAILING, _RE.FAIL): _R.FAILING,  # the first error stays
    (_R.ABORTING, _RE.FAIL): _R.ABORTING,
    (_R.ACTIVE, _RE.ABORT): _R.ABORTING,
    (_R.FINAL, _RE.ABORT): _R.ABORTING,
    (_R.FAILING, _RE.ABORT): _R.FAILING,
    (_R.ABORTING, _RE.ABORT): _R.ABORTING,
    (_R.FINAL, _RE.QUIET): _R.DONE,
    (_R.FAILING, _RE.QUIET): _R.FAILED,
    (_R.ABORTING, _RE.QUIET): _R.ABORTED,
}
ANNOUNCED = frozenset({_R.ACTIVE, _R.FINAL})  # still named in readiness
DRAINING = frozenset({_R.FINAL, _R.FAILING, _R.ABORTING})  # settle once quiet
TERMINAL = {_R.DONE: TerminalState.DONE, _R.FAILED: TerminalState.FAILED, _R.ABORTED: TerminalState.ABORTED}


class EndpointState(Enum):
    NEW = "new"  # no mf_meta sent on this connection
    INTRODUCED = "introduced"
    SILENT = "silent"  # abandoned after reply_timeout; skipped until revived
    REVIVED = "revived"  # named again after silence, or META_REQUIRED; no mf_meta sent on the new connection yet
    REINTRODUCED = "reintroduced"  # mf_meta sent again; replies before its ACK are stale


class EndpointEvent(Enum):
    SEND = "send readiness"
    ACKED = "every mf_meta acknowledged"
    META_REQUIRED = "mf_meta required"
    SEND_FAILED = "send failed"
    TIMEOUT = "reply timeout"
    REVIVE = "named by a new request"
    CONNECTION_LOST = "the channel dropped its connection"


_E, _EE = EndpointState, EndpointEvent
ENDPOINT_TRANSITIONS = {
    (_E.NEW, _EE.SEND): _E.INTRODUCED,
    (_E.INTRODUCED, _EE.SEND): _E.INTRODUCED,
    (_E.REVIVED, _EE.SEND): _E.REINTRODUCED,
    (_E.REINTRODUCED, _EE.SEND): _E.REINTRODUCED,
    (_E.REINTRODUCED, _EE.ACKED): _E.INTRODUCED,
    (_E.NEW, _EE.META_REQUIRED): _E.REVIVED,
    (_E.INTRODUCED, _EE.META_REQUIRED): _E.REVIVED,
    (_E.NEW, _EE.SEND_FAILED): _E.NEW,
    (_E.INTRODUCED, _EE.SEND_FAILED): _E.NEW,
    (_E.REVIVED, _EE.SEND_FAILED): _E.REVIVED,
    (_E.REINTRODUCED, _EE.SEND_FAILED): _E.REVIVED,
    (_E.NEW, _EE.TIMEOUT): _E.SILENT,
    (_E.INTRODUCED, _EE.TIMEOUT): _E.SILENT,
    (_E.REINTRODUCED, _EE.TIMEOUT): _E.SILENT,
    (_E.REVIVED, _EE.TIMEOUT): _E.SILENT,  # a resend failed (REINTRODUCED -> REVIVED), older readiness unanswered
    (_E.SILENT, _EE.REVIVE): _E.REVIVED,
    (_E.NEW, _EE.REVIVE): _E.NEW,
    (_E.INTRODUCED, _EE.REVIVE): _E.INTRODUCED,
    (_E.REVIVED, _EE.REVIVE): _E.REVIVED,
    (_E.REINTRODUCED, _EE.REVIVE): _E.REINTRODUCED,
    (_E.NEW, _EE.CONNECTION_LOST): _E.REVIVED,
    (_E.INTRODUCED, _EE.CONNECTION_LOST): _E.REVIVED,
    (_E.REVIVED, _EE.CONNECTION_LOST): _E.REVIVED,
    (_E.REINTRODUCED, _EE.CONNECTION_LOST): _E.REVIVED,
    (_E.SILENT, _EE.CONNECTION_LOST): _E.SILENT,
}
NEEDS_META = frozenset({_E.NEW, _E.REVIVED})
# A dialer keeps its identity across reconnects (zmq's ROUTER_HANDOVER), so a Decode that was
# only slow still answers readiness abandoned with the old connection; it answers in order,
# so everything before the ACK of the mf_meta sent on the new connection is such a reply.
STALE = frozenset({_E.REVIVED, _E.REINTRODUCED})
