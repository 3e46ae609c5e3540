"""Shared by the pytest files: the seeded generator (fixture rng), and which linrope is under test.
(pytest puts this directory on sys.path, so the tests import reference.py, cases.py and
bounds.py; linrope itself is the installed package — scripts/test.sh installs it into build/venv
and runs pytest from another directory — or, under CTest, the build tree's <build dir>/python on
PYTHONPATH.)

LINROPE_EXPECT_PREFIX=<dir>: stop at once unless the linrope imported lies under <dir>, so that a
test run meant for the installed package cannot silently test another copy."""
import os

import numpy as np
import pytest

import linrope


def pytest_report_header(config):
    return "linrope %s from %s" % (linrope.__version__, os.path.dirname(linrope.__file__))


def pytest_sessionstart(session):
    expected = os.environ.get("LINROPE_EXPECT_PREFIX")
    if expected:
        where = os.path.realpath(linrope.__file__)
        if not where.startswith(os.path.realpath(expected) + os.sep):
            raise pytest.UsageError("linrope under test is %s, not under LINROPE_EXPECT_PREFIX=%s"
                                    % (where, expected))


@pytest.fixture
def rng():
    return np.random.default_rng(20261123)
