# prefixscope — the two quick-start targets are `make demo` and `make test`.
# Both set up everything they need on a fresh Debian machine (venv, packages, Prometheus,
# Chromium, the two real routers) and are safe to run again.

PYTHON      ?= python3.11
VENV        ?= .venv
ROUTERS     ?= .routers
PEERS       ?= .peers
# The peers' own runtimes the tests publish with: Dynamo's current release and its 1.0 line.
DYNAMO_VERSIONS ?= 1.6.1 1.0.2
# The SGLang model gateway whose policy branches and KV-event health the tests read (its own venv:
# its `smg` command would shadow sglang-router's in .routers).
SMG_VERSION ?= 1.13.0
PY          := $(VENV)/bin/python
PIP         := $(VENV)/bin/pip
SUDO        := $(shell [ "$$(id -u)" = 0 ] && echo "" || echo "sudo -n")
PYTEST_ARGS ?=

.PHONY: setup system-packages demo-packages routers peers demo test test-fast lint bench bench-cluster generate check-generated clean fuzz soak

# gcc builds the compiled prefix index during the install (without it the install still
# succeeds and the exporter runs on the Python reference index).
# The compiled cores' sources: a change to one rebuilds the editable install (and with it the
# extensions in place), so `make test` after a pull never runs a stale core.
CORE_SOURCES := $(wildcard exporter/*.pyx exporter/*/*.pyx exporter/*/*/*.pyx exporter/*.pxi exporter/*/*.pxi exporter/*/*/*.pxi)

$(VENV)/.installed: pyproject.toml setup.py $(CORE_SOURCES)
	$(call apt_install,gcc)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
	touch $@

# Debian's prometheus (promtool for the rule tests, the server for the demo),
# prometheus-alertmanager (amtool and the server: the inhibition tests and the demo's pages) and
# chromium (the console's browser test), nats-server (JetStream for the relay and the shard
# tests) and etcd-server (Dynamo's worker registry, for the discovery tests). Without root this prints what to run and carries on.
define apt_install
	@missing=""; \
	for pkg in $(1); do \
	  case $$pkg in prometheus) bin=promtool ;; prometheus-alertmanager) bin=amtool ;; etcd-server) bin=etcd ;; *) bin=$$pkg ;; esac; \
	  command -v $$bin >/dev/null 2>&1 || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    $(SUDO) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "not root: install these yourself for the full demo and test suite: apt-get install$$missing"; \
	  fi; \
	fi
endef

system-packages:
	$(call apt_install,prometheus prometheus-alertmanager chromium nats-server etcd-server)

demo-packages:
	$(call apt_install,prometheus prometheus-alertmanager)

# The two real routers live in their own venv: they are binaries we drive, not libraries.
$(ROUTERS)/.installed:
	$(PYTHON) -m venv $(ROUTERS)
	$(ROUTERS)/bin/pip install --quiet --upgrade pip
	$(ROUTERS)/bin/pip install --quiet 'sglang-router==0.3.2' 'vllm-router==0.1.17'
	touch $@

routers: $(ROUTERS)/.installed

# NVIDIA Dynamo's runtime (ai-dynamo-runtime, no GPU needed to publish KV events), one venv per
# version: the tests run its KvEventPublisher against a real nats-server.
$(PEERS)/dynamo-%/.installed:
	$(PYTHON) -m venv $(PEERS)/dynamo-$*
	$(PEERS)/dynamo-$*/bin/pip install --quiet --upgrade pip
	$(PEERS)/dynamo-$*/bin/pip install --quiet 'ai-dynamo-runtime==$*'
	touch $@

$(PEERS)/smg-%/.installed:
	$(PYTHON) -m venv $(PEERS)/smg-$*
	$(PEERS)/smg-$*/bin/pip install --quiet --upgrade pip
	$(PEERS)/smg-$*/bin/pip install --quiet 'smg==$*'
	touch $@

peers: $(foreach v,$(DYNAMO_VERSIONS),$(PEERS)/dynamo-$(v)/.installed) $(PEERS)/smg-$(SMG_VERSION)/.installed

setup: $(VENV)/.installed system-packages routers peers

demo: $(VENV)/.installed demo-packages
	$(VENV)/bin/prefixscope demo $(DEMO_ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

# ruff, then the import layers of pyproject.toml's [tool.importlinter] (run from the checkout,
# so the working copy's packages are the ones checked).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

bench: $(VENV)/.installed
	$(VENV)/bin/python -m bench

# One exporter process against N simulated workers (N = 100, 300, 1000): the KV event rate it
# follows with lag <= 1 s, its CPU by duty, RSS and /metrics latency (docs/operating.md, sizing).
# BENCH_CLUSTER_ARGS=--quick checks the mechanics in about two minutes; --json for the report as JSON.
bench-cluster: $(VENV)/.installed
	$(PY) -m bench.cluster $(BENCH_CLUSTER_ARGS)

generate: $(VENV)/.installed
	$(VENV)/bin/prefixscope generate

check-generated: $(VENV)/.installed
	$(VENV)/bin/prefixscope generate --check

clean:
	rm -rf $(VENV) $(ROUTERS) $(PEERS) .pytest_cache

# 1,000,000 generated inputs for each intake — KV-event decoder, text parser, router pages, OTLP
# protobuf, OTLP JSON (one in 20 also through a running exporter's POST /v1/traces and gRPC Export),
# request records, NATS messages (FUZZ_ARGS="--inputs N --targets a,b" for fewer); fails on any crash.
fuzz: $(VENV)/.installed
	nice $(PY) -m fuzz.run $(FUZZ_ARGS)

# The exporter for SOAK_MINUTES (default 10) against the simulated fleet at 10x and hostile peers
# (slow loris, stalled large bodies, bad records, unbounded label values); prints RSS over time,
# scrape latency, KV lag and series count, and fails when RSS is not flat.
SOAK_MINUTES ?= 10
soak: $(VENV)/.installed
	$(PY) -m soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)
