# linkpass — `make demo` and `make test` work as root on a fresh Debian machine with Python 3.11.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# gcc, libssl-dev, python3-dev: the C probe datapath (setup.py, linkpass/adapters/_probe_io.c)
APT_PACKAGES := iproute2 nftables iputils-ping procps kmod mosquitto mosquitto-clients openssl systemd gcc libssl-dev python3-dev
STAMP_APT := $(VENV)/.apt-done
STAMP_PY := $(VENV)/.py-done
PROMTOOL := $(BIN)/promtool

.PHONY: demo test install system-deps bench unit clean example-config install-service

install: $(STAMP_PY)

system-deps: $(STAMP_APT)

$(STAMP_APT):
	@if [ "$$(id -u)" != 0 ]; then echo "make: run as root (apt-get and network namespaces need it)"; exit 2; fi
	@missing=""; for c in ip nft ping mosquitto mosquitto_passwd mosquitto_sub openssl systemd-analyze gcc; do command -v $$c >/dev/null || missing=1; done; \
	for h in /usr/include/openssl/evp.h /usr/include/$(PY)/Python.h; do [ -e $$h ] || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi
	@command -v $(PY) >/dev/null || { export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq python3 python3-venv >/dev/null; }
	@mkdir -p $(VENV) && touch $@

$(STAMP_PY): $(STAMP_APT) pyproject.toml setup.py linkpass/adapters/_probe_io.c
	@command -v $(PY) >/dev/null || { echo "make: $(PY) not found"; exit 2; }
	@[ -x $(BIN)/python ] || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip >/dev/null
	$(BIN)/pip install -q -e '.[torch,test]'
	@touch $@

# promtool alone (tests check deploy/prometheus-rules.yml with it), taken out of Debian's prometheus
# package: installing the package would also install and start a Prometheus server (init script)
$(PROMTOOL): | $(STAMP_APT)
	@set -e; d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; cd "$$d"; \
	  apt-get download -qq -o APT::Sandbox::User=root prometheus 2>/dev/null || \
	    { apt-get update -qq && apt-get download -qq -o APT::Sandbox::User=root prometheus; }; \
	  dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool; \
	  cd - >/dev/null; install -D -m 755 "$$d/usr/bin/promtool" $@

demo: install
	$(BIN)/linkpass demo --hosts 2 --rails 2 --json demo-result.json

test: install $(PROMTOOL)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 tests

unit: install $(PROMTOOL)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/scenarios

bench: install
	$(BIN)/python bench/detect_reroute.py --cuts 50 --json bench/results/detect_reroute.json
	$(BIN)/python bench/daemon_footprint.py --json bench/results/daemon_footprint.json
	$(BIN)/python bench/topology_speed.py --runs 10 --json bench/results/topology_speed.json
	$(BIN)/python bench/mqtt_outbox.py --events 10000 --runs 3 --json bench/results/mqtt_outbox.json

# deploy/linkpass.toml.example is generated from the config schema (tests check it matches)
example-config: install
	$(BIN)/linkpass config show --defaults --example > deploy/linkpass.toml.example.tmp
	mv deploy/linkpass.toml.example.tmp deploy/linkpass.toml.example

# The systemd install on a node (as root): a venv of its own in $(SERVICE_VENV) with this
# repository and its pinned dependencies, the command at $(PREFIX)/bin/linkpass (the path
# deploy/linkpass.service's ExecStart runs), the unit, and the example config unless a config is
# there already.  Run it again to upgrade: nothing an operator edited is replaced.  DESTDIR
# stages everything under another root (packaging; the tests use it).
PREFIX ?= /usr/local
SERVICE_VENV ?= /opt/linkpass
UNIT_DIR ?= /etc/systemd/system
CONF_DIR ?= /etc/linkpass
install-service:
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" != 0 ]; then echo "make: install-service: run as root"; exit 2; fi
	@[ -x $(DESTDIR)$(SERVICE_VENV)/bin/python ] || $(PY) -m venv $(DESTDIR)$(SERVICE_VENV)
	$(DESTDIR)$(SERVICE_VENV)/bin/pip install -q --upgrade .
	install -d -m 0755 $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(UNIT_DIR) $(DESTDIR)$(CONF_DIR)
	ln -sfn $(SERVICE_VENV)/bin/linkpass $(DESTDIR)$(PREFIX)/bin/linkpass
	install -m 0644 deploy/linkpass.service $(DESTDIR)$(UNIT_DIR)/linkpass.service
	@[ -e $(DESTDIR)$(CONF_DIR)/linkpass.toml ] || install -m 0644 deploy/linkpass.toml.example $(DESTDIR)$(CONF_DIR)/linkpass.toml
	@echo "installed $(PREFIX)/bin/linkpass -> $(SERVICE_VENV)/bin/linkpass and $(UNIT_DIR)/linkpass.service;" \
	  "next: edit $(CONF_DIR)/linkpass.toml, add the notice key, linkpass config check $(CONF_DIR)/linkpass.toml," \
	  "systemctl daemon-reload && systemctl enable --now linkpass"

clean:
	rm -rf $(VENV) *.egg-info demo-result.json
