# Two commands a newcomer needs: `make demo` and `make test`. Both build their own venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck unit clean

# The checkout is the `laneway` package (pyproject's package-dir). mypy cannot follow the
# editable install's import hook, so it reads the package through .venv/mypy-path/laneway.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,postgres,s3]'
	mkdir -p $(VENV)/mypy-path && ln -sfn "$(CURDIR)" $(VENV)/mypy-path/laneway
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python configs/demo/run_demo.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .demo-runtime .pytest_cache .mypy_cache .ruff_cache
