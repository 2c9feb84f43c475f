# Preemptor: two commands on a fresh machine.
#   make demo   the controller on emulated AWS (moto), a readable timeline
#   make test   the test suite, offline
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

export SAM_CLI_TELEMETRY := 0
export AWS_EC2_METADATA_DISABLED := true

.PHONY: demo test lint-imports validate build bench bench-aws clean

$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml functions/controller/requirements.txt
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 (or run make PYTHON=python3)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt -c constraints.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/preemptor demo $(ARGS)

test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -n auto $(ARGS)

validate: $(STAMP)
	$(BIN)/sam validate --lint --region us-east-1

build: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/sam build

bench: $(STAMP)
	$(BIN)/python -m preemptor_tools.bench $(ARGS)

# Decision cost on the handler path (moto), cold starts, running cost: ~30 min.
bench-aws: $(STAMP)
	$(BIN)/python -m preemptor_tools.bench_aws $(ARGS)

clean:
	rm -rf $(VENV) .aws-sam .pytest_cache .hypothesis
