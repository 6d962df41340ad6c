"""Pieces of distributed Muon that need no process group, and kforge's Muon against torch.optim.Muon.

The multi-process equality with one process is tests/distributed/test_muon_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from kforge_cli.engine.train.optim.muon import Muon, zeropower_via_newtonschulz
from kforge_cli.engine.train.optim.muon_distributed import _tiles, assign_owners, newton_schulz_flops


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32), (1, 7)])
def test_newton_schulz_flops_count_its_matmuls(shape: tuple[int, int]) -> None:
    with FlopCounterMode(display=False) as counter:
        zeropower_via_newtonschulz(torch.randn(shape), steps=5)
    assert newton_schulz_flops(*shape, 5) == counter.get_total_flops()


def test_owners_largest_first_on_the_least_loaded_rank() -> None:
    costs = [7, 5, 4, 3, 3, 2]  # LPT: 7 -> r0, 5 -> r1, 4 -> r2, 3 -> r2 (7), 3 -> r1 (8), 2 -> r0 (9)
    assert assign_owners(costs, 3) == [0, 1, 2, 2, 1, 0]
    assert assign_owners(costs, 1) == [0] * 6
    loads = [0, 0, 0, 0]
    costs = [newton_schulz_flops(r, c, 5) for r, c in [(4096, 4096)] * 8 + [(14336, 4096)] * 12 + [(1024, 4096)] * 8]
    for i, r in enumerate(assign_owners(costs, 4)):
        loads[r] += costs[i]
    assert max(loads) <= 1.01 * sum(costs) / 4


def test_blocks_must_tile_the_matrix() -> None:
    assert _tiles([(0, 0, 2, 4), (2, 0, 2, 4)], 4, 4)
    assert _tiles([(0, 0, 4, 4), (0, 0, 4, 4), (0, 0, 0, 4)], 4, 4)  # replicated, and an empty shard
    assert not _tiles([(0, 0, 2, 4), (0, 0, 2, 4)], 4, 4)  # half the rows missing
    assert not _tiles([(0, 0, 2, 4), (3, 0, 2, 4)], 4, 4)  # outside the matrix
    assert not _tiles([(-1, -1, -1, -1), (0, 0, 4, 4)], 4, 4)  # a shard that is not a block


def test_update_equals_torch_optim_muon_whose_buffer_is_an_ema() -> None:
    """torch.optim.Muon keeps (1 - momentum) x our buffer and orthogonalises in bf16: the update is the same."""
    torch.manual_seed(0)
    w = torch.randn(24, 8)
    ours_p, theirs_p = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    ours = Muon([{"params": [ours_p], "use_muon": True}], lr=0.02, weight_decay=0.1, momentum=0.9)
    theirs = torch.optim.Muon([theirs_p], lr=0.02, weight_decay=0.1, momentum=0.9)
    for _ in range(5):
        g = torch.randn(24, 8)
        ours_p.grad, theirs_p.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    buf_ours, buf_theirs = ours.state[ours_p]["momentum_buffer"], theirs.state[theirs_p]["momentum_buffer"]
    torch.testing.assert_close(buf_theirs, 0.1 * buf_ours, rtol=1e-5, atol=1e-6)
    moved_ours, moved_theirs = ours_p.detach() - w, theirs_p.detach() - w
    # bf16 Newton-Schulz (theirs) against fp32 (ours on CPU): measured 1.0% of the distance moved;
    # plain momentum on our side instead of nesterov: 20%
    assert (moved_ours - moved_theirs).norm() <= 0.03 * moved_ours.norm()
    assert moved_ours.norm() > 0.1
