# The two commands of the README. Each one first runs the idempotent set-up.
PY := .venv/bin/python
export TF_CPP_MIN_LOG_LEVEL := 2
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_mpi_yield_when_idle := 1

.PHONY: setup demo tour test
setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

tour: setup
	@bash scripts/tour.sh

test: setup
	@bash scripts/test.sh $(PYTEST_ARGS)
