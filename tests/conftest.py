"""Test-wide set-up: the helpers' folder on sys.path, and seeded randomness.

Every test starts with Python's, NumPy's and torch's global generators seeded from its own node id
(crc32) plus a base seed, and can ask for that number as the `seed` fixture to seed its own
generators (np.random.default_rng(seed), torch.Generator().manual_seed(seed)). A draw is therefore
the same on every run, yet differs between tests. To explore other draws, set the base:

    MEGATRON_SP_TEST_SEED=7 python -m pytest tests/unit/test_data_gpt.py

A failing test's report names its seed; rerun with the same base to reproduce it.
"""
import os
import random
import sys
import zlib

import numpy as np
import pytest

# Test helpers (layout_utils) are imported by the spawned ranks too: keep their folder on sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))

# Fault injection (MEGATRON_SP_INJECT_*) reaches the scripts the tests start, under any launcher,
# through tests/faults/sitecustomize.py: that folder first on the PYTHONPATH every child inherits.
_FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_FAULTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _FAULTS])

BASE_SEED = int(os.environ.get("MEGATRON_SP_TEST_SEED", "0"))


def pytest_report_header(config):
    return f"megatron_sp test seed base: {BASE_SEED} (MEGATRON_SP_TEST_SEED)"


def seed_of(nodeid: str) -> int:
    """The seed of one test: its node id's crc32 plus the base (fits every generator)."""
    return (zlib.crc32(nodeid.encode()) + BASE_SEED) % 2**32


@pytest.fixture(autouse=True)
def _seeded_global_generators(request):
    """Python's, NumPy's and torch's global generators seeded with this test's seed."""
    value = seed_of(request.node.nodeid)
    random.seed(value)
    np.random.seed(value)
    torch = sys.modules.get("torch")     # not imported yet: its first import seeds it fixedly
    if torch is not None:
        torch.manual_seed(value)


@pytest.fixture(scope="session")
def base_seed():
    """MEGATRON_SP_TEST_SEED (default 0), for module-scoped fixtures that draw data."""
    return BASE_SEED


@pytest.fixture
def seed(request):
    """This test's seed, for the generators it makes itself (a parametrized `seed` overrides it)."""
    return seed_of(request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("seed", f"test seed {seed_of(item.nodeid)} "
                                        f"(MEGATRON_SP_TEST_SEED={BASE_SEED})"))


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny tensors: one intra-op thread for the module (on a loaded machine thread hand-offs
    dominate); `pytestmark = pytest.mark.usefixtures("one_intra_op_thread")` asks for it."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
