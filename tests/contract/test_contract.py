"""The contract tests of a model x data pair (hpctrain.testing.contract, which says what each checks):

pytest tests/contract --model=<conf/model option> --data=<conf/data option> [--override key=value ...]
"""

from hpctrain.testing.contract import *  # noqa: F403  (the tests, collected here)
