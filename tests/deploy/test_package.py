"""``python -m build`` gives a wheel and an sdist that install and run, with and without the compiled cores.

Each variant (``compiled``: the normal build; ``reference``: ``PREFIXSCOPE_NO_COMPILE=1``, what a
machine without a C compiler installs) is built once from a copy of the sources; its wheel and
its sdist are each installed into a fresh venv, and ``prefixscope --help``, ``generate --help``
and ``export`` run from there, ``export`` until ``/healthz`` answers and ``/metrics`` says which
core runs.

To keep this affordable the fresh venvs get no dependencies from the network: the project is
installed with ``--no-deps`` into a venv without pip (the running interpreter's pip installs into
it), and only afterwards a ``.pth`` file appends the running interpreter's site-packages, where
the test extras put every dependency. A ``.pth`` line only appends a directory, so the running
environment's own install of prefixscope (an editable one, hooked in by its own ``.pth``) stays
inactive, the venv's site-packages comes first, and prefixscope comes from the built artifact
alone (asserted). Building the sdist's wheel still fetches the build requirements (setuptools,
Cython) from the package index, as any install from source does.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest

from tests import support

# Building and installing from an sdist compiles the cores: minutes on a busy machine, charged to
# whichever test first asks for the module-scoped fixture, so the default per-test timeout is too short.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

VARIANTS = {"compiled": {}, "reference": {"PREFIXSCOPE_NO_COMPILE": "1"}}
# What a build must not pick up from a working checkout: in-place extensions and their
# translations, virtualenvs, earlier build output.
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".routers", ".demo", "build", "dist", "*.egg-info",
                                      "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
                                      "node_modules", "artifacts", "*.so", "_prefix_core.c", "_render_core.c")
MINIMAL_CONFIG = "workers: []\n"


def _env() -> dict[str, str]:
    """The environment for running what is installed: without PYTHONPATH, so nothing of the
    checkout leaks into the venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _build_env(variant: str) -> dict[str, str]:
    """The environment for ``python -m build``: the test's own (the frontend is the running
    interpreter's), plus the variant's switch."""
    return {**os.environ, **VARIANTS[variant]}


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def dists(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(variant, wheel, sdist) built by ``python -m build`` from a copy of the sources."""
    variant = request.param
    work = tmp_path_factory.mktemp(f"build-{variant}")
    src = work / "src"
    shutil.copytree(support.REPO, src, ignore=_NOT_SOURCES)
    out = work / "dist"
    done = _run([sys.executable, "-m", "build", "--outdir", str(out), str(src)], work, _build_env(variant))
    (wheel,) = out.glob("prefixscope-*.whl")
    (sdist,) = out.glob("prefixscope-*.tar.gz")
    if variant == "compiled":
        # A wheel for this interpreter and platform: the compiled cores are in it.
        assert re.search(r"-cp3\d+-cp3\d+-", wheel.name), f"{wheel.name}: no compiled core\n{done.stderr[-3000:]}"
    else:
        assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    return variant, wheel, sdist


def _fresh_venv(where: Path, artifact: Path, env: dict[str, str]) -> Path:
    """A venv holding prefixscope from ``artifact`` only, the running interpreter's packages after it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-cache-dir",
          "--disable-pip-version-check", str(artifact)], where, env)
    # Only now, so pip above never saw the running environment's prefixscope as installed.
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True, env=_env()).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site) / "_prefixscope_test_dependencies.pth").write_text("\n".join(ours) + "\n", encoding="utf-8")
    return where / "bin"


@pytest.fixture(scope="module", params=["wheel", "sdist"])
def installed(request: pytest.FixtureRequest, dists: tuple[str, Path, Path],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(variant, bin folder of a fresh venv with prefixscope installed from the wheel or the sdist)."""
    variant, wheel, sdist = dists
    artifact = wheel if request.param == "wheel" else sdist
    where = tmp_path_factory.mktemp(f"venv-{variant}-{request.param}")
    return variant, _fresh_venv(where / "venv", artifact, {**_env(), **VARIANTS[variant]})


def _start_export(bin_dir: Path, cwd: Path) -> tuple[subprocess.Popen[str], str, list[str]]:
    config = cwd / "exporter.yaml"
    config.write_text(MINIMAL_CONFIG, encoding="utf-8")
    proc = subprocess.Popen([str(bin_dir / "prefixscope"), "export", "--config.file", str(config),
                             "--web.listen-address", "127.0.0.1:0"], cwd=cwd, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    assert proc.stderr is not None
    url = support.read_until(proc.stderr, r"listening on (http://127\.0\.0\.1:\d+)", seen)[1]
    return proc, url, seen


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def test_installed_package_runs(installed: tuple[str, Path], tmp_path: Path) -> None:
    variant, bin_dir = installed
    env = _env()
    usage = _run([str(bin_dir / "prefixscope"), "--help"], tmp_path, env).stdout
    assert usage.startswith("usage: prefixscope") and "export" in usage and "generate" in usage
    assert "--check" in _run([str(bin_dir / "prefixscope"), "generate", "--help"], tmp_path, env).stdout

    # prefixscope comes from the venv, and the cores are the variant's.
    where = _run([str(bin_dir / "python"), "-c",
                  "import exporter, prefixscope; from exporter.web import exposition; from exporter.core.index import prefix_index; "
                  "print(prefixscope.__file__, exporter.__file__, prefix_index.CORE, exposition.CORE)"],
                 tmp_path, env).stdout.split()
    venv = bin_dir.parent.resolve()
    assert all(Path(p).resolve().is_relative_to(venv) for p in where[:2]), where
    assert where[2:] == [variant, variant]
    # The console shows the runbooks in-app from the packaged runbooks/.
    _run([str(bin_dir / "python"), "-c",
          "from console.links import runbook_markdown; from prefixscope.catalog import CHECKS; "
          "missing = [c.alert for c in CHECKS if not runbook_markdown(c.alert)]; assert not missing, missing"],
         tmp_path, env)

    proc, url, seen = _start_export(bin_dir, tmp_path)
    try:
        support.wait_for(lambda: _get(f"{url}/healthz"), "/healthz", timeout=60,
                         ignore=(OSError, AssertionError))
        metrics = _get(f"{url}/metrics")
        info = re.search(r"^prefixscope_exporter_build_info\{([^}]*)\} 1", metrics, re.M)
        assert info is not None, "no prefixscope_exporter_build_info on /metrics"
        assert f'core="{variant}"' in info[1], info[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, rest = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, rest = proc.communicate()
    log = "".join(seen) + rest
    assert proc.returncode == 0, log
    # The log says which core runs, as build_info does.
    assert f"prefix index: the {variant} core" in log, log


def test_generate_runs_from_the_installed_package(installed: tuple[str, Path], tmp_path: Path) -> None:
    """An installed package has no checkout to write into: ``--out`` writes the generated tree
    elsewhere, ``--check --out`` finds it fresh, and without ``--out`` it says what to do."""
    _, bin_dir = installed
    prefixscope = str(bin_dir / "prefixscope")
    refused = subprocess.run([prefixscope, "generate"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "--out DIR" in refused.stderr, refused.stderr
    out = tmp_path / "generated"
    _run([prefixscope, "generate", "--out", str(out)], tmp_path, _env(), timeout=300)
    for path in ("alerts/generated/prefixscope.rules.yaml", "alerts/generated/alertmanager.yaml",
                 "dashboards/generated/diagnosis_chain.json", "docs/metrics.md", "runbooks/README.md"):
        assert (out / path).is_file(), path
    assert any((out / "deploy" / "kubernetes").rglob("*.yaml"))
    _run([prefixscope, "generate", "--check", "--out", str(out)], tmp_path, _env(), timeout=300)
