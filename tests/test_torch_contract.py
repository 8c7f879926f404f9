"""PyTorch's own optimizer contract for ZenFlowAdamW (issue 10 §1), tested side by side with torch.optim.AdamW.

PyTorch's generic optimizer tests (``TestOptimRenewed`` in test/test_optim.py, driven by the ``OptimizerInfo``
entries of ``torch.testing._internal.common_optimizers``) are not shipped in the torch wheel, and
``common_optimizers`` does not import here (it pulls in ``common_utils``, which needs ``expecttest``), so this file
writes the equivalent checks: tensor ``lr`` and schedulers, non-contiguous parameters, the state_dict and step
hooks, deepcopy/pickle, duplicate parameters, per-group flags, zero_grad, state_dict round trips, missing
gradients, closures, no-op steps and AdamW equivalence.

Every check runs ``torch.optim.AdamW`` next to ZenFlowAdamW on the same parameters and gradients, and expects what
AdamW does: the same numbers at ``topk_ratio=1`` (every column selected: ZenFlow degenerates to AdamW), the same
exception type where AdamW refuses. Where ZenFlow refuses what AdamW accepts (complex parameters, ``maximize``,
``amsgrad``, ...), the expectation is a ValueError naming the option.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR

from zenflow_triton import ZenFlowAdam, ZenFlowAdamW

# Small enough that the test matrices below ([24, 32], [16, 24], [8, 6, 4]) are offloaded, while 1-D ones stay
# resident: both paths are exercised in every test.
MIN_OFFLOAD = 128
STEPS = 6

# Both optimizers run the same fp32 AdamW arithmetic, but not in the same order: ZenFlow folds the bias corrections
# per column and applies them in fused kernels (numba/torch), torch computes scalar step sizes in Python floats. Each
# step differs by a few ulps (~1e-7 relative); over the handful of steps here, with updates of size ~lr, the
# difference stays well under 1e-6 absolute. A wrong mask, a missed or doubled step, a stale lr or beta shows up
# as ~lr = 1e-2, four orders of magnitude above this tolerance.
ATOL, RTOL = 1e-6, 1e-5

_opened: list[Any] = []


@pytest.fixture(autouse=True)
def _close_optimizers():
    """Stop the host worker of every ZenFlow optimizer (and copy) a test made, whatever the test's outcome."""
    yield
    while _opened:
        opt = _opened.pop()
        try:
            opt.close()
        except Exception:  # a broken copy cannot close; the test itself reports what is wrong with it
            pass


# ------------------------------------------------------------------------------------------------------ helpers


def make_params(
    *, seed: int = 0, transposed: bool = False, permuted: bool = False, sliced: bool = False
) -> list[nn.Parameter]:
    """Two offloaded matrices, two resident vectors; optionally the first matrix is a transposed (non-contiguous)
    leaf, a permuted 3-D leaf is added, and a column-sliced (non-dense) leaf is added."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(32, 24, generator=g).t() if transposed else torch.randn(24, 32, generator=g)  # [24, 32]
    params = [
        nn.Parameter(w1 * 0.3),
        nn.Parameter(torch.randn(24, generator=g) * 0.1),
        nn.Parameter(torch.randn(16, 24, generator=g) * 0.3),
        nn.Parameter(torch.randn(16, generator=g) * 0.1),
    ]
    if permuted:  # [8, 6, 4] with strides (1, 32, 8): 192 elements, offloaded
        params.append(nn.Parameter(torch.randn(6, 4, 8, generator=g).permute(2, 0, 1) * 0.3))
    if sliced:  # [16, 12] with strides (24, 2): every other column of a [16, 24] tensor, 192 elements
        params.append(nn.Parameter((torch.randn(16, 24, generator=g) * 0.3)[:, ::2]))
    if transposed:
        assert not params[0].is_contiguous() and params[0].is_leaf
    return params


def twin(params: Sequence[torch.Tensor]) -> list[nn.Parameter]:
    """Independent copies with the same values and strides (non-dense ones included)."""
    out = [nn.Parameter(torch.empty_strided(p.size(), p.stride()).copy_(p.detach())) for p in params]
    assert all(a.stride() == b.stride() for a, b in zip(params, out))
    return out


def loss_fn(params: Sequence[torch.Tensor], i: int) -> torch.Tensor:
    """A loss whose gradient depends on the parameters (tanh) and differs from step to step and column to column."""
    g = torch.Generator().manual_seed(1000 + i)
    total = torch.zeros(())
    for p in params:
        target = torch.randn(p.shape, generator=g)
        total = total + (torch.tanh(p) * target).sum() / p.numel() ** 0.5 + 0.05 * (p * p).sum()
    return total


def make_zen(
    params: Any,
    *,
    lr: float | torch.Tensor = 1e-2,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.1,
    topk_ratio: float = 1.0,
    update_interval: int = 1,
    overlap: bool = False,
    min_offload_numel: int = MIN_OFFLOAD,
    backend: str = "auto",
    cls: type[ZenFlowAdamW] = ZenFlowAdamW,
) -> ZenFlowAdamW:
    """ZenFlowAdamW, by default in its AdamW-equivalent mode (every column on the device, one-step windows)."""
    opt = cls(params, lr=lr, betas=betas, weight_decay=weight_decay, topk_ratio=topk_ratio,
              update_interval=update_interval, overlap=overlap, min_offload_numel=min_offload_numel, backend=backend,
              warmup_steps=0)
    _opened.append(opt)
    return opt


# Default ZenFlow knobs (a tenth of the columns, 4-step windows, overlapped host work), offloading the test matrices.
DEFAULT_KNOBS = dict(topk_ratio=0.1, update_interval=4, overlap=True)
ALL_ON_DEVICE = dict(topk_ratio=1.0, update_interval=1, overlap=False)


def make_adamw(params: Any, *, lr: float | torch.Tensor = 1e-2, betas: tuple[float, float] = (0.9, 0.999),
               weight_decay: float = 0.1) -> torch.optim.AdamW:
    # foreach=False: the reference loop (a Tensor lr is refused with foreach=True and capturable=False).
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)


def train_step(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], i: int) -> None:
    opt.zero_grad()
    loss_fn(params, i).backward()
    opt.step()


def assert_params_close(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], what: str = "") -> None:
    for k, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a.detach(), e.detach(), atol=ATOL, rtol=RTOL,
                                   msg=lambda m, k=k: f"{what} param {k}: {m}")


def assert_same_tree(a: Any, b: Any, path: str = "") -> None:
    """Equal structure; tensors bitwise equal (and same dtype), everything else ``==``."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{k}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{path}: tensors differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def hyperparams(opt: torch.optim.Optimizer, keys: Sequence[str] = ("lr", "betas", "eps", "weight_decay")) -> list:
    return [{k: (float(g[k]) if k == "lr" else g[k]) for k in keys} for g in opt.param_groups]


# --------------------------------------------------------------------------------------------------- tensor lr

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda opt: StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: LambdaLR(opt, lambda s: 1.0 / (1.0 + s)),
    # cycle_momentum (the default) also rewrites betas[0] every step
    "OneCycleLR": lambda opt: OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS + 1),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_tensor_lr_with_scheduler_matches_adamw(sched: str) -> None:
    """A 0-dim tensor lr is kept as AdamW keeps it (the same tensor, updated in place by the scheduler) and every
    step equals AdamW's with that lr."""
    ref = make_params()
    mine = twin(ref)
    ref_lr, my_lr = torch.tensor(1e-2), torch.tensor(1e-2)
    ref_opt = make_adamw(ref, lr=ref_lr)
    opt = make_zen(mine, lr=my_lr)
    ref_sched, my_sched = SCHEDULERS[sched](ref_opt), SCHEDULERS[sched](opt)
    for i in range(STEPS):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        ref_sched.step()
        my_sched.step()
        ref_group_lr, my_group_lr = ref_opt.param_groups[0]["lr"], opt.param_groups[0]["lr"]
        assert isinstance(ref_group_lr, torch.Tensor)
        assert isinstance(my_group_lr, torch.Tensor), f"lr became {type(my_group_lr).__name__}, AdamW keeps a Tensor"
        assert (my_group_lr is my_lr) == (ref_group_lr is ref_lr)
        assert float(my_group_lr) == float(ref_group_lr)
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
        assert_params_close(mine, ref, f"{sched} step {i}")


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-dim", "1-elem-1d", "1-elem-2d"])
def test_tensor_lr_shapes_accepted_like_adamw(shape: tuple[int, ...]) -> None:
    """AdamW accepts any 1-element tensor lr; so must ZenFlow, with the same steps. Also in a second param group
    next to a float-lr group, and added later through add_param_group."""
    ref = make_params()
    mine = twin(ref)
    ref_opt = make_adamw([{"params": ref[:2]}], lr=torch.full(shape, 1e-2))
    opt = make_zen([{"params": mine[:2]}], lr=torch.full(shape, 1e-2))
    ref_opt.add_param_group({"params": ref[2:], "lr": torch.full(shape, 3e-2)})
    opt.add_param_group({"params": mine[2:], "lr": torch.full(shape, 3e-2)})
    for i in range(3):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        assert_params_close(mine, ref, f"step {i}")


def test_tensor_lr_equals_float_lr_with_default_knobs() -> None:
    """With ZenFlow's selection active, a tensor lr gives the run a float lr gives (same schedule)."""
    runs = []
    for lr in (1e-2, torch.tensor(1e-2)):
        params = make_params()
        opt = make_zen(params, lr=lr, topk_ratio=0.1, update_interval=2, overlap=True)
        sched = StepLR(opt, step_size=3, gamma=0.5)
        for i in range(8):
            train_step(opt, params, i)
            sched.step()
        opt.flush()
        runs.append(params)
    assert_params_close(runs[1], runs[0], "tensor lr vs float lr")


@pytest.mark.parametrize(
    "lr", [torch.tensor([1e-3, 1e-3]), torch.tensor(-1.0), torch.tensor([[-1.0]])],
    ids=["2-elements", "negative-0-dim", "negative-1-elem"],
)
def test_tensor_lr_errors_like_adamw(lr: torch.Tensor) -> None:
    with pytest.raises(Exception) as ref_err:
        make_adamw(make_params(), lr=lr)
    with pytest.raises(type(ref_err.value), match=r"(?i)\blr\b|learning rate"):
        make_zen(make_params(), lr=lr)
    # ...and the same through add_param_group
    opt = make_zen(make_params()[:1])
    with pytest.raises(type(ref_err.value), match=r"(?i)\blr\b|learning rate"):
        opt.add_param_group({"params": make_params()[1:], "lr": lr})


# ---------------------------------------------------------------------------------------- non-contiguous params


def test_non_contiguous_params_match_adamw() -> None:
    """A transposed 2-D leaf, a permuted 3-D leaf and a column-sliced 2-D leaf (all large enough to offload) are
    accepted (offloaded through a contiguous layout or kept resident: the issue allows both); at topk_ratio=1,
    update_interval=1 every step equals AdamW's; the parameters keep their strides and storage."""
    ref = make_params(transposed=True, permuted=True, sliced=True)
    mine = twin(ref)
    strides, ptrs = [p.stride() for p in mine], [p.data_ptr() for p in mine]
    ref_opt = make_adamw(ref)
    opt = make_zen(mine, **ALL_ON_DEVICE)
    for i in range(STEPS):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        assert_params_close(mine, ref, f"step {i}")
    assert [p.stride() for p in mine] == strides
    assert [p.data_ptr() for p in mine] == ptrs


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_non_contiguous_params_with_default_knobs(backend: str) -> None:
    """Default ZenFlow knobs: training runs, the parameters stay the same non-contiguous tensors (strides, storage),
    updated in place: a view taken before training sees the trained values."""
    params = make_params(transposed=True, permuted=True, sliced=True)
    strides, ptrs = [p.stride() for p in params], [p.data_ptr() for p in params]
    views = [p.detach() for p in params]  # share storage with the parameters
    before = [p.detach().clone() for p in params]
    opt = make_zen(params, backend=backend, **DEFAULT_KNOBS)
    for i in range(9):
        train_step(opt, params, i)
    opt.flush()
    assert [p.stride() for p in params] == strides
    assert [p.data_ptr() for p in params] == ptrs
    for k, (p, v, b) in enumerate(zip(params, views, before)):
        assert torch.isfinite(p).all(), f"param {k}"
        assert not torch.equal(p, b), f"param {k} did not train"
        assert torch.equal(v, p), f"param {k}: a view taken before training does not see the update"


# ------------------------------------------------------------------------------------------- state_dict hooks


def _trained_pair(**knobs: Any) -> tuple[list[torch.optim.Optimizer], list[list[nn.Parameter]]]:
    ref = make_params()
    mine = twin(ref)
    ref_opt, opt = make_adamw(ref), make_zen(mine, **knobs)
    for i in range(2):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
    return [ref_opt, opt], [ref, mine]


def test_state_dict_pre_hook_like_adamw() -> None:
    """The pre hook is called once, with the optimizer, before the state is packed: what it sets in a param group
    is in the state_dict."""
    results = []
    for opt in _trained_pair()[0]:
        calls = []

        def pre_hook(optimizer, calls=calls, opt=opt):
            calls.append(optimizer is opt)
            optimizer.param_groups[0]["tag"] = "set by the pre hook"

        opt.register_state_dict_pre_hook(pre_hook)
        sd = opt.state_dict()
        results.append((calls, sd["param_groups"][0].get("tag")))
    assert results[0] == ([True], "set by the pre hook")  # what torch does
    assert results[1] == results[0]


def test_state_dict_post_hook_like_adamw() -> None:
    """Post hooks see the finished state_dict (all of its keys), may modify it in place (state entries included),
    and the last one's return value is what state_dict() returns."""
    results = []
    for opt in _trained_pair()[0]:
        plain_keys = set(opt.state_dict())
        seen = []
        wrapper: dict[str, Any] = {}

        def in_place(optimizer, sd, seen=seen, opt=opt, plain_keys=plain_keys):
            seen.append((optimizer is opt, set(sd) == plain_keys))
            sd["extra"] = "added in place"
            first = next(iter(sd["state"]))
            sd["state"][first]["hooked"] = True

        def replace(optimizer, sd, wrapper=wrapper):
            wrapper["wrapped"] = sd
            return wrapper

        opt.register_state_dict_post_hook(in_place)
        opt.register_state_dict_post_hook(replace)
        out = opt.state_dict()
        inner = out.get("wrapped", {})
        state = inner.get("state", {})
        results.append((seen, out is wrapper, inner.get("extra"),
                        bool(state) and state[next(iter(state))].get("hooked")))
    assert results[0] == ([(True, True)], True, "added in place", True)  # what torch does
    assert results[1] == results[0]


def test_load_state_dict_pre_hooks_like_adamw() -> None:
    """Load pre hooks run in order (prepend first) with the optimizer and a shallow copy of the state_dict; the one
    returned by a hook is what gets loaded; the caller's dict is not modified."""
    results = []
    opts, params = _trained_pair()
    for opt, ps in zip(opts, params):
        saved = copy.deepcopy(opt.state_dict())
        fresh_params = twin(ps)
        fresh = make_adamw(fresh_params) if isinstance(opt, torch.optim.AdamW) else make_zen(fresh_params)
        calls = []

        def first(optimizer, sd, calls=calls, fresh=fresh):
            calls.append(("first", optimizer is fresh))

        def modify(optimizer, sd, calls=calls, fresh=fresh, saved=saved):
            calls.append(("modify", optimizer is fresh, sd is saved))
            new = dict(sd)
            new["param_groups"] = [dict(g, lr=0.05) for g in sd["param_groups"]]
            return new

        fresh.register_load_state_dict_pre_hook(modify)
        fresh.register_load_state_dict_pre_hook(first, prepend=True)
        fresh.load_state_dict(saved)
        results.append((calls, [float(g["lr"]) for g in fresh.param_groups], saved["param_groups"][0]["lr"]))
        train_step(fresh, fresh_params, 2)
        ps[:] = fresh_params  # compare the loaded-and-stepped params below
    assert results[0] == ([("first", True), ("modify", True, False)], [0.05], 1e-2)  # what torch does
    assert results[1] == results[0]
    assert_params_close(params[1], params[0], "a step after loading the hook's state_dict")


def test_load_state_dict_post_hook_like_adamw() -> None:
    """The load post hook is called once, with the optimizer, after the state is loaded."""
    results = []
    opts, params = _trained_pair()
    for opt, ps in zip(opts, params):
        saved = copy.deepcopy(opt.state_dict())
        saved["param_groups"][0]["lr"] = 0.04
        fresh = make_adamw(twin(ps)) if isinstance(opt, torch.optim.AdamW) else make_zen(twin(ps))
        calls = []

        def post(optimizer, calls=calls, fresh=fresh):
            n_state = sum(1 for g in optimizer.param_groups for p in g["params"] if optimizer.state.get(p))
            calls.append((optimizer is fresh, float(optimizer.param_groups[0]["lr"]), n_state))

        fresh.register_load_state_dict_post_hook(post)
        assert fresh.load_state_dict(saved) is None
        results.append(calls)
    assert results[0] == [(True, 0.04, 4)]  # what torch does
    assert results[1] == results[0]


# ------------------------------------------------------------------------------------------------- step hooks


def test_step_hooks_like_adamw() -> None:
    """Local and global step pre/post hooks: called once per step, in order, with (optimizer, args, kwargs), pre
    before the parameters change, post after; removable through their handles."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    results = []
    for opt, ps in zip(*_trained_pair()):
        calls = []
        before = ps[0].detach().clone()

        def hook(name, calls=calls, opt=opt, ps=ps, before=before):
            def fn(optimizer, args, kwargs):
                if optimizer is opt:  # global hooks see every optimizer
                    calls.append((name, args[:1] == (opt,), sorted(kwargs), torch.equal(ps[0], before)))
            return fn

        handles = [opt.register_step_pre_hook(hook("pre")), opt.register_step_post_hook(hook("post")),
                   register_optimizer_step_pre_hook(hook("global pre")),
                   register_optimizer_step_post_hook(hook("global post"))]
        try:
            train_step(opt, ps, 2)
        finally:
            for h in handles:
                h.remove()
        train_step(opt, ps, 3)  # removed: not called again
        results.append(calls)
    expected = [("global pre", True, [], True), ("pre", True, [], True),
                ("post", True, [], False), ("global post", True, [], False)]
    assert results[0] == expected  # what torch does
    assert results[1] == results[0]


# ---------------------------------------------------------------------------------------------- deepcopy, pickle


@pytest.mark.parametrize("knobs", [ALL_ON_DEVICE, dict(topk_ratio=0.1, update_interval=2, overlap=True)],
                         ids=["topk1", "topk0.1-overlap"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_is_a_working_optimizer(how: str, knobs: dict[str, Any]) -> None:
    """copy.deepcopy / pickle give what they give for AdamW: an optimizer over copied parameters with equal
    defaults, param_groups and state, which then steps exactly as the original does. Closing the copy leaves the
    original working."""
    params = make_params()
    opt = make_zen(params, **knobs)
    ref_params = twin(params)
    ref_opt = make_adamw(ref_params)
    for i in range(3):
        train_step(opt, params, i)
        train_step(ref_opt, ref_params, i)

    def dup(o: Any) -> Any:
        return copy.deepcopy(o) if how == "deepcopy" else pickle.loads(pickle.dumps(o))

    clone, ref_clone = dup(opt), dup(ref_opt)
    _opened.append(clone)
    assert type(clone) is type(opt)
    cparams = [p for g in clone.param_groups for p in g["params"]]
    ref_cparams = [p for g in ref_clone.param_groups for p in g["params"]]
    assert len(cparams) == len(params) and all(c is not p for c, p in zip(cparams, params))
    for c, p in zip(cparams, params):
        assert torch.equal(c, p) and c.stride() == p.stride()
    assert clone.defaults == opt.defaults
    assert hyperparams(clone) == hyperparams(opt)
    assert clone.config == opt.config
    assert all(clone.state.get(c) for c in cparams) and not any(p in clone.state for p in params)
    assert_same_tree(clone.state_dict(), opt.state_dict())
    for i in range(3, 7):
        train_step(opt, params, i)
        train_step(clone, cparams, i)
        train_step(ref_clone, ref_cparams, i)
    opt.flush()
    clone.flush()
    for k, (a, b) in enumerate(zip(cparams, params)):
        assert torch.equal(a, b), f"param {k}: the copy steps differently from the original"
    if knobs["topk_ratio"] == 1.0:
        assert_params_close(cparams, ref_cparams, "copy vs a copied AdamW")
    clone.close()
    train_step(opt, params, 7)


# ---------------------------------------------------------------------------------------- duplicate parameters


def test_duplicate_param_in_one_group_warns_like_adamw() -> None:
    """torch 2.13 warns (UserWarning, "duplicate parameters"), keeps the group as given and steps a duplicated
    parameter once per occurrence (its step count advances twice per step()). ZenFlow must warn the same way instead
    of refusing, and at topk_ratio=1 step as AdamW does; with the default knobs it must train."""
    ref = make_params()
    mine = twin(ref)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ref_opt = make_adamw([ref[0], ref[1], ref[0], ref[1]])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = make_zen([mine[0], mine[1], mine[0], mine[1]])
    for i in range(3):
        for o, ps in ((ref_opt, ref), (opt, mine)):
            o.zero_grad()
            loss_fn(ps[:2], i).backward()
            o.step()
        assert_params_close(mine[:2], ref[:2], f"step {i}")
    params = make_params()
    before = [p.detach().clone() for p in params[:2]]
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = make_zen([params[0], params[1], params[0]], **DEFAULT_KNOBS)
    for i in range(5):
        opt.zero_grad()
        loss_fn(params[:2], i).backward()
        opt.step()
    opt.flush()
    for p, b in zip(params[:2], before):
        assert torch.isfinite(p).all() and not torch.equal(p, b)


@pytest.mark.parametrize("knobs", [dict(warmup_steps=3), dict(topk_ratio=0.0)], ids=["warm-up", "host-windows"])
def test_duplicate_param_steps_twice_on_the_host_too(knobs) -> None:
    """The warm-up (synchronous AdamW on every element) and one-step host windows step a parameter listed twice once
    per occurrence, as AdamW does: its second window is applied after the first, not in its place."""
    ref = make_params()
    mine = twin(ref)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ref_opt = make_adamw([ref[0], ref[1], ref[0]])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = ZenFlowAdamW([mine[0], mine[1], mine[0]], lr=1e-2, weight_decay=0.1, update_interval=1, overlap=False,
                           min_offload_numel=MIN_OFFLOAD, **{"topk_ratio": 1.0, "warmup_steps": 0, **knobs})
    _opened.append(opt)
    for i in range(5):
        for o, ps in ((ref_opt, ref), (opt, mine)):
            o.zero_grad()
            loss_fn(ps[:2], i).backward()
            o.step()
        assert_params_close(mine[:2], ref[:2], f"step {i}")


def test_duplicate_param_across_groups_refused_like_adamw() -> None:
    for factory in (make_adamw, make_zen):
        p, q = make_params()[:2]
        with pytest.raises(ValueError, match="more than one parameter group"):
            factory([{"params": [p, q]}, {"params": [p]}])
        opt = factory([p])
        with pytest.raises(ValueError, match="more than one parameter group"):
            opt.add_param_group({"params": [q, p]})


# -------------------------------------------------------------------------------------- min_offload_numel = 0


def test_min_offload_numel_zero_offloads_every_matrix() -> None:
    """min_offload_numel=0: every ndim >= 2 parameter is offloaded (a [1, 1] one too), vectors and scalars stay
    resident; the steps equal AdamW's."""
    ref = make_params() + [nn.Parameter(torch.tensor([[0.5]])), nn.Parameter(torch.randn(2, 3)),
                           nn.Parameter(torch.tensor(0.25))]
    mine = twin(ref)
    ref_opt = make_adamw(ref)
    opt = make_zen(mine, min_offload_numel=0)
    for i in range(4):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        assert_params_close(mine, ref, f"step {i}")
    assert opt.stats()["offloaded_params"] == sum(p.numel() for p in mine if p.dim() >= 2)


# ------------------------------------------------------------------------------------------- per-group flags

# torch.optim.AdamW's per-group keys beyond lr/betas/eps/weight_decay, and the value each has in AdamW's defaults.
ADAMW_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "decoupled_weight_decay": True}


def test_adamw_group_flags_are_the_ones_known_here() -> None:
    """If torch adds a per-group key, decide whether ZenFlow accepts it (and extend the tests below)."""
    defaults = torch.optim.AdamW([nn.Parameter(torch.zeros(2))]).defaults
    assert set(defaults) - {"lr", "betas", "eps", "weight_decay"} == set(ADAMW_FLAGS)
    assert {k: defaults[k] for k in ADAMW_FLAGS} == ADAMW_FLAGS


@pytest.mark.parametrize("key", ["maximize", "amsgrad", "capturable", "differentiable"])
def test_group_flag_true_refused_by_name(key: str) -> None:
    """AdamW accepts these flags True in a group; they change what the optimizer computes (or must support), ZenFlow
    does not implement them, so it must refuse them with a ValueError naming the flag (at construction and in
    add_param_group), never ignore them."""
    torch.optim.AdamW([{"params": make_params()[:1], key: True}])  # what torch accepts
    with pytest.raises(ValueError, match=key):
        make_zen([{"params": make_params()[:1], key: True}])
    opt = make_zen(make_params()[:1])
    with pytest.raises(ValueError, match=key):
        opt.add_param_group({"params": make_params()[1:], key: True})
    # as a constructor argument, where torch has one: refused by name too (TypeError or ValueError)
    with pytest.raises((TypeError, ValueError), match=key):
        ZenFlowAdamW(make_params(), **{key: True})


@pytest.mark.parametrize("key", ["foreach", "fused"])
def test_implementation_choice_flags_accepted(key: str) -> None:
    """foreach / fused choose torch's implementation, not the math: True is accepted in a group (as AdamW does) and
    the steps equal AdamW's."""
    ref = make_params()
    mine = twin(ref)
    ref_opt = make_adamw([{"params": ref}])
    opt = make_zen([{"params": mine, key: True}])
    for i in range(3):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        assert_params_close(mine, ref, f"step {i}")


def test_group_with_adamw_flag_values_accepted_and_equal_to_adamw() -> None:
    """Groups carrying AdamW's own flag values (what a user swapping optimizers passes, or copies from an AdamW's
    param_groups) are accepted, and the steps equal AdamW's with those groups."""
    ref = make_params()
    mine = twin(ref)
    ref_opt = make_adamw([{"params": ref[:2], **ADAMW_FLAGS}, {"params": ref[2:], **ADAMW_FLAGS, "foreach": False}])
    opt = make_zen([{"params": mine[:2], **ADAMW_FLAGS}, {"params": mine[2:], **ADAMW_FLAGS, "foreach": False}])
    for i in range(3):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        assert_params_close(mine, ref, f"step {i}")


def test_decoupled_weight_decay_false_honoured_or_refused() -> None:
    """decoupled_weight_decay=False in an AdamW group means Adam's L2 decay: ZenFlowAdamW must either do that (equal
    to AdamW with that group) or refuse it by name; never silently decay the decoupled way."""
    ref = make_params()
    mine = twin(ref)
    ref_opt = make_adamw([{"params": ref, "decoupled_weight_decay": False, "weight_decay": 0.5}])
    try:
        opt = make_zen([{"params": mine, "decoupled_weight_decay": False, "weight_decay": 0.5}])
    except ValueError as e:
        assert "decoupled_weight_decay" in str(e)
        return
    for i in range(3):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        assert_params_close(mine, ref, f"step {i}")


def test_zenflow_adam_accepts_adam_group_flags() -> None:
    """The same for ZenFlowAdam against torch.optim.Adam (decoupled_weight_decay=False is Adam's own value)."""
    ref = make_params()
    mine = twin(ref)
    flags = {k: v for k, v in torch.optim.Adam(make_params()[:1]).defaults.items()
             if k not in ("lr", "betas", "eps", "weight_decay")}
    assert flags["decoupled_weight_decay"] is False
    ref_opt = torch.optim.Adam([{"params": ref, **flags}], lr=1e-2, weight_decay=0.1, foreach=False)
    opt = make_zen([{"params": mine, **flags}], cls=ZenFlowAdam)
    for i in range(3):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        assert_params_close(mine, ref, f"step {i}")


def test_complex_params_refused_by_name() -> None:
    """AdamW accepts complex parameters; ZenFlow does not, and says so (constructor and add_param_group)."""
    z = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    torch.optim.AdamW([z])  # what torch accepts
    with pytest.raises(ValueError, match="complex"):
        make_zen([z])
    opt = make_zen(make_params())
    with pytest.raises(ValueError, match="complex"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, dtype=torch.complex64))]})


@pytest.mark.parametrize(
    "case",
    ["single tensor", "empty", "mixed names", "negative lr", "beta1 = 1", "negative weight_decay", "negative eps",
     "float and tensor betas"],
)
def test_constructor_errors_like_adamw(case: str) -> None:
    """The error inputs torch's OptimizerInfo gives every optimizer (and AdamW): the same exception type."""
    p, q = make_params()[:2]
    params, kwargs = {
        "single tensor": (p, {}),
        "empty": ([], {}),
        "mixed names": ([("weight", p), q], {}),
        "negative lr": ([p], dict(lr=-1.0)),
        "beta1 = 1": ([p], dict(betas=(1.0, 0.0))),
        "negative weight_decay": ([p], dict(weight_decay=-1.0)),
        "negative eps": ([p], dict(eps=-1.0)),
        "float and tensor betas": ([p], dict(betas=(0.9, torch.tensor(0.99)))),
    }[case]
    with pytest.raises(Exception) as ref_err:
        torch.optim.AdamW(params, **kwargs)
    with pytest.raises(type(ref_err.value)):
        opt = ZenFlowAdamW(params, min_offload_numel=MIN_OFFLOAD, **kwargs)
        _opened.append(opt)


# --------------------------------------------------------------------------- zero_grad, state_dict, param_groups


@pytest.mark.parametrize("set_to_none", [True, False, None], ids=["to-none", "to-zero", "default"])
def test_zero_grad_like_adamw(set_to_none: bool | None) -> None:
    results = []
    for opt, ps in zip(*_trained_pair()):
        loss_fn(ps, 5).backward()
        grads = [p.grad for p in ps]
        opt.zero_grad() if set_to_none is None else opt.zero_grad(set_to_none=set_to_none)
        results.append([
            None if p.grad is None else (p.grad is g, bool((p.grad == 0).all()), p.grad.requires_grad)
            for p, g in zip(ps, grads)
        ])
    assert results[0] == ([None] * 4 if set_to_none in (True, None) else [(True, True, False)] * 4)  # torch
    assert results[1] == results[0]


@pytest.mark.parametrize("knobs", [ALL_ON_DEVICE, dict(topk_ratio=0.1, update_interval=2, overlap=True)],
                         ids=["topk1", "topk0.1-overlap"])
def test_state_dict_round_trip_into_fresh_optimizer(knobs: dict[str, Any]) -> None:
    """state_dict() through torch.save into a fresh optimizer over fresh parameters: its state_dict() equals the
    saved one, and the following steps equal the original's (and AdamW's at topk_ratio=1)."""
    params = make_params()
    opt = make_zen(params, **knobs)
    ref = twin(params)
    ref_opt = make_adamw(ref)
    for i in range(3):
        train_step(opt, params, i)
        train_step(ref_opt, ref, i)
    saved = opt.state_dict()
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh_params = twin(params)
    fresh = make_zen(fresh_params, **knobs)
    fresh.load_state_dict(loaded)
    assert_same_tree(fresh.state_dict(), opt.state_dict())
    assert hyperparams(fresh) == hyperparams(opt)
    for i in range(3, 7):
        train_step(opt, params, i)
        train_step(fresh, fresh_params, i)
        train_step(ref_opt, ref, i)
    opt.flush()
    fresh.flush()
    for k, (a, b) in enumerate(zip(fresh_params, params)):
        assert torch.equal(a, b), f"param {k}: the loaded optimizer steps differently"
    if knobs["topk_ratio"] == 1.0:
        assert_params_close(params, ref, "vs AdamW")


def test_param_groups_and_defaults_like_adamw() -> None:
    ref, mine = make_params(), make_params()
    kwargs = dict(lr=2e-2, betas=(0.8, 0.95), weight_decay=0.05)
    ref_opt = make_adamw(ref, **kwargs)
    opt = make_zen(mine, **kwargs)
    for group, ref_group in zip(opt.param_groups, ref_opt.param_groups):
        assert {"params", "lr", "betas", "eps", "weight_decay"} <= set(group)
        assert {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")} == \
            {k: ref_group[k] for k in ("lr", "betas", "eps", "weight_decay")}
        assert group["params"] == mine
    for k in ("lr", "betas", "eps", "weight_decay"):
        assert opt.defaults[k] == ref_opt.defaults[k]
    text = repr(opt)
    assert "Parameter Group 0" in text and "lr: 0.02" in text


def test_named_parameters_like_adamw() -> None:
    """(name, tensor) pairs as params: accepted, and the names are in param_groups and the state_dict as AdamW
    puts them."""
    ref, mine = make_params(), make_params()
    ref_opt = make_adamw([(f"p{i}", p) for i, p in enumerate(ref)])
    opt = make_zen([(f"p{i}", p) for i, p in enumerate(mine)])
    train_step(ref_opt, ref, 0)
    train_step(opt, mine, 0)
    assert opt.param_groups[0].get("param_names") == ref_opt.param_groups[0]["param_names"]
    assert opt.state_dict()["param_groups"][0].get("param_names") == \
        ref_opt.state_dict()["param_groups"][0]["param_names"]
    assert_params_close(mine, ref)


# ----------------------------------------------------------------------------- missing grads, closures, no-ops


def test_steps_with_some_grads_none_match_adamw() -> None:
    """Parameters whose grad is None on some steps are skipped that step (AdamW's per-parameter step count);
    a parameter that never gets one gets no state."""
    ref = make_params() + [nn.Parameter(torch.randn(16, 24))]
    mine = twin(ref)
    ref_opt, opt = make_adamw(ref), make_zen(mine)
    for i in range(STEPS):
        for o, ps in ((ref_opt, ref), (opt, mine)):
            o.zero_grad()
            loss_fn(ps[:4], i).backward()
            for k, p in enumerate(ps[:4]):
                if (i + k) % 3 == 0:
                    p.grad = None
            o.step()
        assert_params_close(mine, ref, f"step {i}")
    assert not ref_opt.state.get(ref[4]) and not opt.state.get(mine[4])
    assert torch.equal(mine[4], ref[4])


def test_closure_like_adamw() -> None:
    """step(closure): the closure runs once, with grad enabled, computing the gradients the step uses; step returns
    the closure's loss."""
    ref = make_params()
    mine = twin(ref)
    ref_opt, opt = make_adamw(ref), make_zen(mine)
    for i in range(3):
        returned = []
        for o, ps in ((ref_opt, ref), (opt, mine)):
            calls = []

            def closure(o=o, ps=ps, calls=calls, i=i):
                calls.append(torch.is_grad_enabled())
                o.zero_grad()
                loss = loss_fn(ps, i)
                loss.backward()
                return loss

            loss = o.step(closure)
            assert calls == [True]
            assert isinstance(loss, torch.Tensor)
            returned.append(loss.item())
        assert returned[1] == returned[0]
        assert_params_close(mine, ref, f"step {i}")


@pytest.mark.parametrize("knobs", [ALL_ON_DEVICE, DEFAULT_KNOBS], ids=["topk1", "default-knobs"])
def test_step_without_grads_is_a_noop(knobs: dict[str, Any]) -> None:
    """step() before any backward (every grad None) changes nothing and creates no state, as in AdamW; it does not
    count as a step for what follows (at topk_ratio=1: the later steps still equal AdamW's)."""
    ref = make_params()
    mine = twin(ref)
    ref_opt, opt = make_adamw(ref), make_zen(mine, **knobs)
    ref_opt.step()
    opt.step()
    assert len(ref_opt.state) == 0
    assert len(opt.state) == 0 or not any(opt.state.values())
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
    if knobs["topk_ratio"] == 1.0:
        for i in range(3):
            train_step(ref_opt, ref, i)
            train_step(opt, mine, i)
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_opt.step()  # a no-op between real steps too
        opt.step()
        train_step(ref_opt, ref, 3)
        train_step(opt, mine, 3)
        assert_params_close(mine, ref)


# ------------------------------------------------------------------------------------------- AdamW equivalence


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_topk1_equals_adamw(backend: str, overlap: bool) -> None:
    """topk_ratio=1, update_interval=1: every column is selected every step, so ZenFlow is AdamW: two groups with
    their own lr and weight decay, OneCycleLR (lr and betas[0] change every step), several steps, fp32."""
    ref = make_params()
    mine = twin(ref)
    ref_opt = make_adamw([{"params": ref[:2]}, {"params": ref[2:], "lr": 2e-2, "weight_decay": 0.3}])
    opt = make_zen([{"params": mine[:2]}, {"params": mine[2:], "lr": 2e-2, "weight_decay": 0.3}],
                   topk_ratio=1.0, update_interval=1, overlap=overlap, backend=backend)
    steps = 8
    ref_sched = OneCycleLR(ref_opt, max_lr=[2e-2, 4e-2], total_steps=steps)
    sched = OneCycleLR(opt, max_lr=[2e-2, 4e-2], total_steps=steps)
    for i in range(steps):
        train_step(ref_opt, ref, i)
        train_step(opt, mine, i)
        ref_sched.step()
        sched.step()
        assert_params_close(mine, ref, f"step {i}")
    opt.flush()
    assert_params_close(mine, ref, "after flush")
    assert opt.stats()["offloaded_params"] == sum(p.numel() for p in mine if p.dim() >= 2)


def test_no_warnings_in_ordinary_use() -> None:
    """An ordinary AdamW-style run (tensor-free, scheduler, state_dict) emits no warnings torch would not."""
    params = make_params()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = make_zen(params, **DEFAULT_KNOBS)
        sched = StepLR(opt, step_size=2)
        for i in range(3):
            train_step(opt, params, i)
            sched.step()
        opt.state_dict()
        opt.flush()


# -------------------------------------------------------------------- issue 20: the contract at its edges


@pytest.mark.parametrize("with_post_hook", [False, True], ids=["pre", "pre+post"])
def test_state_dict_pre_hook_adding_a_non_parameter_key_like_adamw(with_post_hook: bool) -> None:
    """torch's TestOptimRenewed: a pre hook sets ``optimizer.state["test"] = 1``; torch packs and loads such a key as
    it is (and a post hook may pop it again)."""
    results = []
    for opt in _trained_pair()[0]:
        opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
        if with_post_hook:
            def post_hook(o, sd):
                sd["ran_post_hook"] = sd["state"].pop("test", None) == 1
            opt.register_state_dict_post_hook(post_hook)
        sd = opt.state_dict()
        results.append((sd["state"].get("test"), sd.get("ran_post_hook")))
        if not with_post_hook:
            del opt.state["test"]
            opt.load_state_dict(sd)  # torch keeps the key in the loaded state
            results.append(opt.state.get("test"))
    expected = [(None, True)] if with_post_hook else [(1, None), 1]
    assert results[: len(expected)] == expected  # what torch does
    assert results[len(expected):] == results[: len(expected)]


def test_tensor_betas_like_adamw() -> None:
    params, ref_params = make_params(), None
    ref_params = twin(params)
    betas = (torch.tensor(0.9), torch.tensor(0.99))
    zen = make_zen(params, betas=betas, **ALL_ON_DEVICE)
    ref = make_adamw(ref_params, betas=betas)
    for i in range(STEPS):
        train_step(zen, params, i)
        train_step(ref, ref_params, i)
    assert_params_close(params, ref_params, "tensor betas")
    sd = zen.state_dict()
    assert isinstance(sd["param_groups"][0]["betas"][0], torch.Tensor)  # kept as given, as torch keeps them


@pytest.mark.parametrize("betas", [(0.9, torch.tensor(0.99)), (torch.tensor(0.9), 0.99)], ids=["float-tensor",
                                                                                             "tensor-float"])
def test_mixed_betas_refused_with_torchs_message(betas) -> None:
    p = make_params()[0]
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        torch.optim.AdamW([p], betas=betas)
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        _opened.append(ZenFlowAdamW([p], betas=betas, warmup_steps=0))


def test_numpy_hyperparameters_like_adamw() -> None:
    np = pytest.importorskip("numpy")
    kwargs = dict(lr=np.float32(0.01), eps=np.float64(1e-8), weight_decay=np.float32(0.1),
                  betas=np.array([0.9, 0.999]))
    params = make_params()
    ref_params = twin(params)
    zen = ZenFlowAdamW(params, min_offload_numel=MIN_OFFLOAD, **ALL_ON_DEVICE, **kwargs)
    _opened.append(zen)
    ref = torch.optim.AdamW(ref_params, foreach=False, **kwargs)
    zen.add_param_group({"params": [nn.Parameter(torch.ones(5))], "lr": np.float64(1e-3)})
    ref.add_param_group({"params": [nn.Parameter(torch.ones(5))], "lr": np.float64(1e-3)})
    for i in range(STEPS):
        train_step(zen, params, i)
        train_step(ref, ref_params, i)
    assert_params_close(params, ref_params, "numpy hyperparameters")
    # Refused values stay refused, numpy or not, with torch's message.
    with pytest.raises(ValueError, match="Invalid learning rate|Invalid lr"):
        _opened.append(ZenFlowAdamW(make_params()[:1], lr=np.float32(-1.0), warmup_steps=0))
