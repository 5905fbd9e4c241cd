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

# Two passes: the suite waits on processes more than it computes, so two pytest-xdist
# workers share these two-core machines; then, alone, the few tests that stop or restart
# the PostgreSQL server (marked `serial`), which would pull it from under the others.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not serial"
	$(BIN)/python -m pytest -q -m serial

clean:
	rm -rf $(VENV) .demo-runtime .pytest_cache .mypy_cache .ruff_cache
