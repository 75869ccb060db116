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

lint: setup
	.venv/bin/ruff check .

proto: setup
	.venv/bin/python -m bookie.proto.generate
