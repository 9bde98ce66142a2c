# Fresh machine: `make demo` (set up, trace an example) and `make test` (set up, run the tests).
# The interpreter: Debian's own python3.11 where it can make a venv and compile against its headers.
# It is built with PGO and LTO, with libpython linked in; pyenv's python3 (first on PATH here) is
# a shared-library build without them, and the suite's ~400 Python processes spend ~15% more CPU
# under it (a small training program, torch imported: 3.6 vs 4.2 CPU s). torch's file on disk is for 3.11.
SYS_PY := $(shell p=/usr/bin/python3.11; $$p -c 'import ensurepip, os, sys, sysconfig; \
  sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null && echo $$p)
PY ?= $(or $(SYS_PY),python3)
VENV ?= .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# bytecode is written (some shells set PYTHONDONTWRITEBYTECODE): the install compiles none, and
# without it each of the test suite's ~200 Python processes would compile torch again (+3.4 CPU s)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv native browser demo test test-full bench clean

# torch and the C++ build tool first: the native build starts from here, beside the rest of the
# install. torch pinned and first: the project's range (torch>=2.3) is then already met and pulls
# nothing else. No byte-compiling at install (pip's serial pass over ~15k files was half of the
# setup): the modules a run imports are compiled at their first import instead.
$(BIN)/.torch:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile $(TORCH) ninja
	touch $@

$(BIN)/.ready: pyproject.toml $(BIN)/.torch
	$(BIN)/pip install -q --no-compile -e '.[test]' $(TORCH)
	touch $@

venv: $(BIN)/.ready

# the native capture source (C++, ~30 s once per torch/Python/source version, into ~/.cache/msmemscope);
# without a compiler the runs use the dispatch-mode source, slower, and say so in their log
native: $(BIN)/.torch
	@$(BIN)/python -m msmemscope.capture.native build || echo "the native source was not built: tracing falls back to the dispatch-mode source"

demo: venv native
	rm -rf demo-output
	$(BIN)/msmemscope --output=demo-output --analysis=leaks,decompose examples/transformer.py --steps 4

# headless Chromium for the HTML report tests (skipped with a reason when it cannot be installed)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  ( SUDO=$$( [ "$$(id -u)" = 0 ] && echo "" || (command -v sudo >/dev/null 2>&1 && echo "sudo -n") ); \
	    ($$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium) >/dev/null 2>&1 || \
	    echo "chromium could not be installed; the browser tests will be skipped" )

# set-up side by side (the venv's install, the C++ build once torch is in, the browser's apt
# install), then three workers, a test file each (files share module fixtures: traced runs); on 2
# cores the suite is CPU-bound (~1,150 CPU s of tests and their subprocesses, ~2 s of each Python
# process being `import torch`): a fourth worker only adds contention (a sample of 4 files: 8% more
# CPU than with 2 workers, 10% more wall than with 3).
test:
	@$(MAKE) --no-print-directory -j3 venv native browser
	$(BIN)/python -m pytest tests -n 3 --dist loadfile; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

# the long forms of the tests (conftest.full): more steps, examples and repetitions
test-full: venv native browser
	MSMEMSCOPE_TEST_FULL=1 $(BIN)/python -m pytest tests -n 2 --dist loadfile
	@echo "capture and leak tests again on the dispatch-mode source (the suite above used the native one where built)"
	MSMEMSCOPE_TEST_FULL=1 MSMEMSCOPE_SOURCE=python $(BIN)/python -m pytest tests/test_capture.py tests/test_leaks.py

bench: venv native
	$(BIN)/python bench/run.py --workloads transformer,mlp,gpt2 --repeats 5 --steps 10 --min-seconds 1

clean:
	rm -rf $(VENV) demo-output memscopeDumpResults .pytest_cache
