"""A pytest plugin for a pre-flight on a machine without a GPU: run the GPU-marked tests anyway.

``tests/conftest.py`` and ``bench/conftest.py`` skip them there ("needs a CUDA device"); this plugin, run last, takes
that skip away again, so each GPU test runs until its first use of the GPU. Every one should fail there (no driver)
and nowhere before: a failure of another kind (a NameError, a wrong argument, a fixture that does not exist) is a
defect the first device run would have spent its time on. Only useful on a CPU machine; see bench/README.md::

    PYTHONPATH=bench python -m pytest -p unskip_gpu -m gpu tests bench/bench_device_kernels.py -q --tb=line
"""

from __future__ import annotations

import pytest

SKIP_REASON = "needs a CUDA device"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.own_markers[:] = [m for m in item.own_markers
                               if not (m.name == "skip" and m.kwargs.get("reason") == SKIP_REASON)]
