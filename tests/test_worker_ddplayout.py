"""The DDP bucket-layout hand-over, without processes (the end-to-end check is in
test_example_gpt.py::test_ddp_on_three_ranks_heals_bit_for_bit)."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from unicron.worker import ddplayout


def test_initial_layout_is_handed_to_ddp_pre_reversed_and_only_when_it_fits() -> None:
    params = [torch.zeros(10), torch.zeros(20), torch.zeros(5)]
    original = dist._compute_bucket_assignment_by_size
    used: list[list[list[int]]] = []
    with ddplayout._initial_layout([[2, 0], [1]], used):
        indices, limits = dist._compute_bucket_assignment_by_size(params, [1 << 20], [False] * 3)
        assert indices == [[1], [2, 0]] and len(limits) == 2  # DDP reverses it back to [[2, 0], [1]]
    assert dist._compute_bucket_assignment_by_size is original
    assert used == [[[2, 0], [1]]], "taken: the DDP knows its layout (31A F3)"
    with ddplayout._initial_layout([[0, 1]], used):  # does not cover parameter 2: DDP's own layout
        assert dist._compute_bucket_assignment_by_size(params, [1 << 20], [False] * 3)[0] == original(
            params, [1 << 20], [False] * 3)[0]
    assert len(used) == 1, "not taken: its layout is known after its rebuild only"
    assert ddplayout._covers([[1], [0, 2]], 3) and not ddplayout._covers([[0, 0], [1]], 2)
    assert not ddplayout._covers("x", 0) and not ddplayout._covers([[0], 1], 2)


def test_install_counts_instances_and_restores_by_construction_order(monkeypatch) -> None:
    built: list[object] = []

    class FakeDDP:
        def __init__(self, tag: str) -> None:
            built.append((tag, dist._compute_bucket_assignment_by_size))

    module = types.SimpleNamespace(DistributedDataParallel=FakeDDP)
    monkeypatch.setattr(ddplayout, "_instances", [])
    monkeypatch.setattr(ddplayout, "_to_restore", [None, [[0]]])  # the second DDP had a layout
    original = dist._compute_bucket_assignment_by_size
    ddplayout.install(module)  # type: ignore[arg-type]
    ddplayout.install(module)  # type: ignore[arg-type]  # idempotent
    first, second = FakeDDP("a"), FakeDDP("b")
    assert [tag for tag, _ in built] == ["a", "b"]
    assert built[0][1] is original and built[1][1] is not original, "only the second gets a layout"
    assert [ref() for ref in ddplayout._instances] == [first, second]
    assert ddplayout.current_layouts() == [None, None], "no rebuilt layout to record yet"
