"""``prefixscope shard-plan``: which shard owns what, for an exporter config and a shard count."""

from __future__ import annotations

import argparse
import json
import sys

from exporter.bootstrap import configured_workers
from exporter.config import ConfigError, load_config
from exporter.core.sharding import plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixscope shard-plan",
                                description="Print each shard's workers (scrape, stream health) and the prefix-family "
                                            "and record rules, for an exporter config split into N shards.")
    p.add_argument("--config.file", dest="config_file", metavar="FILE", required=True)
    p.add_argument("--shards", type=int, default=None, help="shard count (default: the config's shard.count)")
    p.add_argument("--json", action="store_true", help="print JSON")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        cfg = load_config(args.config_file)
        workers = configured_workers(cfg)
    except ConfigError as exc:
        print(f"prefixscope shard-plan: {exc}", file=sys.stderr)
        return 2
    count = args.shards or cfg.shard.count
    if count < 1:
        print("prefixscope shard-plan: --shards must be at least 1", file=sys.stderr)
        return 2
    pl = plan((w.name for w in workers), (r.name for r in cfg.routers), count)
    if args.json:
        print(json.dumps({"shards": count, "family_rule": "splitmix64(root block hash) mod shards",
                          "record_rule": "every record to every shard; kept by the owner of its first block's family "
                                         "(no hashes: by session key, else the worker's home shard)",
                          "workers": {str(k): list(v) for k, v in pl.workers.items()},
                          "routers": {str(k): list(v) for k, v in pl.routers.items()}}, indent=2))
    else:
        print("\n".join(pl.lines()))
    return 0
