# Hardcount. `make run` serves the demo; `make test` runs lint and every test.
# Both set themselves up on a fresh machine with only Python 3.11.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt | sha1sum | cut -c1-12)

.PHONY: run test lint fmt fuzz check-imports stop-db clean

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(PY) manage.py migrate --noinput
	$(PY) manage.py collectstatic --noinput --verbosity 0
	$(PY) manage.py serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest

fuzz: $(STAMP)
	$(VENV)/bin/pytest tests/test_fuzz_api.py -v

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

stop-db: $(STAMP)
	$(PY) -c "from pathlib import Path; from pgserver._commands import pg_ctl; pg_ctl(['-w', 'stop'], pgdata=Path('var/pgdata').resolve(), user='pgserver')" || true

clean: stop-db
	rm -rf var
