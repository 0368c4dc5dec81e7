# The template's own targets, included by the Makefile where scripts/dev/ exists (the template repository).
.PHONY: benchmark

benchmark: install
	$(PYTHON) scripts/dev/benchmark.py
	$(PYTHON) scripts/dev/data_benchmark.py
	$(PYTHON) scripts/dev/fsdp_benchmark.py
	$(PYTHON) scripts/dev/lora_benchmark.py

# The quick tier against the oldest and the newest releases of hpctrain's support window (fresh venvs);
# PRE=1 adds the newest with the next Hydra and OmegaConf release candidates
.PHONY: versions
versions: install
	bash scripts/dev/versions.sh oldest
	bash scripts/dev/versions.sh newest
	$(if $(PRE),bash scripts/dev/versions.sh newest --pre)

# Every test's wall time, per file and per tier: docs/benchmarks/<date>-suite.md (and its data as JSON)
.PHONY: durations
durations: install
	$(PYTHON) scripts/dev/suite_durations.py --run
