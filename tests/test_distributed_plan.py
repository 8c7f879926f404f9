""""auto" under torch.distributed (issue 30 item 8): ranks whose probes and placement rules disagree all run rank
0's plan and placement, and only rank 0 probes. Spawned gloo processes bound by a timeout, as in test_fsdp.py."""

from __future__ import annotations

import json

import distributed_plan_cases
import pytest
import torch
from test_fsdp import run_world

if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_auto_knobs_and_placement_are_rank_zeros_on_every_rank(tmp_path, world: int) -> None:
    run_world(distributed_plan_cases.agree_run, world, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    alone = {tuple(r.pop("alone")) for r in ranks}
    assert len(alone) > 1, f"the ranks' own probes agree ({alone}): the test would prove nothing"
    probed = [r.pop("probed") for r in ranks]
    assert probed == [[0]] + [[]] * (world - 1)  # rank 0 probes once, the others wait for its plan
    assert ranks[0]["accumulate"] == "device"  # rank 0's placement rule; the others' said "host"
    for r in ranks[1:]:
        assert r == ranks[0]
