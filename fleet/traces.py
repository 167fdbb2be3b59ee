"""Mooncake-format traces (kvcache-ai/Mooncake FAST'25): parsing and replay as requests.

One JSON object per line: ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and
``hash_ids``, one id per block of the trace's block size (512 for Mooncake), the last block
holding the remainder. A block id stands in for a chained block hash (a repeated id is always
preceded by the same ids), so the ids of the *full* blocks are the request's block hashes; the
partial last block is never cached, as in vLLM.

Bad lines are skipped, counted and reported (``line N: problem``); the rest of the trace is kept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fleet.workloads import SimRequest

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float  # seconds since the first request of the trace
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_mooncake(lines: Iterable[str | bytes], block_size: int = MOONCAKE_BLOCK_SIZE
                   ) -> tuple[list[TraceRequest], list[str]]:
    """Parse trace lines; returns (requests in file order, one error string per bad line)."""
    out: list[TraceRequest] = []
    errors: list[str] = []
    t0: float | None = None
    for n, raw in enumerate(lines, 1):
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"line {n}: not JSON ({exc.msg})")
            continue
        if not isinstance(d, dict):
            errors.append(f"line {n}: must be a JSON object")
            continue
        ts, n_in, n_out, ids = d.get("timestamp"), d.get("input_length"), d.get("output_length"), d.get("hash_ids")
        if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
            errors.append(f"line {n}: timestamp must be a number of milliseconds ≥ 0, got {ts!r}")
            continue
        if not _int(n_in) or n_in == 0 or not _int(n_out):
            errors.append(f"line {n}: input_length must be a positive integer and output_length an integer ≥ 0")
            continue
        if not isinstance(ids, list) or not all(_int(h) and h < 2**64 for h in ids):
            errors.append(f"line {n}: hash_ids must be a list of unsigned 64-bit integers")
            continue
        expected = math.ceil(n_in / block_size)
        if len(ids) != expected:
            errors.append(f"line {n}: hash_ids has {len(ids)} ids for input_length {n_in} "
                          f"(expected {expected} blocks of {block_size})")
            continue
        if t0 is None:
            t0 = float(ts)
        out.append(TraceRequest((float(ts) - t0) / 1000.0, n_in, n_out, tuple(ids)))
    return out, errors


def load_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> tuple[list[TraceRequest], list[str]]:
    with Path(path).open("rb") as fh:
        return parse_mooncake(fh, block_size)


def replay_requests(trace: Iterable[TraceRequest], block_size: int = MOONCAKE_BLOCK_SIZE,
                    time_scale: float = 1.0) -> Iterator[SimRequest]:
    """The trace as simulation requests (keyless: Mooncake traces carry no session ids)."""
    for i, tr in enumerate(trace, 1):
        full = tr.input_length // block_size
        yield SimRequest(t=tr.t * time_scale, request_id=f"trace-{i:06d}", session_key=None,
                         conversation=f"trace-{i:06d}", turn=1, prompt_tokens=tr.input_length,
                         block_hashes=list(tr.hash_ids[:full]), output_tokens=max(1, tr.output_length),
                         segment=None, kind="trace", block_size=block_size)
