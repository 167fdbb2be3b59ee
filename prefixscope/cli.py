"""The ``prefixscope`` command: one entry point, one subcommand per job.

Each subcommand lives in its own module and parses its own flags; this file only dispatches,
so ``prefixscope --help`` stays fast (nothing heavy is imported until a subcommand runs).
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module with main(argv) -> int, one-line description)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("lab.sim", "run the simulated fleet (workers, reference router, workloads, fault scenarios)"),
    "export": ("exporter.main", "run the exporter (Prometheus /metrics and the JSON API)"),
    "relay": ("exporter.relay", "relay workers' ZMQ KV-event streams into a NATS JetStream stream"),
    "shard-plan": ("exporter.shard_plan", "print which exporter shard owns which workers and prefix families"),
    "steady": ("lab.steady", "a fault scenario after hours of healthy traffic, read by the exporter's own checks"),
    "replay": ("lab.replay", "what-if: replay a trace through a simulated fleet and print the five groups"),
    "catalog": ("prefixscope.catalog_cli", "print the metric catalogue (table or JSON)"),
    "generate": ("alerts.generate", "write (or --check) rules, dashboards, alert provisioning and docs"),
    "console": ("console.launch", "run the on-call console (Streamlit)"),
    "demo": ("lab.demo", "run the whole demo: fleet, exporter, Prometheus and console"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [
        "usage: prefixscope <command> [options]",
        "",
        "Observability and diagnosis for prefix-cache locality in LLM inference clusters.",
        "",
        "commands:",
    ]
    lines += [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines += ["", "Run 'prefixscope <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from prefixscope import __version__

        print(f"prefixscope {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"prefixscope: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except BrokenPipeError:
        return _closed_pipe()


def _closed_pipe() -> int:
    """The reader of stdout went away (``prefixscope catalog | head``): stop quietly, as Unix tools do.

    stdout is pointed at /dev/null so the interpreter's final flush cannot raise again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # what a shell reports for a process ended by SIGPIPE
