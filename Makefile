# Hardcount. `make run` serves the demo; `make test` runs lint and every test.
# Both set themselves up on a fresh machine with only Python 3.11.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt | sha1sum | cut -c1-12)
# Where the embedded PostgreSQL, the demo's keys and the logs live (settings read the same variable).
VAR_DIR := $(or $(HARDCOUNT_VAR_DIR),var)

.PHONY: run test test-quick lint fmt fuzz check-imports stop-db clean correctness browser pango pgbouncer nats

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

# serve (devstack/management/commands/serve.py) starts localstripe, the demo tenant, a webhook receiver and
# gunicorn (with the scheduler) on 127.0.0.1:8000 (HARDCOUNT_PORT changes it), prints the keys and URLs, and
# stops it all on Ctrl-C or SIGTERM. The devstack app is on here whatever the environment says. exec: make's child
# is serve itself (not a shell), so a SIGTERM to make, which make passes to its child, reaches serve (decision 0205).
run: $(STAMP) pango
	$(PY) manage.py migrate --noinput
	$(PY) manage.py collectstatic --noinput --verbosity 0
	HARDCOUNT_DEVSTACK=1 exec $(PY) manage.py serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# Debian's Chromium, which the hosted invoice page's browser test drives through Playwright
# (tests/billing/test_hosted_invoice.py; Playwright's own browser download is never used). Installed when
# missing and we are root; otherwise that test skips, naming what is missing.
browser:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y chromium || (apt-get update && apt-get install -y chromium); \
	fi

# Pango and a font, which WeasyPrint renders the invoice PDFs with (billing/documents.py): installed when
# missing and we are root.
pango:
	@if ! ldconfig -p | grep -q libpangoft2-1.0 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y libpango-1.0-0 libpangoft2-1.0-0 fonts-dejavu-core || \
		(apt-get update && apt-get install -y libpango-1.0-0 libpangoft2-1.0-0 fonts-dejavu-core); \
	fi

# Debian's PgBouncer, which the transaction-pooling system test starts in front of the embedded PostgreSQL
# (tests/system/test_pgbouncer.py; docs/operations.md#pgbouncer): installed when missing and we are root;
# otherwise that test skips, naming what is missing.
pgbouncer:
	@if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y pgbouncer || (apt-get update && apt-get install -y pgbouncer); \
	fi

# Debian's NATS server, which the stream-dispatch tests start with JetStream on a free port of their own
# (tests/outbox/test_stream_dispatch.py; HARDCOUNT_DELIVERY_DISPATCH=nats, docs/reference/webhooks.md):
# installed when missing and we are root; otherwise those tests skip, naming what is missing.
nats:
	@if ! command -v nats-server >/dev/null && [ ! -x /usr/sbin/nats-server ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y nats-server || (apt-get update && apt-get install -y nats-server); \
	fi

# Everything, as CI runs it; the 25 slowest tests are listed at the end. The tests use the development
# stack (seed_demo, serve, localstripe): the devstack app must be installed.
test: lint browser pango pgbouncer nats
	HARDCOUNT_DEVSTACK=1 $(VENV)/bin/pytest --durations=25

# The inner loop at the keyboard: lint and every test except the process-level (system) and slow ones.
test-quick: lint browser pango pgbouncer nats
	HARDCOUNT_DEVSTACK=1 $(VENV)/bin/pytest -m "not system and not slow" --durations=10

fuzz: $(STAMP)
	$(VENV)/bin/pytest tests/api/test_fuzz_api.py tests/api/test_fuzz_stateful.py -v

# The guarantees of docs/reference/guarantees.md, measured: runscheduler SIGKILLed at every point of a
# drain and inside a close, racing drains, the negative control without the unique index, webhook
# executors killed mid-delivery (tests/system/test_failure_correctness.py), PostgreSQL restarted
# mid-drain (tests/system/test_pg_restart.py, on a server of its own), subscription changes and billing-cycle
# restarts killed mid-way or racing a drain (tests/system/test_change_processes.py), the executor kills with
# dispatch through NATS and the stream engine killed too (tests/system/test_stream_processes.py). Prints the report table and writes it to $(VAR_DIR)/failure-correctness.md
# (docs/benchmarks/failure-correctness.md holds a committed run).
CORRECTNESS_ROWS := $(abspath $(VAR_DIR))/correctness-rows.jsonl
correctness: $(STAMP) nats
	mkdir -p $(VAR_DIR) && rm -f $(CORRECTNESS_ROWS)
	HARDCOUNT_CORRECTNESS_REPORT=$(CORRECTNESS_ROWS) $(VENV)/bin/pytest tests/system/test_failure_correctness.py tests/system/test_pg_restart.py tests/system/test_change_processes.py tests/system/test_stream_processes.py -v; \
	status=$$?; \
	$(PY) -m tests.system.correctness_report $(CORRECTNESS_ROWS) --out $(VAR_DIR)/failure-correctness.md --status $$status; \
	exit $$status

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The embedded PostgreSQL outlives each command so the next one reuses it; this stops it.
stop-db: $(STAMP)
	-$(PY) -c "import os, pathlib; from pgserver._commands import pg_ctl; pg_ctl(['-w', 'stop'], pgdata=pathlib.Path('$(VAR_DIR)/pgdata').resolve(), user='pgserver' if os.geteuid() == 0 else None)" 2>/dev/null

# With DATABASE_URL set, var/ does not hold the database: deleting var/ alone would leave that database's
# demo tenant and book behind without their keys and gateway store, and the next make run would seed a
# second demo tenant beside them. So clean refuses (docs/decisions/0131-dev-stack-resilience-and-first-run.md).
clean:
ifneq ($(strip $(DATABASE_URL)),)
	@echo "make clean: refusing, DATABASE_URL is set." >&2
	@echo "  make clean deletes $(VAR_DIR)/ (the embedded PostgreSQL, the demo's keys, localstripe's store). It cannot" >&2
	@echo "  delete the database DATABASE_URL names, and deleting $(VAR_DIR)/ alone would orphan that database's demo" >&2
	@echo "  tenant and book (their keys and the gateway ids they refer to live in $(VAR_DIR)/): the next make run" >&2
	@echo "  would seed a second demo tenant beside them." >&2
	@echo "  To start over: drop and recreate that database yourself (e.g. dropdb and createdb), then" >&2
	@echo "  run 'env -u DATABASE_URL make clean'. To keep it: leave $(VAR_DIR)/ as it is." >&2
	@exit 2
endif
	-@$(MAKE) --no-print-directory stop-db
	rm -rf $(VAR_DIR)
