"""bench/quality_fair.py's code, run at smoke sizes (seconds), so a broken benchmark is found in CI, not after an
hour of measuring: every task, AdamW and ZenFlow with overlap on and off and two host_lr_scale values, the JSON and
Markdown it writes, the summary's arithmetic on hand-made numbers, and the spike metric."""

from __future__ import annotations

import copy
import json
import math
from importlib import resources
from pathlib import Path

import pytest
import quality_fair
import torch
from late_adamw import LateAdamW

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.autotune.quality import DEFAULT_TABLE, load_quality_table


def test_smoke_run_writes_json_markdown_and_table_entries(tmp_path: Path) -> None:
    out = tmp_path / "fair"
    assert quality_fair.main(["--smoke", "--out", str(out), "--scales", "1", "2"]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    names = [c["name"] for c in doc["configs"]]
    assert names == ["AdamW", "ZenFlow overlap s=1", "ZenFlow overlap s=2", "ZenFlow sequential s=1",
                     "ZenFlow sequential s=2"]
    assert [t["name"] for t in doc["tasks"]] == ["finetune", "scratch", "long", "arith", "shift"]
    for task in doc["tasks"]:
        for name in names:
            for lr in task["lrs"]:
                run = doc["runs"][task["name"]][name][f"{lr:g}"]["1"]
                assert math.isfinite(run["loss"]) and 0 < run["loss"] < 10 and run["spike"] >= 0
                assert len(run["curve"]) == task["steps"]  # short runs keep every step's loss
    summary = quality_fair.summarize(doc)
    assert summary["finetune"]["configs"]["AdamW"]["best_to_best"] == 1.0
    # The knob is wired through: s=2 and s=1 train differently.
    runs = doc["runs"]["long"]
    assert runs["ZenFlow overlap s=1"]["0.001"]["1"]["loss"] != runs["ZenFlow overlap s=2"]["0.001"]["1"]["loss"]
    md = out.with_suffix(".md").read_text()
    assert "## long" in md and "| ZenFlow sequential s=2 |" in md and doc["command"] in md
    # --report rebuilds the same Markdown from the JSON alone.
    assert quality_fair.render(doc, summary).strip() == md.strip()
    # --table writes the host_lr_scale entries the autotuner reads into a quality table, the rest unchanged.
    shipped = resources.files("zenflow_triton.autotune").joinpath(DEFAULT_TABLE).read_text()
    table = tmp_path / "q.json"
    table.write_text(shipped)
    assert quality_fair.main(["--report", str(out.with_suffix(".json")), "--table", str(table)]) == 0
    entries = load_quality_table(table).host_scales
    assert [(e.overlap, e.host_lr_scale, e.tasks) for e in entries] == [
        (True, 2.0, ("finetune", "scratch", "long", "arith", "shift")),
        (False, 2.0, ("finetune", "scratch", "long", "arith", "shift"))]
    rows = summary["scratch"]["configs"]
    assert entries[0].ratio[1] == pytest.approx(rows["ZenFlow overlap s=2"]["best_loss"]
                                                / rows["ZenFlow overlap s=1"]["best_loss"], abs=1e-4)
    again, before = json.loads(table.read_text()), json.loads(shipped)
    again.pop("host_lr_scale")
    before.pop("host_lr_scale", None)
    assert again == before  # only the entries are replaced


def test_add_to_measures_only_the_missing_configurations(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    assert quality_fair.main(["--smoke", "--out", str(first), "--scales", "1", "--tasks", "finetune", "long"]) == 0
    assert quality_fair.main(["--smoke", "--out", str(second), "--scales", "1", "3",
                              "--add-to", str(first.with_suffix(".json"))]) == 0
    one, two = (json.loads(p.with_suffix(".json").read_text()) for p in (first, second))
    assert [c["name"] for c in two["configs"]] == [c["name"] for c in one["configs"]] + [
        "ZenFlow overlap s=3", "ZenFlow sequential s=3"]
    assert two["runs"]["finetune"]["AdamW"] == one["runs"]["finetune"]["AdamW"]  # reused, not rerun
    assert set(two["runs"]["long"]["ZenFlow sequential s=3"]) == {"0.001", "0.002"}
    assert two["measured"]["added"][0]["adamw_rerun_equal"]
    md = second.with_suffix(".md").read_text()
    assert "added ZenFlow overlap s=3, ZenFlow sequential s=3" in md and "| ZenFlow overlap s=3 |" in md


def test_add_to_fills_in_new_lrs_and_knob_variants_only_where_asked(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    assert quality_fair.main(["--smoke", "--out", str(first), "--scales", "1", "--tasks", "scratch"]) == 0
    assert quality_fair.main(["--smoke", "--out", str(second), "--add-to", str(first.with_suffix(".json")),
                              "--scales", "1", "--overlaps", "on", "--warmups", "0", "2", "--select-intervals", "0",
                              "4", "--add-lrs", "8e-3", "--at-lrs", "8e-3"]) == 0
    one, two = (json.loads(p.with_suffix(".json").read_text()) for p in (first, second))
    runs = two["runs"]["scratch"]
    assert two["tasks"][0]["lrs"] == [5e-4, 1e-3, 8e-3]
    assert set(runs["AdamW"]) == set(runs["ZenFlow overlap s=1"]) == {"0.0005", "0.001", "0.008"}
    assert set(runs["ZenFlow sequential s=1"]) == {"0.0005", "0.001"}  # not asked for: not run at the new lr
    for name in ("ZenFlow overlap s=1 warm=2", "ZenFlow overlap s=1 S=4", "ZenFlow overlap s=1 warm=2 S=4"):
        assert set(runs[name]) == {"0.008"}
    assert runs["AdamW"]["0.001"] == one["runs"]["scratch"]["AdamW"]["0.001"]  # old cells kept
    losses = {name: runs[name]["0.008"]["1"]["loss"] for name in runs if "0.008" in runs[name]}
    assert len(set(losses.values())) == len(losses)  # warmup_steps and select_interval are wired through
    rows = quality_fair.summarize(two)["scratch"]["configs"]
    assert set(rows["ZenFlow sequential s=1"]["equal_lr"]) == {"0.0005", "0.001"}
    assert rows["ZenFlow overlap s=1 warm=2"]["best_lr"] == 0.008
    assert rows["ZenFlow overlap s=1 warm=2"]["best_to_best"] == pytest.approx(
        losses["ZenFlow overlap s=1 warm=2"] / min(runs["AdamW"][k]["1"]["loss"] for k in runs["AdamW"]))
    md = second.with_suffix(".md").read_text()
    assert "| ZenFlow overlap s=1 warm=2 S=4 | 0.008* |" in md and "at lrs 0.008 on scratch" in md
    # Table entries compare scales at the default warm-up and selection only.
    assert quality_fair.host_scale_entries(two, quality_fair.summarize(two)) == []


def _doc(losses: dict[str, dict[str, dict[str, float]]], lrs: list[float], seeds: list[int]) -> dict:
    runs = {name: {lr: {s: {"loss": x, "spike": 0.0, "curve": []} for s, x in per_seed.items()}
                   for lr, per_seed in by_lr.items()} for name, by_lr in losses.items()}
    return {"configs": [{"name": n} for n in losses], "seeds": seeds, "runs": {"t": runs},
            "tasks": [{"name": "t", "lrs": lrs}]}


def test_summary_compares_each_optimizer_at_its_best_lr() -> None:
    # AdamW is best at lr 2 (mean 1.0); Z at lr 1 (mean 1.05): best-to-best 1.05, per seed 1.1/1.0 and 1.0/1.0.
    doc = _doc({"AdamW": {"1": {"1": 1.2, "2": 1.2}, "2": {"1": 1.0, "2": 1.0}},
                "Z": {"1": {"1": 1.1, "2": 1.0}, "2": {"1": 1.2, "2": 1.3}}}, [1.0, 2.0], [1, 2])
    z = quality_fair.summarize(doc)["t"]["configs"]["Z"]
    assert z["best_lr"] == 1.0 and z["best_loss"] == pytest.approx(1.05)
    assert z["best_to_best"] == pytest.approx(1.05)
    assert z["best_to_best_seeds"] == pytest.approx([1.0, 1.1])
    assert z["equal_lr"]["2"] == pytest.approx([1.25, 1.2, 1.3])
    assert z["best_at_grid_edge"]
    # A seed missing for one optimizer is left out everywhere (a run cut short).
    del doc["runs"]["t"]["Z"]["2"]["2"]
    assert quality_fair.summarize(doc)["t"]["seeds"] == [1]


def test_spike_sees_a_rise_after_the_start_not_the_descent() -> None:
    falling = [5.0 - 0.004 * i for i in range(1000)]
    assert quality_fair.spike(falling) == 0.0
    bumped = list(falling)
    for i in range(600, 640):
        bumped[i] += 1.0  # a 40-step excursion of +1 nat on a loss near 2.6
    assert 0.3 < quality_fair.spike(bumped) < 0.45
    diverged = falling[:500] + [math.nan] * 500
    assert quality_fair.spike(diverged) == math.inf


def _late_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 1))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 64, generator=gen)
    return (model(x) - 1.0).square().mean()


def test_late_adamw_is_adamw_with_the_offloadable_matrices_one_update_late() -> None:
    model = _late_model()
    opt = LateAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    assert opt.late == [True, False, False, False]  # [80, 64] offloads (5120 >= 4096); [1, 80] and biases do not
    ref = copy.deepcopy(model)  # torch AdamW given LateAdamW's gradients: the masters' trajectory
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(1, 6):
        _loss(model, step).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        before = [q.detach().clone() for q in ref.parameters()]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        masters = opt.param_groups[0]["params"]
        for late, p, m, q, old in zip(opt.late, model.parameters(), masters, ref.parameters(), before):
            assert torch.equal(m, q)  # the masters are AdamW's own
            assert torch.equal(p, old if late else q)  # the offloadable matrix lags by exactly one update
            assert late == (step > 0 and not torch.equal(p, q))
    opt.flush()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_zenflow_overlap_with_one_step_host_windows_is_late_adamw() -> None:
    # topk_ratio=0, update_interval=1, overlap=True: every column is a one-step host window applied one step late,
    # which is LateAdamW's schedule; the host kernel's sqrt and fma round within an ulp of torch's (DESIGN §3).
    model, twin = _late_model(), _late_model()
    late = LateAdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    zen = ZenFlowAdamW(twin.parameters(), lr=1e-2, weight_decay=0.01, topk_ratio=0.0, update_interval=1,
                       overlap=True, cpu_threads=1, warmup_steps=0)
    try:
        for step in range(1, 9):
            for m, o in ((model, late), (twin, zen)):
                _loss(m, step).backward()
                o.step()
                o.zero_grad()
            for p, q in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        assert not torch.equal(model[0].weight, late.param_groups[0]["params"][0])  # it is one update behind
        late.flush()
        zen.flush()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    finally:
        zen.close()


def test_smoke_run_with_the_late_reference(tmp_path: Path) -> None:
    out = tmp_path / "late"
    assert quality_fair.main(["--smoke", "--out", str(out), "--scales", "1", "--overlaps", "on", "--late",
                              "--tasks", "scratch"]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [c["name"] for c in doc["configs"]] == ["AdamW", quality_fair.LATE, "ZenFlow overlap s=1"]
    runs = doc["runs"]["scratch"]
    assert runs[quality_fair.LATE]["0.001"]["1"]["loss"] != runs["AdamW"]["0.001"]["1"]["loss"]
    rows = quality_fair.summarize(doc)["scratch"]["configs"]
    assert rows["AdamW"]["best_to_best"] == 1.0 and quality_fair.LATE in rows
    assert quality_fair.host_scale_entries(doc, quality_fair.summarize(doc)) == []  # a reference, not a scale


def test_add_to_after_a_new_lowest_lr_without_adamw(tmp_path: Path) -> None:
    # --skip-adamw at a new lowest lr leaves AdamW without runs at the grid's first lr: a later --add-to must find
    # AdamW's seeds and its rerun cell at an lr it was run at.
    one, two, three = (tmp_path / n for n in ("one", "two", "three"))
    assert quality_fair.main(["--smoke", "--out", str(one), "--scales", "1", "--overlaps", "on",
                              "--tasks", "scratch"]) == 0
    assert quality_fair.main(["--smoke", "--out", str(two), "--add-to", str(one.with_suffix(".json")), "--scales",
                              "1", "--overlaps", "on", "--add-lrs", "1e-4", "--at-lrs", "1e-4", "--skip-adamw"]) == 0
    assert quality_fair.main(["--smoke", "--out", str(three), "--add-to", str(two.with_suffix(".json")),
                              "--scales", "3", "--overlaps", "on"]) == 0
    assert "0.0001" not in json.loads(two.with_suffix(".json").read_text())["runs"]["scratch"]["AdamW"]
    runs = json.loads(three.with_suffix(".json").read_text())["runs"]["scratch"]
    # The third run, without --skip-adamw, fills AdamW in where it lacks runs.
    assert set(runs["AdamW"]) == set(runs["ZenFlow overlap s=1"]) == {"0.0001", "0.0005", "0.001"}
    assert set(runs["ZenFlow overlap s=3"]) == {"0.0001", "0.0005", "0.001"}


def test_smoke_run_with_overlap_steps(tmp_path: Path) -> None:
    out = tmp_path / "k"
    assert quality_fair.main(["--smoke", "--out", str(out), "--scales", "1", "--overlap-steps", "0", "1",
                              "--tasks", "scratch"]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [c["name"] for c in doc["configs"]] == ["AdamW", "ZenFlow overlap s=1", "ZenFlow overlap s=1 K=1",
                                                   "ZenFlow sequential s=1"]  # without overlap there is no K
    runs = doc["runs"]["scratch"]
    assert runs["ZenFlow overlap s=1 K=1"]["0.001"]["1"]["loss"] != runs["ZenFlow overlap s=1"]["0.001"]["1"]["loss"]
    assert quality_fair.host_scale_entries(doc, quality_fair.summarize(doc)) == []


def test_arith_corpus_is_correct_arithmetic_and_fixed() -> None:
    data = quality_fair.arith_corpus(20_000)
    assert len(data) == 20_000 and torch.equal(data, quality_fair.arith_corpus(20_000))
    lines = bytes(data.tolist()).decode().split("\n")[:-1]  # the last one is cut at the size
    for line in lines:
        lhs, rhs = line.split("=")
        assert eval(lhs) == int(rhs)  # noqa: S307 (digits and one of + - *)
    assert {line[len(line.split("=")[0].rstrip("0123456789")) - 1] for line in lines} == {"+", "-", "*"}


def test_the_defaults_line_per_task_and_merge(tmp_path: Path) -> None:
    knobs = ["--scales", "1", "--warmups", "0", "100", "--overlaps", "on", "--overlap-steps", "1"]
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    assert quality_fair.main(["--smoke", "--out", str(a), *knobs, "--tasks", "scratch"]) == 0
    assert quality_fair.main(["--smoke", "--out", str(b), *knobs, "--tasks", "arith", "shift"]) == 0
    assert quality_fair.main(["--merge", str(a.with_suffix(".json")), str(b.with_suffix(".json")),
                              "--out", str(m)]) == 0
    doc = json.loads(m.with_suffix(".json").read_text())
    assert [t["name"] for t in doc["tasks"]] == ["scratch", "arith", "shift"]
    assert [c["name"] for c in doc["configs"] if quality_fair.is_defaults(doc, c)] == [
        "ZenFlow overlap s=1 warm=100 K=1"]
    summary = quality_fair.summarize(doc)
    lines = quality_fair.defaults_lines(doc, summary)
    assert [x.split(":")[0] for x in lines] == ["- scratch", "- arith", "- shift"]
    row = summary["arith"]["configs"]["ZenFlow overlap s=1 warm=100 K=1"]
    assert f"{row['best_to_best']:.3f}" in lines[1]
    md = m.with_suffix(".md").read_text()
    assert "## The defaults" in md and lines[2] in md and "joined with --merge" in md
    one = json.loads(a.with_suffix(".json").read_text())
    with pytest.raises(ValueError, match="in both"):
        quality_fair.merge([one, one])
