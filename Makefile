# reservoir: `make run` (the main job) and `make test`. Both install the
# Debian packages they need, and are idempotent.
BUILD ?= build
JOBS ?= 2
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
# What `make run` needs: the command-line tool and what it links, built from
# Debian's packages alone (CMake's configure step asks for the test and
# benchmark libraries too, headers and small).
DEPS_RUN := cmake ninja-build ccache g++ libgtest-dev libgmock-dev libbenchmark-dev libfmt-dev \
            libcli11-dev nlohmann-json3-dev python3
DEPS := $(DEPS_RUN) clang clang-tidy libclang-rt-14-dev llvm-14 valgrind \
        python3-torch python3-selenium python3-pil chromium chromium-driver zsh \
        python3-dev pybind11-dev python3-pytest \
        python3-pip python3-venv python3-setuptools python3-setuptools-whl python3-wheel python3-build \
        debootstrap patchelf
TRACES := $(wildcard examples/traces/*.trace examples/traces/*.pickle)
# Real recordings make run replays and verifies: `make run RECORDINGS=DIR` for
# another folder of PyTorch snapshots (DIR/*.pickle, DIR/oom/*.pickle).
RECORDINGS ?= ../shared/traces
SHARED_TRACES := $(wildcard $(RECORDINGS)/*.pickle $(RECORDINGS)/oom/*.pickle)
CONFIGS := -c "" -c "max_split_size_mb:64" -c "roundup_power2_divisions:4" \
           -c "garbage_collection_threshold:0.6" --capacity 24GiB --memory-fraction 1.0
# make run advises on a real out-of-memory dump when one is at hand.
ADVISE_TRACE := $(firstword $(wildcard $(RECORDINGS)/oom/*.pickle) $(SHARED_TRACES) \
                  examples/traces/gpt_training.pickle)
POLICIES := -c "" -c "expandable_segments:True" -c "policy:paging" -c "policy:native_paged"
# What the build takes from PyPI (scripts/pypi_cache.py, into the cache
# outside the checkout): the headers of each PyTorch release reservoir's own
# allocator is built for, about 12 MB of each wheel; CUDA 11's and 12's
# runtime headers for the simulated device's older runtimes. The tests
# install the rest when they run, each what it uses (cmake/PyPIFolders.cmake).
BUILD_REQUIREMENTS := scripts/packaging/headers-torch.txt $(wildcard scripts/packaging/requirements-cuda-runtime-*.txt)
# Everything any test, benchmark or package build takes (make deps-all: for
# a machine about to work without a network).
ALL_REQUIREMENTS := $(BUILD_REQUIREMENTS) $(wildcard tests/torch/requirements-*.txt tests/torch/releases/requirements-*.txt) \
                    scripts/packaging/debian-python.txt scripts/packaging/wheelhouse-build.txt \
                    $(wildcard scripts/packaging/requirements-auditwheel-*.txt) scripts/gpu_bundle/wheelhouse-gpu-bundle.txt

.PHONY: deps deps-run deps-all tool configure build run test test-releases wheel wheels no-cuda clang tidy tidy-all asan tsan fuzz bench gpu-bundle gpu-bundle-check clean

# Installs the Debian packages of the list $(1) that are missing.
define debian_packages
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
endef

deps-run:
	$(call debian_packages,$(DEPS_RUN))

deps:
	$(call debian_packages,$(DEPS))
	@/usr/bin/python3 scripts/pypi_cache.py $(BUILD_REQUIREMENTS) >/dev/null

deps-all: deps
	@/usr/bin/python3 scripts/pypi_cache.py $(ALL_REQUIREMENTS) >/dev/null

# CMake builds everything; these targets drive it (deps installs what is missing).
CONFIGURE := cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
configure: deps
	$(CONFIGURE)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The command-line tool alone (what `make run` runs): nothing from PyPI, no
# test or benchmark built.
tool: deps-run
	$(CONFIGURE)
	cmake --build $(BUILD) -j $(JOBS) --target reservoir_cli

# Every line it prints fits 100 columns; it ends with where to look next.
run: tool
	@echo "== Replaying the bundled recordings under four settings, 24 GiB device (reservoir replay)"
	@$(BUILD)/bin/reservoir replay $(TRACES) $(CONFIGS)
	@echo; echo "== The smallest device each recording fits, per policy (reservoir replay --min-capacity)"
	@$(if $(SHARED_TRACES),,echo "   (no real recordings at $(RECORDINGS): the bundled ones only)")
	@$(BUILD)/bin/reservoir replay $(TRACES) $(SHARED_TRACES) $(POLICIES) --min-capacity
	@echo
	@$(if $(SHARED_TRACES),echo "== Replaying the real recordings against what PyTorch did (reservoir verify)" && \
	  $(BUILD)/bin/reservoir verify $(SHARED_TRACES),echo "== Skipped: verifying real recordings (none at $(RECORDINGS))")
	@echo; echo "== Advice on $(notdir $(ADVISE_TRACE)) (reservoir advise)"
	@$(BUILD)/bin/reservoir advise $(ADVISE_TRACE) -o $(BUILD)/advice.html
	@echo; echo "== The replays as a page (reservoir report)"
	@$(BUILD)/bin/reservoir report $(TRACES) $(POLICIES) --min-capacity -o $(BUILD)/report.html
	@echo; echo "== Where to look next"
	@printf '  %-20s %s\n' $(BUILD)/advice.html "the advice above as a page, with the memory at its moment" \
	  $(BUILD)/report.html "every replay: reserved memory over time, segments, settings side by side" \
	  docs/tools.md "every command; reservoir <command> --help ends with examples" \
	  "make test" "the tests (PyTorch on the simulated CUDA device among them)"

# The tests; each PyTorch release's tests install what they use from PyPI
# when they first run (the newest release whole, the oldest with reservoir's
# own allocator and one other chosen by the commit, with their CUDA
# libraries, and vLLM with the release it pins: at most 12 GB, tests/cmake/make_test_downloads.py).
test: build
	cd $(BUILD) && ctest --output-on-failure --no-tests=error -j $(JOBS) -LE 'torch_extra|pypi'

# The rest of the release matrix, on the simulated device: every other
# PyTorch release reservoir is built for or serves (installing each when it
# first runs). Run it before a change to the PyTorch integration lands.
# MATRIX_SKIP=matrix_oracle (CI) leaves out the oracle of the releases make
# test did not choose (each release gets it there one commit in eleven);
# MATRIX_PART=N (0, 1 or 2; CI: chosen by the commit) runs a third of the
# matrix (the entries dealt to it: tests/CMakeLists.txt).
test-releases: build
	cd $(BUILD) && ctest --output-on-failure --no-tests=error -j $(JOBS) \
	  -L '$(if $(MATRIX_PART),matrix_$(MATRIX_PART),torch_extra)' $(if $(MATRIX_SKIP),-LE '$(MATRIX_SKIP)')

# As on a machine without CUDA's headers (used by .ci/run): the same tests,
# less the CUDA backends' and the interposer's, are registered and pass.
# Unoptimized, to build quickly; -g1 for the tests of symbolized stacks. The
# wheel's tests build from the sources, not from this build, so `make test`
# has run them already.
no-cuda: build
	cmake -S . -B build-nocuda -G Ninja -DCMAKE_BUILD_TYPE=None -DCMAKE_C_FLAGS=-g1 -DCMAKE_CXX_FLAGS=-g1 \
	  -DRESERVOIR_CUDA=OFF -DRESERVOIR_BUILD_BENCH=OFF >/dev/null
	cmake --build build-nocuda -j $(JOBS)
	python3 tests/cmake/no_cuda_check.py $(BUILD) build-nocuda
	cd build-nocuda && ctest --output-on-failure --no-tests=error -j $(JOBS) -LE 'wheel|pypi'

# The layers with clang (used by .ci/run): -Wthread-safety checks the lock
# annotations of the allocator and the saver. Configured with the tests and
# tools too, so compile_commands.json covers every source clang-tidy checks.
# The same tree builds the fuzzers (make fuzz): its sources are compiled
# with libFuzzer's coverage, ASan and UBSan, so that one clang tree serves
# the analysis, clang-tidy and the fuzzers; -O1, as the sanitizers advise
# (at -O0 the slowest fuzzer ran 64 inputs in its 15 s).
CLANG_TARGETS := reservoir_base reservoir_device reservoir_allocator reservoir_saver reservoir_trace \
                 reservoir_capi reservoir_torch
FUZZERS := config pickle text_trace snapshot_json rmm_csv verify hostile_snapshot
clang: deps
	CC=clang CXX=clang++ cmake -S . -B build-clang -G Ninja -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_C_FLAGS_DEBUG="-g -O1" -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" \
	  -DRESERVOIR_BUILD_BENCH=OFF -DRESERVOIR_BUILD_PYTHON=OFF -DRESERVOIR_BUILD_FUZZ=ON >/dev/null
	cmake --build build-clang -j $(JOBS) --target $(CLANG_TARGETS)

# clang-tidy with the committed .clang-tidy: on the sources changed since the
# commit in .ci/tidy-base (used by .ci/run), or on every source.
TIDY_BASE ?= $(shell cat .ci/tidy-base)
tidy: clang
	python3 scripts/tidy.py build-clang $(TIDY_BASE) $(JOBS)
tidy-all: clang
	python3 scripts/tidy.py build-clang all $(JOBS)

# Sanitizer builds (used by .ci/run). The ASan build's library tests run in
# validation mode: the validator after every call that changes an allocator.
# The command-line tools' tests (advise replays each trace under two dozen
# settings, many times) and the library's replays of whole real recordings
# (ASAN_REPLAYS) run under ASan and UBSan without it: the validator checks
# the allocator, which the other tests cover call by call. (NativePaged's
# rescue test stays validated: its programs are a tenth in a sanitized or
# unoptimized build, tests/unit/per_call_validation.hpp.)
ASAN_REPLAYS := ^(Verify\.ReservoirsPagePolicies|NativePaged\.NeverReserves|Advise\.MinimumCapacities|SharedTraces\.|PagingBound\.CutsThePrograms|Export\.SharedTraces|RandomOps\.Paging$$)
asan: deps
	cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DRESERVOIR_BUILD_BENCH=OFF \
	  -DRESERVOIR_SANITIZE=address,undefined >/dev/null
	cmake --build build-asan -j $(JOBS)
	cd build-asan && RESERVOIR_VALIDATE=1 ctest --output-on-failure --no-tests=error -j $(JOBS) \
	  -LE 'install|cli|browser|pypi' -E '$(ASAN_REPLAYS)'
	cd build-asan && ctest --output-on-failure --no-tests=error -j $(JOBS) -R '$(ASAN_REPLAYS)' -LE 'install|cli|browser|pypi'
	cd build-asan && ctest --output-on-failure --no-tests=error -j $(JOBS) -L 'cli|browser' -LE 'install|pypi'

tsan: deps
	cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRESERVOIR_BUILD_BENCH=OFF \
	  -DRESERVOIR_BUILD_TOOLS=OFF -DRESERVOIR_SANITIZE=thread >/dev/null
	cmake --build build-tsan -j $(JOBS)
	cd build-tsan && ctest --output-on-failure --no-tests=error -j $(JOBS) -L concurrency

# libFuzzer targets, each run briefly from its seed corpus. A failure prints
# the sanitizer's report and the input (base64) into the log, so that a CI
# run that found one says what it was.
FUZZ_SECONDS ?= 20
fuzz: clang
	cmake --build build-clang -j $(JOBS) --target $(addprefix fuzz_,$(FUZZERS))
	@# $(JOBS) fuzzers at a time; a crash in any fails the target.
	printf '%s\n' $(FUZZERS) | \
	  xargs -P $(JOBS) -I{} sh -c 'mkdir -p build-clang/corpus-{} && \
	    build-clang/bin/fuzz_{} -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10 \
	      -artifact_prefix=build-clang/{}- build-clang/corpus-{} tests/fuzz/corpus/{} \
	      > build-clang/fuzz-{}.log 2>&1 || \
	    { for f in build-clang/{}-crash-* build-clang/{}-timeout-* build-clang/{}-oom-*; do \
	        [ -f "$$f" ] && { echo "$$f, gzip | base64:"; gzip -9c "$$f" | base64 -w 120; }; done; \
	      grep -m1 -A16 "ERROR: \|ALARM\|out-of-memory (" build-clang/fuzz-{}.log; \
	      echo "fuzz_{} failed (build-clang/fuzz-{}.log)"; exit 255; }; \
	    tail -1 build-clang/fuzz-{}.log'

bench: build
	$(BUILD)/bin/allocator_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
	$(BUILD)/bin/replay_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true

# Everything the GPU proofs run, for a GPU machine without our development
# packages (docs/integrations.md, "The GPU bundle"): build/gpu-bundle.
gpu-bundle: configure
	JOBS=$(JOBS) cmake --build $(BUILD) --target gpu_bundle

# Its checks on this machine: dynamic sections, contents, run.sh under env -i,
# and the driver's every step with stand-ins for the GPU programs.
gpu-bundle-check: gpu-bundle
	python3 tests/packaging/bundle/check_bundle.py $(BUILD)/gpu-bundle
	python3 tests/packaging/bundle/driver_test.py $(BUILD)/gpu-bundle

# The Python package's wheel (pyproject.toml) in build/dist, for Debian's
# python3 (PYTHON=... for another interpreter with setuptools and wheel).
PYTHON ?= /usr/bin/python3
wheel: configure
	cmake -S . -B $(BUILD) -DRESERVOIR_WHEEL_PYTHON=$(PYTHON) >/dev/null
	cmake --build $(BUILD) --target wheel

# What a release ships, in build/dist: the sdist and, built from it as
# `pip install .` builds (build isolation, the PyPI cache's wheelhouse as the
# index), a wheel per CPython 3.10+ on the machine repaired by auditwheel to a
# manylinux tag.
wheels: configure
	cmake --build $(BUILD) --target wheels

clean:
	rm -rf build build-nocuda build-clang build-asan build-tsan build-bundle
