# The template's own targets, included by the Makefile where scripts/dev/ exists (the template repository).
.PHONY: benchmark

benchmark: install
	$(PYTHON) scripts/dev/benchmark.py
	$(PYTHON) scripts/dev/data_benchmark.py
