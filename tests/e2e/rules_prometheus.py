"""A real Prometheus holding an exporter's scraped history and the generated recording rules'
results over it, evaluated by Prometheus's own engine at fixed instants.

A Prometheus serving backfilled blocks evaluates its rules only from now on, so the recording
rules are backfilled too, with ``promtool tsdb create-blocks-from rules``: promtool asks a
Prometheus holding the history for each rule's expression over the history's span (a range
query: Prometheus's engine, at the rule group's own evaluation instants) and writes the results
as blocks. promtool cannot evaluate a rule that reads another rule in the same pass, so the rules
go in levels (a rule's level is one more than the highest level of the rules it reads), and
Prometheus is restarted over the new blocks after each level. The last start serves everything,
rules loaded into nothing: what it answers at a given instant is what a live Prometheus with the
generated rules would have recorded by then.

Both sides of a comparison must use the same rule file names and evaluation interval: the
instants Prometheus evaluates a group at are offset by a hash of the group's name and file.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import requests
import yaml

from lab.harness import ScrapeHistory
from tests.support import free_port, wait_for

EVAL_INTERVAL_S = 1  # the backfill's evaluation interval: results within a second of any instant


def recording_rules(rule_file: Path) -> list[dict]:
    """The ``record:`` rules of a rule file, in file order."""
    doc = yaml.safe_load(rule_file.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"] if "record" in r]


def rule_levels(rules: list[dict]) -> list[list[dict]]:
    """The rules grouped so that every rule reads only raw series and rules of earlier groups."""
    names = {r["record"] for r in rules}
    # a rule read over a range with an offset is read in the past (a baseline averaging a recorded
    # rate): no dependency within one evaluation, and backfilled before it its past reads nothing
    reads = {r["record"]: {n for n in names if n != r["record"]
                           and re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])(?!\[\w+\] offset)", str(r["expr"]))}
             for r in rules}
    level: dict[str, int] = {}

    def of(name: str, seen: frozenset[str] = frozenset()) -> int:
        if name not in level:
            if name in seen:
                raise ValueError(f"recording rules read each other in a cycle through {name}")
            level[name] = 1 + max((of(d, seen | {name}) for d in reads[name]), default=-1)
        return level[name]
    out: list[list[dict]] = [[] for _ in range(1 + max(of(r["record"]) for r in rules))]
    for r in rules:
        out[level[r["record"]]].append(r)
    return out


class RulesPrometheus:
    """``prometheus`` on 127.0.0.1 over ``history`` (samples at ``start + t``) and the recording
    rules of ``rule_file`` backfilled from ``start`` to ``end`` (Unix seconds)."""

    def __init__(self, prometheus: str, promtool: str, history: ScrapeHistory, start: float, end: float,
                 rule_file: Path, workdir: Path) -> None:
        self.prometheus, self.workdir = prometheus, workdir
        self.proc: subprocess.Popen | None = None
        self.url = ""
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "history.om").write_text(history.openmetrics(start), encoding="utf-8")
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "history.om", "data"], cwd=workdir,
                       check=True, capture_output=True, timeout=300)
        (workdir / "prometheus.yml").write_text(f"global: {{evaluation_interval: {EVAL_INTERVAL_S}s}}\n",
                                                encoding="utf-8")
        try:
            for i, level in enumerate(rule_levels(recording_rules(rule_file))):
                name = f"level{i}.rules.yaml"  # relative, the same on every side: same evaluation instants
                (workdir / name).write_text(yaml.safe_dump({"groups": [{"name": f"prefixscope.recording.{i}",
                                                                        "rules": level}]}), encoding="utf-8")
                self.start()
                out = workdir / f"level{i}"
                done = subprocess.run(
                    [promtool, "tsdb", "create-blocks-from", "rules", f"--url={self.url}", f"--start={int(start)}",
                     f"--end={int(end) + EVAL_INTERVAL_S}", f"--eval-interval={EVAL_INTERVAL_S}s",
                     f"--output-dir={out.name}", name],
                    cwd=workdir, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise RuntimeError(f"promtool could not backfill rule level {i}: {done.stdout}{done.stderr}")
                self.stop()
                for block in out.iterdir():
                    shutil.move(str(block), str(workdir / "data" / block.name))
            self.start()
        except BaseException:
            self.stop()
            raise

    def start(self) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        log = (self.workdir / "prometheus.log").open("a")
        self.proc = subprocess.Popen(
            [self.prometheus, "--config.file=prometheus.yml", "--storage.tsdb.path=data",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--storage.tsdb.retention.time=30d"],
            cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        wait_for(self._ready, "prometheus to be ready", timeout=120, every=0.2, ignore=(requests.RequestException,))

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
        return requests.get(f"{self.url}/-/ready", timeout=5).status_code == 200

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def vector(self, expr: str, at: float) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query's result: sorted labels -> value (NaN kept: a 0/0 ratio)."""
        r = requests.get(f"{self.url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}, timeout=30)
        r.raise_for_status()
        data = r.json()["data"]
        return {tuple(sorted(_labels(s["metric"]).items())): float(s["value"][1]) for s in data["result"]}


def _labels(metric: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in metric.items() if k != "__name__"}
