"""The template's test suite (docs/maintainers/tests.md)."""

import sys

# The suite's own bytecode is cached (__pycache__/, ignored by git) even where PYTHONDONTWRITEBYTECODE is
# set, as on many CI images and clusters: otherwise each of the two workers compiles hpctrain and every
# test module again, and pytest rewrites the asserts of every test module again, at every run (8 s of the
# quick tier's 41 s on the 2-core machine). The runs the tests start read the same cache. Set here, the
# package pytest imports before its conftest and test modules.
sys.dont_write_bytecode = False
