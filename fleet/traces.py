"""Mooncake-format traces (kvcache-ai/Mooncake FAST'25): parsing and replay as requests.

One JSON object per line: ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and
``hash_ids``, one id per block of the trace's block size (512 for Mooncake), the last block
holding the remainder (:func:`blocks_for`). A block id stands in for a chained block hash (a
repeated id is always preceded by the same ids).

This is the one reader of the format: the simulator (``prefixscope sim --trace``) and the what-if
replay (``lab.replay``) both parse through :func:`parse_mooncake`. What they do with the partial
last block differs on purpose: the simulator replays the ids of the *full* blocks only
(:func:`replay_requests`; the partial block is never cached, as in vLLM), while the what-if replay
counts the partial block as cacheable, as the trace's published hit share does.

Requests come back in time order (stable: ties keep file order), ``t`` measured from the earliest.
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
    t: float  # seconds since the earliest request of the trace
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0  # 1-based line in the file


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a prompt of ``tokens`` occupies: full blocks, the last one holding the remainder."""
    return math.ceil(tokens / block_size)


def full_blocks(tokens: int, block_size: int) -> int:
    """Blocks of a prompt that are full (the ones an engine like vLLM caches)."""
    return tokens // block_size


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_line(d: object, block_size: int = MOONCAKE_BLOCK_SIZE) -> tuple[float, int, int, tuple[int, ...]]:
    """One decoded trace line → (timestamp ms, input_length, output_length, hash_ids).

    Raises ValueError saying what is wrong with the line.
    """
    if not isinstance(d, dict):
        raise ValueError("must be a JSON object")
    ts, n_in, n_out, ids = d.get("timestamp"), d.get("input_length"), d.get("output_length"), d.get("hash_ids")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
        raise ValueError(f"timestamp must be a number of milliseconds ≥ 0, got {ts!r}")
    if not _int(n_in) or n_in == 0 or not _int(n_out):
        raise ValueError("input_length must be a positive integer and output_length an integer ≥ 0")
    if not isinstance(ids, list) or not all(_int(h) and h < 2**64 for h in ids):
        raise ValueError("hash_ids must be a list of unsigned 64-bit integers")
    expected = blocks_for(n_in, block_size)
    if len(ids) != expected:
        raise ValueError(f"hash_ids has {len(ids)} ids for input_length {n_in} "
                         f"(expected {expected} blocks of {block_size})")
    return float(ts), n_in, n_out, tuple(ids)


def parse_mooncake(lines: Iterable[str | bytes], block_size: int = MOONCAKE_BLOCK_SIZE
                   ) -> tuple[list[TraceRequest], list[str]]:
    """Parse trace lines; returns (requests in time order, one error string per bad line)."""
    rows: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    errors: list[str] = []
    for n, raw in enumerate(lines, 1):
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"line {n}: not JSON ({exc.msg})")
            continue
        try:
            ts, n_in, n_out, ids = _read_line(d, block_size)
        except ValueError as exc:
            errors.append(f"line {n}: {exc}")
            continue
        rows.append((ts, n, n_in, n_out, ids))
    rows.sort(key=lambda r: r[0])  # stable: ties keep file order
    t0 = rows[0][0] if rows else 0.0
    return [TraceRequest((ts - t0) / 1000.0, n_in, n_out, ids, line=n) for ts, n, n_in, n_out, ids in rows], errors


def load_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> tuple[list[TraceRequest], list[str]]:
    with Path(path).open("rb") as fh:
        return parse_mooncake(fh, block_size)


def replay_requests(trace: Iterable[TraceRequest], block_size: int = MOONCAKE_BLOCK_SIZE,
                    time_scale: float = 1.0) -> Iterator[SimRequest]:
    """The trace as simulation requests (keyless: Mooncake traces carry no session ids)."""
    for i, tr in enumerate(trace, 1):
        full = full_blocks(tr.input_length, block_size)
        yield SimRequest(t=tr.t * time_scale, request_id=f"trace-{i:06d}", session_key=None,
                         conversation=f"trace-{i:06d}", turn=1, prompt_tokens=tr.input_length,
                         block_hashes=list(tr.hash_ids[:full]), output_tokens=max(1, tr.output_length),
                         segment=None, kind="trace", block_size=block_size)
