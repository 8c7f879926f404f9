"""The quality table: the shipped one, the loader's checks, and the interpolation the chooser relies on."""

from __future__ import annotations

import json
import math

import pytest

from zenflow_triton.autotune.quality import (
    DEFAULT_TABLE,
    QualityTable,
    QualityTableError,
    default_quality_table,
    load_quality_table,
)

RS = [0.02, 0.05, 0.1, 0.25, 0.5]
US = [1, 2, 4, 8, 16]


def doc(**over) -> dict:
    """A 5 x 5 table, two seeds, ratio 1 + 0.01 * (1 + log2 U) * sqrt(0.1 / r), seeds 0.005 apart."""
    ratio = [[[1 + 0.01 * (1 + math.log2(u)) * math.sqrt(0.1 / r) + d for d in (-0.0025, 0.0025)] for u in US]
             for r in RS]
    return {"topk_ratios": RS, "update_intervals": US, "ratio": ratio, "task": "synthetic", **over}


def test_the_shipped_table_is_measured_and_says_how_to_regenerate_it():
    table = default_quality_table()
    assert table.source == f"shipped: {DEFAULT_TABLE}"
    assert len(table.topk_ratios) >= 5 and len(table.update_intervals) >= 5
    assert len(table.ratios[0][0]) >= 3  # seeds
    assert "bench/quality_table.py" in table.command and table.task
    means = [table.mean(i, j) for i in range(len(table.topk_ratios)) for j in range(len(table.update_intervals))]
    assert all(0.95 < m < 1.3 for m in means)
    # The trend the chooser depends on, at the table's corners: the smallest ratio with the longest window is
    # worse than the largest ratio with the shortest.
    assert table.mean(0, -1) > table.mean(-1, 0) + 0.03
    assert table is default_quality_table()  # read once per process


def test_loss_and_adamw_loss_become_per_seed_ratios():
    d = {"topk_ratios": [0.1], "update_intervals": [4], "loss": [[[2.2, 3.3]]], "adamw_loss": [2.0, 3.0]}
    table = QualityTable.from_dict(d)
    assert table.ratios[0][0] == pytest.approx((1.1, 1.1))
    scalar = QualityTable.from_dict({"topk_ratios": [0.1], "update_intervals": [4], "ratio": [[1.04]]})
    assert scalar.predict(0.1, 4) == pytest.approx(1.04) and scalar.spread(0, 0) == (1.04, 1.04)


def test_a_table_round_trips_through_json(tmp_path):
    table = QualityTable.from_dict(doc(), source="x")
    path = tmp_path / "q.json"
    path.write_text(json.dumps(table.to_dict()))
    again = load_quality_table(path)
    assert again.ratios == table.ratios and again.source == str(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": 2}, "schema"),
        ({"topk_ratios": [0.05, 0.02, 0.1, 0.25, 0.5]}, "ascending"),
        ({"topk_ratios": [0.02, 0.05, 0.1, 0.25, 1.5]}, r"\(0, 1\)"),
        ({"update_intervals": [1, 2, 4, 8, 16.5]}, "int"),
        ({"update_intervals": []}, "non-empty"),
        ({"ratio": [[1.0] * 5] * 4}, "5 x 5"),
        ({"ratio": [[1.0, 1.0, 1.0, 1.0, -1.0]] * 5}, "positive"),
        ({"ratio": [["a"] * 5] * 5}, "malformed"),
        ({"ratio": None, "loss": [[[2.0]] * 5] * 5, "adamw_loss": [2.0, 2.0]}, "malformed"),  # seed count differs
        ({"ratio": None}, "needs 'ratio'"),
    ],
)
def test_malformed_tables_are_rejected_with_the_reason(change, message):
    d = doc(**change)
    if d.get("ratio", 0) is None:
        del d["ratio"]
    with pytest.raises(QualityTableError, match=message):
        QualityTable.from_dict(d, source="mine.json")


def test_unreadable_files_are_quality_table_errors(tmp_path):
    with pytest.raises(QualityTableError, match="cannot read"):
        load_quality_table(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(QualityTableError, match="not JSON"):
        load_quality_table(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(QualityTableError, match="JSON object"):
        load_quality_table(bad)


def test_predict_interpolates_in_log_r_and_log_u_and_never_extrapolates():
    table = QualityTable.from_dict(doc())
    for i, r in enumerate(RS):
        for j, u in enumerate(US):
            assert table.predict(r, u) == pytest.approx(table.mean(i, j))
            assert table.ratio_spread(r, u) == pytest.approx((table.mean(i, j) - 0.0025, table.mean(i, j) + 0.0025))
    # Between grid points: between the neighbours, and exactly halfway in log space.
    mid = table.predict(math.sqrt(0.1 * 0.25), 4)
    assert mid == pytest.approx((table.predict(0.1, 4) + table.predict(0.25, 4)) / 2)
    assert table.predict(0.1, 3) == pytest.approx(
        table.predict(0.1, 2) + (table.predict(0.1, 4) - table.predict(0.1, 2)) * math.log(1.5) / math.log(2))
    # r = 1 is AdamW; between the largest measured ratio and 1 the ratio falls toward 1.
    assert table.predict(1.0, 7) == 1.0
    assert 1.0 < table.predict(0.7, 4) < table.predict(0.5, 4)
    # Outside the measured range: unknown, never extrapolated.
    assert table.predict(0.01, 4) is None and table.predict(0.1, 32) is None
    assert not table.covers(0.1, 17) and table.covers(1.0, 64)
    lo, hi = table.predict_spread(0.07, 5)
    assert lo < table.predict(0.07, 5) < hi
    with pytest.raises(KeyError):
        table.ratio_spread(0.07, 4)


def test_render_shows_mean_spread_and_the_command():
    table = QualityTable.from_dict(doc(command="python bench/quality_table.py --out x.json"))
    text = table.render()
    assert "2 seeds" in text and "regenerate: python bench/quality_table.py" in text
    assert f"{table.mean(2, 2):.3f} ({table.spread(2, 2)[0]:.3f}-{table.spread(2, 2)[1]:.3f})" in text


def scale_entry(**over) -> dict:
    return {"topk_ratio": 0.1, "update_interval": 4, "overlap": True, "host_lr_scale": 2.0,
            "ratio": [0.99, 0.98, 0.995], "stable": True, "tasks": ["finetune", "scratch", "long"],
            "source": "bench/quality_fair.py", **over}


def test_host_lr_scale_entries_are_read_round_tripped_and_chosen_only_where_they_help(tmp_path):
    entries = [scale_entry(), scale_entry(host_lr_scale=1.5, ratio=[0.97, 0.99, 0.999]),
               scale_entry(host_lr_scale=0.5, ratio=[0.9, 0.9, 0.9], equal_lr_worst=[1.0, 1.03, 0.99]),  # not at 1x lr
               scale_entry(host_lr_scale=3.0, ratio=[0.9, 0.9, 0.9], stable=False),  # lower, but a spike
               scale_entry(overlap=False, ratio=[0.95, 1.01, 0.99])]  # worse on one task
    table = QualityTable.from_dict(doc(host_lr_scale=entries))
    path = tmp_path / "q.json"
    path.write_text(json.dumps(table.to_dict()))
    assert load_quality_table(path).host_scales == table.host_scales
    # The lowest worst-task ratio among those better on every task and stable: 2.0 (worst 0.995 < 0.999).
    assert table.host_lr_scale(0.1, 4, True).host_lr_scale == 2.0
    assert table.host_lr_scale(0.1, 4, False) is None  # its one entry is worse on a task
    assert table.host_lr_scale(0.1, 8, True) is None and table.host_lr_scale(0.25, 4, True) is None  # not measured
    text = table.render()
    assert "host_lr_scale=2 at r=0.1, U=4, overlap=on: best loss 0.990/0.980/0.995" in text
    assert "unstable" in text and "not a gain everywhere: 1.0 stays" in text and "at equal lr up to 1.030x" in text
    assert QualityTable.from_dict(doc()).host_scales == ()  # optional: a table without entries knows 1.0 only


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (scale_entry(host_lr_scale=1.0), "not 1"),
        (scale_entry(host_lr_scale=-2.0), "> 0"),
        (scale_entry(ratio=[]), "positive numbers"),
        (scale_entry(ratio=[1.0, 0.0, 1.0]), "positive numbers"),
        (scale_entry(overlap="yes"), "true or false"),
        (scale_entry(update_interval=2.5), "int >= 1"),
        (scale_entry(tasks=["a"]), "1 tasks but 3 ratios"),
        (scale_entry(equal_lr_worst=[1.0]), "'equal_lr_worst' must be 3 positive numbers"),
        (scale_entry(equal_lr_worst=["x", 1, 1]), "'equal_lr_worst' must be 3 positive numbers"),
        ({"topk_ratio": 0.1}, "lacks"),
        ("2.0", "objects"),
    ],
)
def test_malformed_host_lr_scale_entries_are_rejected(entry, message):
    with pytest.raises(QualityTableError, match=message):
        QualityTable.from_dict(doc(host_lr_scale=[entry]), source="mine.json")


def test_the_shipped_host_lr_scale_entries_are_bench_quality_fairs_and_none_helps():
    """What bench/results/quality-fair-2026-12-02.md measured at 0.1 / 4: no scale is better on every task at its best
    lr and nowhere worse at equal lr, so "auto" keeps Adam's step there (docs/quality.md)."""
    table = default_quality_table()
    found = {(e.overlap, e.host_lr_scale) for e in table.host_scales}
    assert found == {(True, 0.5), (False, 0.5), (True, 2.0), (False, 2.0)}
    for e in table.host_scales:
        assert (e.topk_ratio, e.update_interval) == (0.1, 4) and e.tasks == ("finetune", "scratch", "long")
        assert "bench/quality_fair.py" in e.source and len(e.equal_lr_worst) == 3 and not e.helps
    assert table.host_lr_scale(0.1, 4, True) is None and table.host_lr_scale(0.1, 4, False) is None


def test_regimes_finetune_scratch_and_the_worse_of_the_two(tmp_path):
    scratch = doc(task="from scratch")
    scratch["ratio"] = [[[x + (0.05 if u <= 2 else -0.05) for x in cell] for u, cell in zip(US, row)]
                        for row in scratch["ratio"]]
    whole = QualityTable.from_dict(doc(regimes={"scratch": scratch}, host_lr_scale=[scale_entry()]), source="t")
    plain = QualityTable.from_dict(doc(), source="t")
    assert whole.for_regime("finetune") is whole
    s = whole.for_regime("scratch")
    assert s.task == "from scratch" and s.host_scales == whole.host_scales and "regime scratch" in s.source
    worst = whole.for_regime("worst")
    for r in (0.05, 0.1, 0.3):
        for u in (1, 2, 3, 4, 16):
            assert worst.predict(r, u) == max(plain.predict(r, u), s.predict(r, u))
            lo, hi = worst.predict_spread(r, u)
            assert (lo, hi) == (max(plain.predict_spread(r, u)[0], s.predict_spread(r, u)[0]),
                                max(plain.predict_spread(r, u)[1], s.predict_spread(r, u)[1]))
    assert worst.predict(0.1, 1) == s.predict(0.1, 1) > plain.predict(0.1, 1)  # scratch worse at short windows
    assert worst.predict(0.1, 8) == plain.predict(0.1, 8) > s.predict(0.1, 8)  # the fine-tune at long ones
    assert worst.predict(0.01, 4) is None and worst.predict(1.0, 4) == 1.0
    # A table without regimes (the user's own task) answers itself for every regime.
    assert all(plain.for_regime(x) is plain for x in ("worst", "finetune", "scratch"))
    with pytest.raises(ValueError, match="quality regime"):
        whole.for_regime("pretrain")
    # Round trip, and a narrower scratch grid narrows what "worst" covers.
    path = tmp_path / "t.json"
    path.write_text(json.dumps(whole.to_dict()))
    again = load_quality_table(path)
    assert again.regimes["scratch"].ratios == whole.regimes["scratch"].ratios
    narrow = QualityTable.from_dict(doc(regimes={"scratch": dict(scratch, update_intervals=US[:4],
                                                                 ratio=[row[:4] for row in scratch["ratio"]])}))
    assert narrow.for_regime("worst").predict(0.1, 16) is None and narrow.predict(0.1, 16) is not None


@pytest.mark.parametrize("regimes, message", [
    ({"pretrain": doc()}, "at most 'scratch'"),
    ([doc()], "at most 'scratch'"),
    ({"scratch": dict(doc(), regimes={})}, "without regimes"),
    ({"scratch": dict(doc(), ratio=[[1.0]])}, "regime scratch"),
])
def test_malformed_regimes_are_rejected(regimes, message):
    with pytest.raises(QualityTableError, match=message):
        QualityTable.from_dict(doc(regimes=regimes))


def test_the_shipped_table_has_a_scratch_regime_and_worst_plans_with_it():
    table = default_quality_table()
    scratch = table.regimes["scratch"]
    assert "--regime scratch" in scratch.command and "from scratch" in scratch.task
    assert (scratch.topk_ratios, scratch.update_intervals) == (table.topk_ratios, table.update_intervals)
    worst = table.for_regime("worst")
    assert worst.predict(0.1, 4) == max(table.predict(0.1, 4), scratch.predict(0.1, 4))
    # From scratch loses more than the fine-tune at the default 0.1 / 4, so "worst" is not the fine-tune there.
    assert scratch.predict(0.1, 4) > table.predict(0.1, 4) + 0.05
