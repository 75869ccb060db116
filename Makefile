# The two commands of the README's quick start:
#   make run   - set up and run the main job
#   make test  - set up and run the test suite (what CI runs)
.PHONY: setup run test sim soak lint proto

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/scroll standalone $(ARGS)

test: setup
	bash scripts/test.sh

sim: setup
	.venv/bin/python -m tests.sim --seeds 200

soak: setup
	SCROLL_SOAK=1 .venv/bin/python -m pytest -m slow -q
	# every fuzz target for SCROLL_FUZZ_SECONDS (default 600) each: tests/fuzz/test_fuzz_ci.py
	SCROLL_FUZZ_SECONDS=$${SCROLL_FUZZ_SECONDS:-600} .venv/bin/python -m pytest -q tests/fuzz/test_fuzz_ci.py

lint: setup
	.venv/bin/ruff check .

proto: setup
	.venv/bin/python -m bookie.proto.generate
