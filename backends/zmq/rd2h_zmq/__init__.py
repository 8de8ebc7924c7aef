"""rd2h-zmq: the ZeroMQ control channel for rd2h (entry point ``rd2h.control_channels: zmq``).

Decode binds a ROUTER per TP rank (``listen``); Prefill connects one DEALER per Decode
endpoint (``dialer``). Optional CurveZMQ authentication admits only clients whose public
key is in an authorized directory. See ``ZmqChannel`` for the options.
"""

from rd2h_zmq.channel import MiB, ZmqChannel
from rd2h_zmq.sockets import ZmqDialer, ZmqListener

__all__ = ["ZmqChannel", "ZmqListener", "ZmqDialer", "MiB"]
__version__ = "0.1.0"
