import os
import tempfile

import pytest
import torch

# Tests never read or write the user's evidence store, nor reuse torch.compile artifacts of
# another build (the compile cache is keyed by the model's graph, not by our ops' internals).
_TMP = tempfile.mkdtemp(prefix="kernelgate-tests-")
os.environ["KERNELGATE_DB"] = os.path.join(_TMP, "evidence.sqlite")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_TMP, "inductor")

import kernelgate as kg  # noqa: E402

# Under pytest-xdist (`-n N`, how the GPU tests run on the GPU machine), N test processes share
# the cores: each gets its share of intra-op threads, or their float64 oracles thrash.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, _workers)))


# KG_FAILURE_LOG=path: each failure's report is appended there as the test ends (under xdist the
# summary comes only at the end of the run, which a device time limit may cut).
_FAILURE_LOG = os.environ.get("KG_FAILURE_LOG")


def pytest_runtest_logreport(report):
    if _FAILURE_LOG and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(_FAILURE_LOG, "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")


def pytest_runtest_setup(item):
    # A GPU test that runs where there is no GPU fails at once; it is never silently skipped, nor
    # run on the CPU (an oracle sweep of the GPU grid there runs for hours). Machines without a
    # GPU deselect them with -m "not gpu" (scripts/test.sh does), which pytest reports. (A
    # usefixtures mark added at collection does not reach the fixtures pytest already resolved.)
    if "gpu" in item.keywords and not torch.cuda.is_available():
        pytest.fail("this GPU test needs a CUDA device; deselect GPU tests with -m 'not gpu'")


@pytest.fixture(autouse=True)
def clean_dispatcher():
    """Every test starts with an empty policy and no overrides, and leaves it so."""
    kg.policy.clear()
    kg._C.set_overrides([], [])
    kg._C.reset_log_once()
    yield
    kg.policy.clear()
    kg._C.set_overrides([], [])
