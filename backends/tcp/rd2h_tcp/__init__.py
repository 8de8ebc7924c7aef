"""rd2h-tcp: a control channel over plain sockets (entry point ``rd2h.control_channels: tcp``).

Decode's listener serves every Prefill peer from one ``epoll`` on the thread that calls
``recv`` (Decode's loop); a Prefill's dialer writes on the calling thread. No I/O thread on
either side: a frame costs one ``send`` and one ``recv`` system call. Frames are
length-prefixed; both ends speak rd2h only (use ``zmq`` for reference peers or CurveZMQ).
See ``TcpChannel`` for the options.
"""

from rd2h_tcp.channel import TcpChannel
from rd2h_tcp.dialer import TcpDialer
from rd2h_tcp.listener import TcpListener

__all__ = ["TcpChannel", "TcpListener", "TcpDialer"]
__version__ = "0.1.0"
