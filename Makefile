# Preemptor: two commands on a fresh machine.
#   make demo   the controller on emulated AWS (moto), a readable timeline
#   make test   the test suite, offline
# Python 3.11 (the Lambda runtime) where there is one, else python3 if it is 3.11 or newer;
# only `make build` needs the runtime's own version.
PYTHON ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

export SAM_CLI_TELEMETRY := 0
export AWS_EC2_METADATA_DISABLED := true

.PHONY: demo test lint lint-imports validate build bench bench-aws clean

$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml functions/controller/requirements.txt
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or newer"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "$(PYTHON) is older than 3.11: install Python 3.11 or newer (make PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt -c constraints.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/preemptor demo $(ARGS)

# Bytecode is written (to the __pycache__ directories git ignores) even where the environment
# says PYTHONDONTWRITEBYTECODE: without it, every test process, and every process a test
# starts, compiles the project and rewrites the tests' asserts from source again (half of
# the collection's 15 s on a 2-CPU machine).
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n auto --dist loadgroup $(ARGS)

validate: $(STAMP)
	$(BIN)/sam validate --lint --region us-east-1

# The template's linters: cfn-lint (through sam validate) on the SAM template, and checkov on
# it and on the SAM-transformed template (where the roles are). checkov has its own virtual
# environment: its pins do not fit the project's. Every remaining finding is fixed or
# suppressed where it stands, with the reason (.checkov.yaml, resources' Metadata).
CHECKOV_VENV := .venv-checkov
CHECKOV_VERSION := 3.3.30
$(CHECKOV_VENV)/.installed:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install --quiet checkov==$(CHECKOV_VERSION)
	@touch $@

lint: $(STAMP) $(CHECKOV_VENV)/.installed
	$(BIN)/sam validate --lint --region us-east-1
	$(BIN)/python tests/transformed_template.py .lint/transformed.json
	$(BIN)/cfn-lint .lint/transformed.json
	$(CHECKOV_VENV)/bin/checkov --config-file .checkov.yaml -f template.yaml -f .lint/transformed.json

build: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/sam build

bench: $(STAMP)
	$(BIN)/python -m preemptor_tools.bench $(ARGS)

# Decision cost on the handler path (moto), cold starts, running cost: ~30 min.
bench-aws: $(STAMP)
	$(BIN)/python -m preemptor_tools.bench_aws $(ARGS)

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .lint .aws-sam .pytest_cache .hypothesis
