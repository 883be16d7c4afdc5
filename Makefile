# The README's two commands: `make demo` (the main job on the embedded corpus) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN ?= runs/default

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	rm -rf $(RUN)
	$(BIN)/build-index data/default --out $(RUN)/idx
	$(BIN)/teragram verify $(RUN)/idx
	$(BIN)/teragram stats $(RUN)/idx
	$(BIN)/teragram query $(RUN)/idx count "the kernel" --json
	$(BIN)/teragram query $(RUN)/idx infgram-ntd "A hacker is a person who" --json
	$(BIN)/teragram query $(RUN)/idx longest-match "Linux kernel development in the early 1990's was" --json

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs
