#!/usr/bin/env python3
"""Turn a gateway's JSON access log into prefixscope.request/v1 records.

Neither sglang-router nor vllm-router tells which prompt tokens a request found cached, which
session it belongs to, or how long its prefill took: those signals need request records. A
gateway in front of the router (or the router's own access log, where it can log the upstream)
usually can: it sees the chosen upstream and the OpenAI response, whose
``usage.prompt_tokens_details.cached_tokens`` is the engine's own count of cached prompt tokens.

Input: one JSON object per line (files, or stdin with ``-``). Where each value sits is given as a
dotted path (``--field cached_tokens=resp.usage.prompt_tokens_details.cached_tokens``); the
defaults are shown by ``--help``. Output: NDJSON on stdout, or POSTed in batches to the
exporter's ``/api/v1/records`` with ``--url`` (and ``--token`` when it requires one).

A line that cannot be turned into a record is skipped and counted; the first line of each kind of
problem is reported on stderr with its line number. An optional value the log does not carry is
left out, never written as 0, so prefixscope reports that signal as not instrumented.
Standard library only: copy this file next to the gateway and run it there.

    tail -F /var/log/gateway/access.json | python3 records-from-access-log.py - \\
        --url http://127.0.0.1:9400/api/v1/records --worker-name 10.0.0.5:8000=w0
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, TextIO

SCHEMA = "prefixscope.request/v1"
# record field -> dotted path in the access-log entry
DEFAULT_FIELDS = {
    "ts": "time",
    "request_id": "request_id",
    "worker": "upstream",
    "prompt_tokens": "response.usage.prompt_tokens",
    "cached_tokens": "response.usage.prompt_tokens_details.cached_tokens",
    "model": "response.model",
    "session_key": "session_id",
    "output_tokens": "response.usage.completion_tokens",
    "ttft_s": "ttft_s",
    "prefill_s": "prefill_s",
    "queue_s": "queue_s",
}
REQUIRED = ("ts", "request_id", "worker", "prompt_tokens")
INTEGERS = ("prompt_tokens", "cached_tokens", "output_tokens")
STRINGS = ("request_id", "model", "session_key")


class SkipLine(ValueError):
    """This line gives no record; ``kind`` groups the problem for counting."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def lookup(entry: Any, path: str) -> Any:
    """The value at a dotted path, or None when any step is missing."""
    for part in path.split("."):
        if not isinstance(entry, dict):
            return None
        entry = entry.get(part)
    return entry


def upstream_key(address: str) -> str:
    """``http://10.0.0.5:8000/`` and ``10.0.0.5:8000`` name the same upstream."""
    key = address.strip().lower().rstrip("/")
    for scheme in ("http://", "https://"):
        key = key.removeprefix(scheme)
    return key


def parse_ts(value: Any) -> float:
    """Unix seconds from a number, a numeric string or an ISO 8601 time (``Z`` allowed)."""
    if isinstance(value, bool):
        raise ValueError(f"not a time: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        try:
            stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"not a time: {value!r}") from None
        if stamp.tzinfo is None:
            raise ValueError(f"time without a zone: {value!r}")
        return stamp.timestamp()
    raise ValueError(f"not a time: {value!r}")


def to_record(entry: Any, fields: dict[str, str], workers: dict[str, str]) -> dict[str, Any]:
    """One access-log entry → one record; raises SkipLine naming the problem."""
    if not isinstance(entry, dict):
        raise SkipLine("not_an_object", f"expected a JSON object, got {type(entry).__name__}")
    got = {name: lookup(entry, path) for name, path in fields.items()}
    for name in REQUIRED:
        if got.get(name) in (None, ""):
            raise SkipLine(f"missing_{name}", f"no {name} at {fields[name]!r}")
    rec: dict[str, Any] = {"schema": SCHEMA}
    try:
        rec["ts"] = parse_ts(got["ts"])
    except ValueError as exc:
        raise SkipLine("bad_ts", str(exc)) from None
    worker = str(got["worker"])
    rec["worker"] = workers.get(upstream_key(worker), worker)
    for name, value in got.items():
        if value is None or name in ("ts", "worker"):
            continue
        if name in INTEGERS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SkipLine(f"bad_{name}", f"{name} must be a non-negative integer, got {value!r}")
        elif name in STRINGS:
            value = str(value)
        elif isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise SkipLine(f"bad_{name}", f"{name} must be a non-negative number, got {value!r}")
        rec[name] = value
    if rec.get("cached_tokens", 0) > rec["prompt_tokens"]:
        raise SkipLine("bad_cached_tokens", f"cached_tokens {rec['cached_tokens']} > prompt_tokens {rec['prompt_tokens']}")
    return rec


def convert(lines: Iterable[str], fields: dict[str, str], workers: dict[str, str],
            skipped: Counter[str], err: TextIO) -> Iterator[dict[str, Any]]:
    """Records from access-log lines; skipped lines are counted, the first of each kind reported."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SkipLine("not_json", f"not JSON: {exc.msg}") from None
            yield to_record(entry, fields, workers)
        except SkipLine as exc:
            if not skipped[exc.kind]:
                print(f"records-from-access-log: line {number}: {exc} (further lines like this are only counted)",
                      file=err)
            skipped[exc.kind] += 1


def post(url: str, records: list[dict[str, Any]], token: str | None, timeout: float) -> dict[str, Any]:
    body = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/x-ndjson"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        key, sep, val = v.partition("=")
        if not sep or not key or not val:
            raise SystemExit(f"records-from-access-log: {what} must look like KEY=VALUE, got {v!r}")
        out[key] = val
    return out


def _lines(paths: list[str]) -> Iterator[str]:
    for path in paths:
        if path == "-":
            yield from sys.stdin
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield from f


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="records-from-access-log",
        description="Turn a JSON access log into prefixscope.request/v1 NDJSON (stdout) or POST it to the exporter.")
    parser.add_argument("logs", nargs="*", default=["-"], help="access-log files; - (the default) reads stdin")
    parser.add_argument("--field", action="append", default=[], metavar="RECORD_FIELD=PATH",
                        help="where a record field sits in a log entry, as a dotted path; defaults: "
                             + ", ".join(f"{k}={v}" for k, v in DEFAULT_FIELDS.items()))
    parser.add_argument("--worker-name", action="append", default=[], metavar="UPSTREAM=NAME",
                        help="name an upstream address as the exporter's config names the worker (repeatable)")
    parser.add_argument("--url", help="the exporter's /api/v1/records; without it, NDJSON goes to stdout")
    parser.add_argument("--token", help="bearer token the exporter requires")
    parser.add_argument("--token-file", help="read the bearer token from this file (keeps it out of the process list)")
    parser.add_argument("--batch", type=int, default=500, help="records per POST (default 500)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per POST (default 10)")
    args = parser.parse_args(argv)
    fields = {**DEFAULT_FIELDS, **_pairs(args.field, "--field")}
    unknown = sorted(set(fields) - set(DEFAULT_FIELDS))
    if unknown:
        parser.error(f"unknown record field(s) {', '.join(unknown)}; known: {', '.join(DEFAULT_FIELDS)}")
    workers = {upstream_key(k): v for k, v in _pairs(args.worker_name, "--worker-name").items()}
    if args.token_file:
        if args.token:
            parser.error("give --token or --token-file, not both")
        with open(args.token_file, encoding="utf-8") as f:
            args.token = f.read().strip()

    skipped: Counter[str] = Counter()
    written = accepted = rejected = 0
    batch: list[dict[str, Any]] = []

    def flush() -> None:
        nonlocal accepted, rejected
        if batch:
            answer = post(args.url, batch, args.token, args.timeout)["data"]
            accepted += answer["accepted"]
            rejected += answer["rejected"]
            batch.clear()

    try:
        for rec in convert(_lines(args.logs), fields, workers, skipped, sys.stderr):
            written += 1
            if args.url is None:
                sys.stdout.write(json.dumps(rec, separators=(",", ":")) + "\n")
                continue
            batch.append(rec)
            if len(batch) >= args.batch:
                flush()
        if args.url is not None:
            flush()
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        print(f"records-from-access-log: cannot deliver to {args.url}: {exc}", file=sys.stderr)
        return 1
    summary = f"{written} records"
    if args.url is not None:
        summary += f", {accepted} accepted and {rejected} rejected by the exporter"
    if skipped:
        summary += f"; skipped lines: {', '.join(f'{k} {n}' for k, n in sorted(skipped.items()))}"
    print(f"records-from-access-log: {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
