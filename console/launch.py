"""``prefixscope console``: run the Streamlit console against an exporter (and Prometheus)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from console.settings import (
    ALERTMANAGER_ENV,
    ANNOUNCE_ENV,
    CLUSTER_ENV,
    DEFAULT_EXPORTER_URL,
    DEFAULT_SCOPE_LABEL,
    EXPORTER_ENV,
    GRAFANA_ENV,
    PROMETHEUS_ENV,
    RUNBOOK_BASE_ENV,
    SCOPE_LABEL_ENV,
    THRESHOLDS_ENV,
    TIMEZONE_ENV,
)

APP = Path(__file__).resolve().parent / "streamlit_app.py"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixscope console",
                                description="Run the on-call console (Streamlit) against an exporter and, optionally, Prometheus.")
    p.add_argument("--exporter-url", default=os.environ.get(EXPORTER_ENV) or DEFAULT_EXPORTER_URL,
                   help=f"the exporter's base URL (env {EXPORTER_ENV}; default %(default)s)")
    p.add_argument("--prometheus-url", default=os.environ.get(PROMETHEUS_ENV),
                   help=f"Prometheus's base URL (env {PROMETHEUS_ENV}); without it the console runs "
                        "on the exporter alone")
    p.add_argument("--alertmanager-url", default=os.environ.get(ALERTMANAGER_ENV),
                   help=f"Alertmanager's base URL (env {ALERTMANAGER_ENV}); with it the Alerts page shows "
                        "which alerts are inhibited or silenced, and by what")
    p.add_argument("--grafana-url", default=os.environ.get(GRAFANA_ENV),
                   help=f"Grafana's base URL (env {GRAFANA_ENV}); without it the console shows no Grafana links")
    p.add_argument("--runbook-url-base", default=os.environ.get(RUNBOOK_BASE_ENV),
                   help=f"where <Alert>.md runbooks are published (env {RUNBOOK_BASE_ENV}); without it "
                        "runbook links open the console's own runbook page")
    p.add_argument("--timezone", default=os.environ.get(TIMEZONE_ENV),
                   help=f"IANA time zone of chart axes (env {TIMEZONE_ENV}; default: this host's)")
    p.add_argument("--thresholds", default=os.environ.get(THRESHOLDS_ENV),
                   help=f"threshold file to show limits from when no exporter answers (env {THRESHOLDS_ENV}; "
                        "default: the packaged alerts/thresholds.yaml); the exporter's own limits win")
    p.add_argument("--announcements", default=os.environ.get(ANNOUNCE_ENV),
                   help=f"a running fleet's announcements file (prefixscope sim --announce; env {ANNOUNCE_ENV}): "
                        "its newest line is shown as a banner on every page")
    p.add_argument("--cluster", default=os.environ.get(CLUSTER_ENV),
                   help=f"the cluster to show when one Prometheus watches several (the value of the scope label; "
                        f"env {CLUSTER_ENV}; default: the only one Prometheus has)")
    p.add_argument("--scope-label", default=os.environ.get(SCOPE_LABEL_ENV),
                   help=f"the label that tells the clusters apart (env {SCOPE_LABEL_ENV}; default "
                        f"{DEFAULT_SCOPE_LABEL}, the threshold file's scope_labels)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8501, help="port to listen on; 0 picks a free one (default %(default)s)")
    return p.parse_args(argv)


def command(args: argparse.Namespace) -> list[str]:
    port = args.port or free_port(args.host)
    return [sys.executable, "-m", "streamlit", "run", str(APP),
            "--server.headless", "true", "--server.address", args.host, "--server.port", str(port),
            "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--client.toolbarMode", "viewer"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    env = dict(os.environ, **{EXPORTER_ENV: args.exporter_url})
    for name, value in ((PROMETHEUS_ENV, args.prometheus_url), (ALERTMANAGER_ENV, args.alertmanager_url),
                        (GRAFANA_ENV, args.grafana_url),
                        (RUNBOOK_BASE_ENV, args.runbook_url_base), (TIMEZONE_ENV, args.timezone),
                        (THRESHOLDS_ENV, args.thresholds), (ANNOUNCE_ENV, args.announcements),
                        (CLUSTER_ENV, args.cluster), (SCOPE_LABEL_ENV, args.scope_label)):
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    cmd = command(args)
    print(f"prefixscope console on http://{args.host}:{cmd[cmd.index('--server.port') + 1]}/", flush=True)
    # Become Streamlit (same pid), so a supervisor's SIGTERM reaches the server directly.
    os.execve(cmd[0], cmd, env)
    return 0  # not reached
