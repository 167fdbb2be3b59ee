"""A worker's KV-event publisher in a process of its own (so its send queue is not the test's memory):
vLLM's framing on an XPUB, a ROUTER replay answering from a buffer it rebuilds per seq (large
batches, nothing held). A line "publish N" on stdin publishes N batches as fast as it can (dropped
past its send queue, as a PUB does) and answers how many it has published; EOF ends it.

:func:`script` is the program: the test gives the part that says what a batch holds.
"""

from __future__ import annotations

_HEAD = r"""
import sys, threading, time, msgpack, zmq
ctx = zmq.Context()
pub, replay = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
pub.setsockopt(zmq.SNDHWM, 200)  # the worker's own send queue: past it, its PUB drops
for s in (pub, replay):
    s.setsockopt(zmq.LINGER, 0)
    s.bind("tcp://127.0.0.1:0")
sent = 0
lock = threading.Lock()
"""

_TAIL = r"""
def serve():
    while True:
        ident, _, start8 = replay.recv_multipart()
        with lock:
            last = sent
        for seq in range(int.from_bytes(start8, "big"), last):
            replay.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"), payload(seq)])
        replay.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
print(pub.getsockopt_string(zmq.LAST_ENDPOINT), replay.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
pub.recv()  # the subscription
threading.Thread(target=serve, daemon=True).start()
for line in sys.stdin:
    for _ in range(int(line.split()[1])):
        with lock:
            seq = sent
            numbered(seq)
            sent += 1
        pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload(seq)])
    print(sent, flush=True)
"""


def script(batches: str) -> str:
    """The publisher's program; ``batches`` is Python source that defines ``TOPIC`` (bytes),
    ``payload(seq)`` (the msgpack batch of that seq, the same each time it is asked for) and
    ``numbered(seq)`` (called as each batch is numbered, before it is sent)."""
    return _HEAD + batches + _TAIL
