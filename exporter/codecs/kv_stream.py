"""The relay's JetStream layout, shared by the relay (writer) and the NATS source (reader).

One stream (``PREFIXSCOPE_KV`` by default) holds every relayed worker's KV-event batches, one
subject per worker: ``<prefix>.<worker>`` with the worker name percent-encoded outside
``[A-Za-z0-9_-]`` (NATS subject tokens cannot hold ``.``, ``*``, ``>`` or spaces; Dynamo encodes
its subjects the same way). A message's data is the worker's msgpack payload, byte for byte;
its headers say whose it is and where it sits in the worker's own sequence:

- ``Prefixscope-Worker``: the worker name (also in the subject);
- ``Prefixscope-Seq``: vLLM's batch sequence number (decimal);
- ``Prefixscope-Topic``: the ZMQ topic frame, when not empty;
- ``Prefixscope-Restart: 1``: the relay saw the worker restart before this batch;
- ``Nats-Msg-Id``: ``<worker>:<seq>:<payload digest>``, so a publish the relay retries after a
  lost acknowledgement is stored once (JetStream drops a repeat within its duplicate window).
"""

from __future__ import annotations

from hashlib import blake2b
from urllib.parse import quote, unquote

DEFAULT_STREAM = "PREFIXSCOPE_KV"
DEFAULT_PREFIX = "prefixscope.kv"
H_WORKER = "Prefixscope-Worker"
H_SEQ = "Prefixscope-Seq"
H_TOPIC = "Prefixscope-Topic"
H_RESTART = "Prefixscope-Restart"
H_MSG_ID = "Nats-Msg-Id"
_SAFE = "-_"  # besides ASCII letters and digits


def subject_for(prefix: str, worker: str) -> str:
    """The subject of one worker's batches."""
    return f"{prefix}.{quote(worker, safe=_SAFE).replace('.', '%2E')}"


def worker_from_subject(prefix: str, subject: str) -> str | None:
    """The worker a subject names, or None when it is not under ``prefix``."""
    head = prefix + "."
    if not subject.startswith(head) or len(subject) == len(head):
        return None
    return unquote(subject[len(head):])


def message_id(worker: str, seq: int, payload: bytes) -> str:
    return f"{worker}:{seq}:{blake2b(payload, digest_size=8).hexdigest()}"


def headers_for(worker: str, seq: int, payload: bytes, topic: bytes = b"", restart: bool = False) -> dict[str, str]:
    h = {H_WORKER: worker, H_SEQ: str(seq), H_MSG_ID: message_id(worker, seq, payload)}
    if topic:
        h[H_TOPIC] = topic.decode("utf-8", "replace")
    if restart:
        h[H_RESTART] = "1"
    return h
