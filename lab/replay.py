"""``prefixscope replay``: what-if — run a trace through simulated workers, the reference router and
the exporter's state on a virtual clock, and print the five groups keyed by the checklist names.

Trace formats (detected per file from the first valid line):

- Mooncake (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``): one id per
  ``--block-size`` tokens (default 512), the last block holding the remainder; read by the
  simulator's reader, :func:`fleet.traces.parse_mooncake`;
- recorded ``prefixscope.request/v1`` records (``ts``, ``prompt_tokens``, ``block_hashes``, ...).

Hit accounting follows one rule: a block counts as hit when it and every block before it are
resident on the chosen worker at dispatch; hit tokens are the sizes of the hit blocks (a
partial last block counts with its own size). The engine is therefore given whole trace blocks
(its prompt is padded to a whole number of blocks, so a partial block is cached like the rest),
and the exporter's state is fed records and worker counters carrying these hit tokens.
Values the trace cannot feed (e.g. expert signatures, speculative decoding) stay null.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from exporter.bootstrap import bootstrap
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored, KvBatch, KvEvent, WorkerSnapshot
from exporter.sources.records import validate
from exporter.web import api
from fleet.cache import CacheEvent, Cleared, Removed, Stored
from fleet.clock import VirtualClock
from fleet.engine import QueuedRequest, SimEngine
from fleet.policies import POLICIES
from fleet.router import Router, RouterConfig
from fleet.simulation import with_block_size, worker_spec
from fleet.topology import Topology, TopologyError, load_topology
from fleet.traces import MOONCAKE_BLOCK_SIZE, blocks_for, parse_mooncake
from fleet.workloads import SimRequest
from prefixscope import catalog
from prefixscope.units import format_reading

log = logging.getLogger("prefixscope.replay")

RECORDS_BLOCK_SIZE = 16  # vLLM's default, when neither a record nor the flag says
SNAPSHOT_EVERY_S = 15.0  # virtual seconds between the worker-counter "scrapes" fed to the state
# Record fields the simulation invents rather than the trace: dropped so their checks read null.
SIMULATED_ONLY = ("expert_signature", "admitted_by_affinity")
CHECKLIST_STEPS = (1, 2, 3, 4, 5)
UNBOUNDED_WINDOW_S = 1e9


class TraceError(ValueError):
    """The trace cannot be replayed (unreadable, or no valid request in it)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float  # seconds since the first request
    line: int  # 1-based line in the file (ties keep file order)
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]
    block_size: int
    session_key: str | None = None
    segment: str | None = None

    def hit_tokens(self, hit_blocks: int) -> int:
        """Tokens of the first ``hit_blocks`` blocks (all of them: the prompt, partial last block included)."""
        if hit_blocks >= len(self.block_hashes):
            return self.prompt_tokens
        return hit_blocks * self.block_size


@dataclass
class Trace:
    format: str  # "mooncake" or "records"
    requests: list[TraceRequest]
    skipped: int  # lines that could not be used
    first_error: str | None


def _record(obj: dict, block_size: int | None) -> tuple[float, int, int, tuple[int, ...], int]:
    problem = validate(obj)
    if problem is not None:
        raise ValueError(problem)
    hashes = obj.get("block_hashes")
    if not hashes:
        raise ValueError("block_hashes: a replayed record needs its chained block hashes")
    bs = obj.get("block_size") or block_size or RECORDS_BLOCK_SIZE
    # A gateway may hash full blocks only: a tail beyond the last block belongs to no block and is
    # never a hit, so the prompt is cut to the blocks it names.
    n = min(obj["prompt_tokens"], len(hashes) * bs)
    if blocks_for(n, bs) != len(hashes):
        raise ValueError(f"prompt_tokens {obj['prompt_tokens']} does not fit {len(hashes)} blocks of {bs}")
    return float(obj["ts"]), n, int(obj.get("output_tokens") or 1), tuple(hashes), bs


def _detect_format(lines: list[str | bytes]) -> str:
    """``mooncake`` when the first JSON object carries ``hash_ids``, else ``records``."""
    for raw in lines:
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return "mooncake" if "hash_ids" in obj else "records"
    return "records"


def _mooncake_trace(lines: list[str | bytes], block_size: int) -> Trace:
    parsed, errors = parse_mooncake(lines, block_size)
    if not parsed:
        raise TraceError(f"no valid request in the trace{f' ({errors[0]})' if errors else ''}")
    reqs = [TraceRequest(t=r.t, line=r.line, prompt_tokens=r.input_length, output_tokens=r.output_length,
                         block_hashes=r.hash_ids, block_size=block_size) for r in parsed]
    return Trace("mooncake", reqs, len(errors), errors[0] if errors else None)


def parse_trace(lines: Iterable[str | bytes], block_size: int | None = None) -> Trace:
    """Pure: trace lines → requests sorted by time (stable, so ties keep file order)."""
    lines = list(lines)
    if _detect_format(lines) == "mooncake":
        return _mooncake_trace(lines, block_size or MOONCAKE_BLOCK_SIZE)
    rows: list[tuple[float, int, int, int, tuple[int, ...], int, dict]] = []
    skipped, first_error = 0, None
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            ts, n, out, hashes, bs = _record(obj, block_size)
        except (ValueError, KeyError, TypeError) as exc:
            skipped += 1
            if first_error is None:
                detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
                first_error = f"line {lineno}: {detail}"
            continue
        rows.append((ts, lineno, n, out, hashes, bs, obj))
    if not rows:
        raise TraceError(f"no valid request in the trace{f' ({first_error})' if first_error else ''}")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    reqs = [TraceRequest(ts - t0, line, n, out, hashes, bs, obj.get("session_key"), obj.get("segment"))
            for ts, line, n, out, hashes, bs, obj in rows]
    return Trace("records", reqs, skipped, first_error)


def load_trace(path: Path, block_size: int | None = None) -> Trace:
    try:
        with path.open("rb") as f:
            return parse_trace(f, block_size)
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None


# ---- the simulated fleet ------------------------------------------------------------------
class _ReplayEngine(SimEngine):
    """A SimEngine that remembers how many leading blocks (the trace's partial last block
    included) were resident when each request was admitted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.matches: dict[str, int] = {}

    def _start(self, w: QueuedRequest, t: float, forced: bool) -> None:
        self.matches[w.req.request_id] = self.cache.match(w.req.block_hashes or ())
        super()._start(w, t, forced)


def _to_model(events: list[CacheEvent], block_size: int) -> tuple[KvEvent, ...]:
    out: list[KvEvent] = []
    for ev in events:
        if isinstance(ev, Stored):
            out.append(BlockStored(ev.hashes, ev.parent, ev.block_size or block_size))
        elif isinstance(ev, Removed):
            out.append(BlockRemoved(ev.hashes))
        elif isinstance(ev, Cleared):
            out.append(AllBlocksCleared())
    return tuple(out)


def build_topology(base: Topology, workers: int, block_size: int, capacity: int | None) -> Topology:
    """``workers`` workers of the base layout, without a warm pool (a what-if compares policies).

    Capacity is tokens of KV cache whatever the trace's block size: the base topology's
    ``kv_blocks`` (engine blocks of its own block size) become as many trace blocks as hold the
    same tokens. ``capacity`` (``--capacity-blocks``) is already in trace blocks.
    """
    topo = with_block_size(base.with_workers(workers), block_size)
    ws = tuple(replace(w, warm_pool=False, kv_blocks=capacity or w.kv_blocks) for w in topo.workers)
    return replace(topo, workers=ws)


@dataclass
class _Tally:
    queried: int = 0
    hits: int = 0


class Replay:
    """Runs one trace; :meth:`run` returns the result document."""

    def __init__(self, trace: Trace, topology: Topology, policy: str, timed: bool = False, seed: int = 0) -> None:
        self.trace = trace
        self.topology = topology
        self.policy = policy
        self.timed = timed
        self.clock = VirtualClock()
        self.start = self.clock.now()
        # One window over the whole run: the what-if answers for the trace, not its last 5 minutes.
        # The run's virtual length is known only at the end (sequential runs stretch it), so the
        # windows keep everything and the reads divide by the run's span so far (``run_window``).
        parts = bootstrap(topology=topology, window_s=UNBOUNDED_WINDOW_S, clock=self.clock.now, run_window=True)
        self.health, self.state = parts.health, parts.state
        self.engines: dict[str, _ReplayEngine] = {}
        self.seqs: dict[str, int] = {}
        for w in topology.workers:
            spec = replace(worker_spec(topology, w, seed), spec_tokens=0, max_model_len=10**9)
            self.engines[w.name] = _ReplayEngine(spec, self.clock, on_events=self._on_events(w.name))
            self.seqs[w.name] = 0
        # Records arrive when an engine admits the request (later than its arrival when timed).
        self.router = Router(topology, self.engines, self.clock, config=RouterConfig(policy=policy), sink=self,
                             seed=seed)
        self.tallies = {name: _Tally() for name in self.engines}
        self._routed: dict[str, TraceRequest] = {}  # request id -> its trace line, until admitted
        self.hit_total = self.prompt_total = 0

    def _on_events(self, worker: str):
        bs = self.topology.block_size

        def cb(events: list[CacheEvent], ts: float) -> None:
            router = getattr(self, "router", None)
            if router is not None:
                router.on_kv_events(worker, events, ts)
            batch = KvBatch(worker, self.seqs[worker], ts, _to_model(events, bs))
            self.seqs[worker] += 1
            self.state.apply_kv_batch(batch, ts)
        return cb

    def _snapshot(self) -> None:
        now = self.clock.now()
        for name, eng in self.engines.items():
            t = self.tallies[name]
            running, waiting = eng.load()
            self.state.observe_worker(WorkerSnapshot(
                worker=name, flavour="vllm", model=self.topology.model, prefix_queried_tokens=float(t.queried),
                prefix_hit_tokens=float(t.hits), kv_usage_ratio=eng.kv_usage, num_gpu_blocks=eng.spec.num_gpu_blocks,
                block_size=self.topology.block_size, running=float(running), waiting=float(waiting),
                max_running=float(eng.spec.max_running)), now)

    def run(self) -> dict[str, Any]:
        self._snapshot()  # counters start at zero, so the first real scrape counts as an increase
        next_snapshot = self.start + SNAPSHOT_EVERY_S
        for i, tr in enumerate(self.trace.requests):
            arrival = self.start + tr.t
            if self.timed:
                self.clock.set(arrival)
            else:
                # Sequential: the request starts once the previous one has completed.
                self.clock.set(max(arrival, *(e.finish_all() for e in self.engines.values())))
            while self.clock.now() >= next_snapshot:
                self._snapshot()
                next_snapshot += SNAPSHOT_EVERY_S
            # Without a session key a hash router keys the prompt by its first block; the key is the
            # router's only (it is not a session, so it never reaches the session metrics).
            key = tr.session_key or f"prefix-{tr.block_hashes[0]:x}"
            req = SimRequest(t=tr.t, request_id=f"r{tr.line}", session_key=key, conversation="",
                             turn=1, prompt_tokens=len(tr.block_hashes) * tr.block_size,
                             block_hashes=list(tr.block_hashes), output_tokens=max(1, tr.output_tokens),
                             segment=tr.segment, kind="trace", block_size=tr.block_size)
            self._routed[req.request_id] = tr
            dropped = self.router.unroutable + self.router.rejected
            if self.router.route(req) is None and self.router.unroutable + self.router.rejected > dropped:
                del self._routed[req.request_id]  # never admitted (a waiting one stays until it is)
            if i % 256 == 0:
                for e in self.engines.values():
                    e.tick()
        self.clock.set(max(e.finish_all() for e in self.engines.values()))
        self._snapshot()
        return self._result(self.hit_total, self.prompt_total)

    # the router's sink: a request was admitted
    def emit(self, record: dict[str, Any]) -> None:
        tr = self._routed.pop(record["request_id"], None)
        if tr is None:
            return
        worker = record["worker"]
        hit = tr.hit_tokens(self.engines[worker].matches.pop(record["request_id"], 0))
        t = self.tallies[worker]
        t.queried += tr.prompt_tokens
        t.hits += hit
        self.hit_total += hit
        self.prompt_total += tr.prompt_tokens
        record["prompt_tokens"] = tr.prompt_tokens
        record["session_key"] = tr.session_key
        record["cached_tokens"] = hit
        if record.get("predicted_cached_tokens") is not None:
            record["predicted_cached_tokens"] = min(record["predicted_cached_tokens"], tr.prompt_tokens)
        for fld in SIMULATED_ONLY:
            record.pop(fld, None)
        self.state.ingest_records([record], self.clock.now())

    def close(self) -> None:
        pass

    def _result(self, hit_total: int, prompt_total: int) -> dict[str, Any]:
        self.state.refresh_tree_stats()  # the tree depth check reads the final tree, not a background pass
        groups = api.groups(self.state)
        values: dict[str, float | None] = {}
        status: dict[str, str] = {}
        for step in groups["steps"]:
            if step["step"] not in CHECKLIST_STEPS:
                continue
            for check in step["checks"]:
                if catalog.CHECKS_BY_KEY[check["key"]].kind != "checklist":
                    continue
                values[check["key"]] = check["value"]
                status[check["key"]] = check["status"]
        return {
            **values,
            "status": status,
            "reuse": groups.get("reuse"),
            "replay": {
                "format": self.trace.format, "requests": len(self.trace.requests),
                "skipped_lines": self.trace.skipped, "workers": len(self.engines), "policy": self.policy,
                "block_size": self.topology.block_size,
                "capacity_blocks": {w.name: w.kv_blocks for w in self.topology.workers},
                # how full the fullest worker's KV cache ended (resident / capacity, from the index)
                "max_cache_fill_ratio": max(((self.state.index.resident_blocks(w.name) or 0) / w.kv_blocks
                                             for w in self.topology.workers if w.kv_blocks), default=None),
                "mode": "timed" if self.timed else "sequential",
                "prompt_tokens": prompt_total, "hit_tokens": hit_total,
                "virtual_seconds": self.clock.now() - self.start,
            },
        }


def replay(trace: Trace, workers: int, policy: str, *, capacity_blocks: int | None = None,
           block_size: int | None = None, timed: bool = False, topology: Topology | None = None,
           seed: int = 0) -> dict[str, Any]:
    """Run ``trace`` and return the result document (what ``--json`` prints)."""
    bs = block_size or trace.requests[0].block_size
    topo = build_topology(topology or load_topology(), workers, bs, capacity_blocks)
    return Replay(trace, topo, policy, timed=timed, seed=seed).run()


def _table(result: dict[str, Any]) -> str:
    meta = result["replay"]
    lines = [f"{meta['requests']} requests ({meta['format']}), {meta['workers']} workers, policy {meta['policy']}, "
             f"{meta['mode']}, block size {meta['block_size']}"]
    for key, check in catalog.CHECKS_BY_KEY.items():
        if key in result:
            value = result[key]
            shown = "null (not in the trace)" if value is None else format_reading(value, check.unit)
            lines.append(f"  step {check.group}  {key:<45} {shown:<24} {result['status'][key]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixscope replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="Mooncake JSONL or prefixscope.request/v1 NDJSON")
    parser.add_argument("--workers", type=int, default=1, help="simulated workers (default 1)")
    parser.add_argument("--policy", choices=POLICIES, default="prefix-tree", help="the reference router's policy")
    parser.add_argument("--capacity-blocks", type=int,
                        help="KV-cache capacity per worker in trace blocks (default: the topology's KV tokens "
                             "in trace blocks)")
    parser.add_argument("--block-size", type=int, help=f"tokens per trace block (default {MOONCAKE_BLOCK_SIZE} for Mooncake)")
    parser.add_argument("--timed", action="store_true", help="honour timestamps: requests in flight together cannot share blocks")
    parser.add_argument("--topology", type=Path, help="topology file whose layout is repeated (default: the packaged one)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    for flag, value in (("--workers", args.workers), ("--capacity-blocks", args.capacity_blocks),
                        ("--block-size", args.block_size)):
        if value is not None and value <= 0:
            print(f"prefixscope replay: {flag}: must be positive, got {value}", file=sys.stderr)
            return 2
    try:
        trace = load_trace(args.trace, args.block_size)
        topology = load_topology(args.topology) if args.topology else None
        if trace.skipped:
            print(f"prefixscope replay: skipped {trace.skipped} unusable line(s); first: {trace.first_error}",
                  file=sys.stderr)
        result = replay(trace, args.workers, args.policy, capacity_blocks=args.capacity_blocks,
                        block_size=args.block_size, timed=args.timed, topology=topology)
    except (TraceError, TopologyError) as exc:
        print(f"prefixscope replay: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0
