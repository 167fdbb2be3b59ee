"""A Dynamo worker's KV-event publisher, run with the Python of a ``.peers/dynamo-<version>`` venv.

It uses nothing but the ``ai-dynamo-runtime`` wheel and the standard library: a
``DistributedRuntime`` with file discovery (no etcd) and the NATS event plane, one
``KvEventPublisher`` per data-parallel rank of one worker, exactly as a Dynamo worker builds them.
The plan arrives as JSON on the command line:

``{"endpoint": "ns.comp.ep", "block_size": 4, "local_indexer": false, "worker_id": null,
"ranks": {"0": [step, ...], "1": [...]}, "zmq": {"0": "tcp://127.0.0.1:P"}}``

A step is ``{"stored": {"tokens": [...], "hashes": [...], "parent": h}}`` or ``{"removed": [...]}``,
pushed through the publisher's own API; a rank named in ``zmq`` instead relays what a vLLM
engine publishes on that ZMQ socket (the publisher subscribes to it, as Dynamo's vLLM worker does).

It prints ``ready <worker id>`` once the publishers exist, ``published`` after the API steps, and
exits when its stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys

from dynamo._core import DistributedRuntime, KvEventPublisher


def runtime(loop: asyncio.AbstractEventLoop) -> DistributedRuntime:
    try:  # 1.6+: the event plane is an argument
        return DistributedRuntime(loop, "file", "tcp", event_plane="nats")
    except TypeError:  # 1.0: NATS for KV events is the ``enable_nats`` flag
        return DistributedRuntime(loop, "file", "tcp", True)


async def main() -> None:
    plan = json.loads(sys.argv[1])
    loop = asyncio.get_running_loop()
    rt = runtime(loop)
    endpoint = rt.endpoint(plan["endpoint"])
    publishers: dict[int, KvEventPublisher] = {}
    ranks = sorted({int(r) for r in plan.get("ranks", {})} | {int(r) for r in plan.get("zmq", {})})
    for rank in ranks:
        kwargs = {"kv_block_size": plan["block_size"], "dp_rank": rank}
        if plan.get("local_indexer"):
            kwargs["enable_local_indexer"] = True
        if plan.get("worker_id") is not None:
            kwargs["worker_id"] = plan["worker_id"]
        if str(rank) in plan.get("zmq", {}):
            kwargs["zmq_endpoint"] = plan["zmq"][str(rank)]
        publishers[rank] = KvEventPublisher(endpoint, **kwargs)
    worker_id = plan.get("worker_id") or endpoint.connection_id()
    print(f"ready {worker_id}", flush=True)
    for rank, steps in sorted(plan.get("ranks", {}).items()):
        pub = publishers[int(rank)]
        for step in steps:
            if "stored" in step:
                s = step["stored"]
                n = len(s["hashes"])
                pub.publish_stored(s["tokens"], [plan["block_size"]] * n, s["hashes"], s.get("parent"))
            else:
                pub.publish_removed(step["removed"])
            await asyncio.sleep(0.01)  # one message per step (1.6 batches what arrives together)
    print("published", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    for pub in publishers.values():
        if hasattr(pub, "shutdown"):
            pub.shutdown()
    rt.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
