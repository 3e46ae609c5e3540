"""Shared by the pytest files: seeded inputs. (pytest puts this directory on sys.path, so the
tests import reference.py and this file; linrope itself comes from PYTHONPATH, which CTest sets to
<build dir>/python.)"""
import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(20261123)


def randn(rng, *shape, dtype=np.float64, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)
