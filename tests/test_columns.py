"""zenflow_triton/columns.py: the batched selection step (``reselect_many_``, ``migrate_columns_many``) against the
per-parameter one (``reselect_``, ``migrate_columns``), bit for bit, on CPU tensors (the packing, the index plans and
the scatters are the CUDA path's; only pinning, the asynchronous copies and the synchronizations are not run)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from zenflow_triton import columns
from zenflow_triton.columns import (
    ColumnMasks,
    ColumnMove,
    migrate_columns,
    migrate_columns_many,
    reselect_,
    reselect_many_,
    select_columns,
)

# (rows, cols, k_old, k_new): nothing selected before or after, everything, a column, primes, no change.
SHAPES = [(5, 40, 0, 10), (3, 17, 17, 5), (8, 33, 11, 11), (1, 1, 1, 0), (4, 9, 0, 0), (6, 50, 12, 12),
          (2, 64, 64, 64), (7, 31, 3, 30)]
# FSDP2 ranks whose shard of a matrix has no rows still select with the others: the first selection (k 0 -> 5, the
# direct fill from the host) and a later one.
EMPTY_SHARDS = [(0, 20, 0, 5), (0, 20, 5, 7)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_identical(a: object, b: object, where: str = "") -> None:
    """Same structure; tensors equal bit for bit (NaN payloads, -0.0 included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        assert torch.equal(_bits(a), _bits(b)), where
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def make_state(rows: int, cols: int, k_old: int, seed: int) -> tuple[dict, ColumnMasks]:
    gen = torch.Generator().manual_seed(seed)
    score = torch.rand(cols, generator=gen)
    if cols > 3:
        score[1] = score[2]  # a tie
    score[0] = -0.0
    slot = select_columns(torch.rand(cols, generator=gen), k_old)
    st = {
        "score": score,
        "slot": slot,
        "col_step": torch.randint(0, 1000, (cols,), generator=gen, dtype=torch.int32),
        "host_col_step": torch.randint(0, 1000, (cols,), generator=gen, dtype=torch.int32),
    }
    for key in ("master", "exp_avg", "exp_avg_sq"):
        st[key] = torch.randn(rows, k_old, generator=gen)
        st["host_" + key] = torch.randn(rows, cols, generator=gen)
    if k_old and rows:
        st["master"][0, 0] = float("nan")  # payloads and signs must travel as bits
        st["exp_avg"][-1, -1] = -0.0
    masks = ColumnMasks.empty(cols, torch.device("cpu"))
    masks.refresh(slot)
    return st, masks


def test_reselect_many_equals_reselect_per_parameter() -> None:
    shapes = SHAPES + EMPTY_SHARDS
    cases = [make_state(rows, cols, k_old, seed) for seed, (rows, cols, k_old, _) in enumerate(shapes)]
    ks = [k_new for *_, k_new in shapes]
    twins = copy.deepcopy(cases)
    expected = [reselect_(st, masks, k) for (st, masks), k in zip(twins, ks)]
    got = reselect_many_([(st, masks, k) for (st, masks), k in zip(cases, ks)])
    assert got == expected
    for i, ((st, masks), (st2, masks2)) in enumerate(zip(cases, twins)):
        assert_identical(st, st2, f"param {i}")
        assert_identical(vars(masks), vars(masks2), f"masks {i}")
    assert sum(r.columns_changed for r in got) > 0


def test_reselect_many_of_nothing() -> None:
    assert reselect_many_([]) == []
    assert migrate_columns_many([]) == []


@pytest.mark.parametrize("seed", range(3))
def test_migrate_columns_many_equals_per_parameter(seed: int) -> None:
    """Arbitrary new slot maps (not top-k), slots in any order: the migration is data movement only."""
    gen = torch.Generator().manual_seed(100 + seed)
    moves, twins = [], []
    for rows, cols, k_old, k_new in SHAPES:
        st, _ = make_state(rows, cols, k_old, seed)
        new_slot = torch.full((cols,), -1, dtype=torch.int32)
        chosen = torch.randperm(cols, generator=gen)[:k_new]
        new_slot[chosen] = torch.randperm(k_new, generator=gen).to(torch.int32)
        args = dict(old_slot=st["slot"], new_slot=new_slot, compact=(st["master"], st["exp_avg"], st["exp_avg_sq"]),
                    col_step=st["col_step"], host=(st["host_master"], st["host_exp_avg"], st["host_exp_avg_sq"]),
                    host_col_step=st["host_col_step"])
        moves.append(ColumnMove(**args))
        twins.append(copy.deepcopy(args))
    expected = [migrate_columns(**args) for args in twins]
    got = migrate_columns_many(moves)
    assert_identical(got, expected)
    for i, (m, args) in enumerate(zip(moves, twins)):
        assert_identical([m.col_step, m.host_col_step, *m.host], [args["col_step"], args["host_col_step"],
                                                                   *args["host"]], f"move {i}")


def test_migrate_columns_many_needs_one_device() -> None:
    st, _ = make_state(2, 4, 1, 0)
    meta = ColumnMove(old_slot=torch.empty(4, dtype=torch.int32, device="meta"), new_slot=st["slot"],
                      compact=(st["master"],) * 3, col_step=st["col_step"], host=(st["host_master"],) * 3,
                      host_col_step=st["host_col_step"])
    cpu = ColumnMove(old_slot=st["slot"], new_slot=st["slot"], compact=(st["master"],) * 3, col_step=st["col_step"],
                     host=(st["host_master"],) * 3, host_col_step=st["host_col_step"])
    with pytest.raises(ValueError, match="one device"):
        migrate_columns_many([cpu, meta])


@pytest.mark.gpu
def test_reselect_many_on_cuda_equals_reselect_per_parameter() -> None:
    """The CUDA path proper: pinned staging, asynchronous copies, two synchronizations; wide enough that the
    transfers are more than a few bytes."""
    shapes = SHAPES + EMPTY_SHARDS + [(4096, 2048, 205, 205), (1024, 8192, 0, 820), (512, 4096, 4096, 410)]
    cases = []
    for seed, (rows, cols, k_old, _) in enumerate(shapes):
        st, _ = make_state(rows, cols, k_old, seed)
        st = {key: t.cuda() for key, t in st.items() if not key.startswith("host_")} | {
            key: t for key, t in st.items() if key.startswith("host_")}
        masks = ColumnMasks.empty(cols, torch.device("cuda"))
        masks.refresh(st["slot"])
        cases.append((st, masks))
    ks = [k_new for *_, k_new in shapes]
    twins = [({key: t.clone() for key, t in st.items()}, copy.deepcopy(masks)) for st, masks in cases]
    expected = [reselect_(st, masks, k) for (st, masks), k in zip(twins, ks)]
    got = reselect_many_([(st, masks, k) for (st, masks), k in zip(cases, ks)])
    assert got == expected
    for i, ((st, masks), (st2, masks2)) in enumerate(zip(cases, twins)):
        assert_identical({k: v.cpu() for k, v in st.items()}, {k: v.cpu() for k, v in st2.items()}, f"param {i}")
        assert_identical({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vars(masks).items()},
                         {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vars(masks2).items()})


@pytest.mark.gpu
def test_a_large_selection_leaves_no_pinned_staging_cached() -> None:
    """torch's caching host allocator would keep a first selection's pinned staging (all k columns: here 302 MB,
    a 512 MB block) page-locked for the rest of the run; staging that large gets a slab of its own, which goes with
    the migration."""
    rows, cols, k = 4096, 8192, 6144
    st, _ = make_state(rows, cols, 0, seed=0)
    st = {key: t if key.startswith("host_") else t.cuda() for key, t in st.items()}
    masks = ColumnMasks.empty(cols, torch.device("cuda"))
    masks.refresh(st["slot"])
    before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    reselect_many_([(st, masks, k)])
    assert st["master"].shape == (rows, k)
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] < before + (256 << 20)


# ------------------------------------------------------------------ issue 20: k = ceil(r*C) at the extremes


@pytest.mark.parametrize(("ratio", "cols", "k"), [
    (1e-9, 100, 1), (1e-9, 1, 1), (1e-7, 4096, 1), (1e-12, 10**6, 1), (0.0, 100, 0), (1.0, 7, 7),
    (0.1, 30, 3), (0.3, 10, 3), (0.7, 10, 7), (0.1, 1000, 100), (0.29, 100, 29), (0.57, 100, 57),
    (1 / 3, 9, 3), (0.1, 31, 4), (0.2, 11, 3), (0.5, 3, 2), (0.999999, 10, 10), (1e-3, 1001, 2),
])
def test_topk_is_the_ceiling_of_r_times_c_and_exact_for_integers(ratio: float, cols: int, k: int) -> None:
    """README: k = ceil(r*C), at least 1 for r > 0; r*C that is an integer up to float error (0.1 * 30 is
    3.0000000000000004 in binary) gives that integer, not one more."""
    from zenflow_triton.config import ZenFlowConfig

    assert ZenFlowConfig(topk_ratio=ratio).topk(cols) == k


def test_topk_never_rounds_a_real_excess_away() -> None:
    from zenflow_triton.config import ZenFlowConfig

    # r*C a hair above an integer by much more than float error must round up (round(., 6) took it down).
    assert ZenFlowConfig(topk_ratio=3.0000001 / 1000).topk(1000) == 4
    assert ZenFlowConfig(topk_ratio=0.1 + 1e-9).topk(30) == 4


def _selection_pair(rows: int, cols: int, k_old: int, k_new: int, seed: int):
    """A state and its deep copy, and the new k: the batched step runs on the first, reselect_ on the twin."""
    st, masks = make_state(rows, cols, k_old, seed)
    return (st, masks), copy.deepcopy((st, masks)), k_new


@pytest.mark.parametrize("rows,cols,k_old,k_new", [(9, 40, 10, 10), (1, 7, 3, 3), (5, 40, 0, 10), (4, 30, 6, 9)])
def test_same_k_selection_permutes_the_compact_state_in_place(rows: int, cols: int, k_old: int, k_new: int) -> None:
    """k unchanged: the same compact tensor objects come back, permuted in place (no second compact state beside the
    first); k changed (the first selection from k = 0 among them): new ones. Either way the bits of reselect_ and a
    new slot map (capture.py's lazy migration keys on its identity)."""
    (st, masks), (st2, masks2), k = _selection_pair(rows, cols, k_old, k_new, seed=rows + cols)
    before = {key: st[key] for key in ("master", "exp_avg", "exp_avg_sq", "slot")}
    expected = reselect_(st2, masks2, k)
    (got,) = reselect_many_([(st, masks, k)])
    assert got == expected and got.columns_changed > 0
    assert_identical(st, st2)
    assert_identical(vars(masks), vars(masks2))
    assert st["slot"] is not before["slot"]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert (st[key] is before[key]) == (k_old == k_new), key


def test_in_place_migration_in_several_chunks_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cap of 2 rows of the widest compact tensor: 7 rows go in 4 chunks (the last one ragged), the 1-row tensor in
    one; every chunked result bit-identical to the one-chunk (default cap) result."""
    shapes = [(7, 50, 12, 12), (1, 33, 11, 11), (6, 40, 5, 5), (3, 20, 4, 7)]
    cases = [make_state(rows, cols, k_old, seed) for seed, (rows, cols, k_old, _) in enumerate(shapes)]
    ks = [k_new for *_, k_new in shapes]
    twins = copy.deepcopy(cases)
    one_chunk = reselect_many_([(st, masks, k) for (st, masks), k in zip(twins, ks)])
    monkeypatch.setattr(columns, "_INPLACE_CHUNK_BYTES", 2 * 12 * 4)
    assert columns._chunk_rows(7, 12) == 2 and columns._chunk_rows(6, 5) == 4 and columns._chunk_rows(1, 11) == 1
    objects = [st["master"] for st, _ in cases]
    chunked = reselect_many_([(st, masks, k) for (st, masks), k in zip(cases, ks)])
    assert chunked == one_chunk and all(r.columns_changed for r in chunked)
    for i, ((st, masks), (st2, masks2)) in enumerate(zip(cases, twins)):
        assert_identical(st, st2, f"param {i}")
        assert_identical(vars(masks), vars(masks2), f"masks {i}")
        assert (st["master"] is objects[i]) == (shapes[i][2] == shapes[i][3])


def test_unchanged_selection_keeps_the_compact_state() -> None:
    """The same columns selected again (r = 1, or scores that pick the same top-k): nothing moves, the tensors stay."""
    (st, masks), (st2, masks2), _ = _selection_pair(4, 9, 9, 9, seed=3)
    master = st["master"]
    expected = reselect_(st2, masks2, 9)
    (got,) = reselect_many_([(st, masks, 9)])
    assert got == expected and got.columns_changed == 0
    assert st["master"] is master
    assert_identical(st, st2)


@pytest.mark.parametrize("k_old,k_new", [(6, 6), (4, 6), (0, 6)])
def test_a_selection_of_only_new_columns_fills_them_from_the_host(k_old: int, k_new: int) -> None:
    """Every new slot a joining column (the first selection, or no overlap with the old one): the compact columns go
    from the host straight into place, into the old tensors when k is unchanged, with reselect_'s bits."""
    st, masks = make_state(9, 20, k_old, seed=7)
    st["score"] = torch.where(st["slot"] >= 0, 0.0, torch.rand(20, generator=torch.Generator().manual_seed(8)) + 1)
    st2, masks2 = copy.deepcopy((st, masks))
    master = st["master"]
    expected = reselect_(st2, masks2, k_new)
    (got,) = reselect_many_([(st, masks, k_new)])
    assert got == expected and got.columns_changed == k_old + k_new
    assert (st["master"] is master) == (k_old == k_new)
    assert_identical(st, st2)
    assert_identical(vars(masks), vars(masks2))


@pytest.mark.gpu
def test_in_place_migration_on_cuda_in_chunks_equals_reselect(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path of the in-place permutation in several chunks (a 64 KiB cap), the direct fill of a first
    selection and the per-parameter staging, against reselect_ on CPU tensors; same-k tensors keep their identity."""
    monkeypatch.setattr(columns, "_INPLACE_CHUNK_BYTES", 64 << 10)
    shapes = [(1000, 2048, 205, 205), (333, 512, 51, 51), (256, 1024, 0, 102), (128, 300, 30, 45)]
    cases, twins = [], []
    for seed, (rows, cols, k_old, _) in enumerate(shapes):
        st, masks = make_state(rows, cols, k_old, seed)
        twins.append(copy.deepcopy((st, masks)))
        st = {key: t if key.startswith("host_") else t.cuda() for key, t in st.items()}
        masks = ColumnMasks.empty(cols, torch.device("cuda"))
        masks.refresh(st["slot"])
        cases.append((st, masks))
    assert columns._chunk_rows(1000, 205) < 1000
    ks = [k_new for *_, k_new in shapes]
    objects = [st["master"] for st, _ in cases]
    expected = [reselect_(st, masks, k) for (st, masks), k in zip(twins, ks)]
    got = reselect_many_([(st, masks, k) for (st, masks), k in zip(cases, ks)])
    # The energies are sums of the scores, which a GPU reduces in another order than the CPU: equal to rounding.
    # Everything that moved is compared bit for bit.
    assert [replace(r, energy_selected=0.0, energy_all=0.0) for r in got] == [
        replace(r, energy_selected=0.0, energy_all=0.0) for r in expected]
    for r, e in zip(got, expected):
        assert (r.energy_selected, r.energy_all) == (pytest.approx(e.energy_selected, rel=1e-5),
                                                     pytest.approx(e.energy_all, rel=1e-5))
    for i, ((st, _), (st2, _)) in enumerate(zip(cases, twins)):
        assert_identical({k: v.cpu() for k, v in st.items()}, st2, f"param {i}")
        assert (st["master"] is objects[i]) == (shapes[i][2] == shapes[i][3])
