"""Tests of report.py: the paired bootstrap of `compare`, and the curves of `plot` and `side`."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

import report
from conftest import (logged_metrics)


# ------------------------------------------------------------------------------------------------
# compare: the paired bootstrap
# ------------------------------------------------------------------------------------------------

def write_eval_samples(folder: Path, rule: dict[str, list[int]],
                       score: dict[str, list[int]] | None = None) -> Path:
    """An eval_samples.jsonl as evaluation.write_eval_results writes it: one line per sample."""
    folder.mkdir(parents=True, exist_ok=True)
    score = score or rule
    lines = [json.dumps({"id": qid, "benchmark": "hotpotqa", "sample": i, "rule": r, "judge": None,
                         "score": score[qid][i]})
             for qid, rules in rule.items() for i, r in enumerate(rules)]
    (folder / "eval_samples.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_compare_hand_worked_pair_with_a_constant_difference(tmp_path):
    # pass@1 per question = mean of its 2 samples: base (0, .5, .5, 0), trained (.5, 1, 1, .5).
    # Every question gains exactly .5, so every paired resample has mean difference .5: a
    # zero-width interval.
    base = write_eval_samples(tmp_path / "base",
                              {"q0": [0, 0], "q1": [1, 0], "q2": [0, 1], "q3": [0, 0]},
                              # a judge YES on q0
                              score={"q0": [1, 0], "q1": [1, 0], "q2": [0, 1], "q3": [0, 0]})
    trained = write_eval_samples(tmp_path / "trained",
                                 {"q0": [1, 0], "q1": [1, 1], "q2": [1, 1], "q3": [0, 1]})
    r = report.compare(report.read_eval_samples(base), report.read_eval_samples(trained),
                       boot=2000, seed=0)
    assert r["questions"] == 4 and r["samples"] == ([2], [2])
    assert (r["base"][0] == 0.25 and r["trained"][0] == 0.75 and r["diff"] == (0.5, 0.5, 0.5)
            and r["p_le_0"] == 0.0)
    # a resampled mean stays within the question range
    assert 0.0 <= r["base"][1] <= 0.25 <= r["base"][2] <= 0.5
    # --metric score counts the judge: base q0 becomes .5, so the differences are (0, .5, .5, .5),
    # mean .375. With k draws of q0 among 4 the resample's mean is .5 (4 - k) / 4.
    # P(k = 4) = 1/256 < 2.5 % but P(k >= 3) = 13/256 > 2.5 %: the lower bound is .125;
    # P(k = 0) = (3/4)^4 = 32 % > 2.5 %: the upper is .5. (With 2000 draws the counts behind both
    # quantiles are over 5 binomial standard errors from flipping.)
    boot = 2000
    s = report.compare(report.read_eval_samples(base, "score"),
                       report.read_eval_samples(trained, "score"), boot=boot)
    # the interval holds the true .375
    assert s["base"][0] == 0.375 and s["diff"] == (0.375, 0.125, 0.5)
    # 5 binomial standard errors
    assert abs(s["p_le_0"] - 1 / 256) < 5 * math.sqrt(1 / 256 * 255 / 256 / boot)
    assert report.compare(report.read_eval_samples(base), report.read_eval_samples(trained),
                          boot=2000, seed=0) == r


def test_bootstrap_p_value_matches_the_exact_resampling_distribution():
    # Paired differences (1, 1, -1): a resample of 3 has mean <= 0 iff it draws -1 at least twice,
    # P = 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27.
    # Its extremes -1 (P 1/27 > 2.5 %) and 1 (P 8/27) are the interval.
    base = {("b", "q0"): [0.0], ("b", "q1"): [0.0], ("b", "q2"): [1.0]}
    trained = {("b", "q0"): [1.0], ("b", "q1"): [1.0], ("b", "q2"): [0.0]}
    boot = 100_000
    r = report.compare(base, trained, boot=boot, seed=0)
    se = math.sqrt(7 / 27 * 20 / 27 / boot)  # binomial standard error of a share of `boot` draws
    assert abs(r["p_le_0"] - 7 / 27) < 5 * se
    assert r["diff"][1:] == (-1.0, 1.0)


def test_bootstrap_variance_is_the_plug_in_variance_over_q_and_the_difference_is_paired():
    # The mean of Q questions drawn with replacement has variance sigma^2 / Q, sigma^2 the plug-in
    # (ddof 0) variance of the per-question values. Base and trained move together here, so the
    # paired difference (0 or .1) has a variance about 60x below the unpaired var(b)/Q + var(t)/Q.
    q, boot = 40, 20_000
    b = np.arange(q) / q                                # (Q,) per-question pass@1 of the base model
    t = np.minimum(b + 0.1 * (np.arange(q) % 2), 1.0)  # (Q,) trained: +.1 on every other question
    draws = report.bootstrap_means(np.stack([b, t, t - b]), boot, seed=1)  # (3, boot)
    assert draws.shape == (3, boot)
    # one set of indices for all rows
    np.testing.assert_allclose(draws[2], draws[1] - draws[0], atol=1e-12)
    # the sample variance of `boot` near-normal draws
    # has relative standard error sqrt(2 / boot) = 1 %
    tol = 5 * math.sqrt(2 / boot)
    for x, v in zip((b, t, t - b), draws.var(axis=1), strict=True):
        assert abs(v / (x.var() / q) - 1) < tol
    assert draws[2].var() < (b.var() + t.var()) / q / 20


def test_bootstrap_of_all_equal_scores_has_zero_width():
    half = {("b", f"q{i}"): [1.0, 0.0] for i in range(5)}
    r = report.compare(half, dict(half), boot=500, seed=3)
    assert r["base"] == r["trained"] == (0.5, 0.5, 0.5) and r["diff"] == (0.0, 0.0, 0.0)
    assert r["p_le_0"] == 1.0  # no draw shows a gain


def test_compare_refuses_different_questions_and_bad_lines(tmp_path, capsys):
    base = write_eval_samples(tmp_path / "base", {"q0": [1], "q1": [0]})
    other = write_eval_samples(tmp_path / "other", {"q0": [1], "q9": [0]})
    only = r"1 only in base \(e\.g\. \[\('hotpotqa', 'q1'\)\]\), 1 only in trained"
    with pytest.raises(report.ReportError, match=only):
        report.compare(report.read_eval_samples(base), report.read_eval_samples(other))
    (tmp_path / "bad.jsonl").write_text('{"id": "q0", "benchmark": "hotpotqa", "rule": 1}\n'
                                        '{"id": "q1"}\n')
    with pytest.raises(report.ReportError, match=r"bad\.jsonl, line 2: .*'rule'"):
        report.read_eval_samples(tmp_path / "bad.jsonl")
    with pytest.raises(SystemExit, match=r"^report\.py: the two evals cover different questions"):
        report.main(["compare", str(base), str(other)])
    report.main(["compare", str(base), str(base), "--boot", "100"])  # the table, printed
    out = capsys.readouterr().out
    assert "| base: " in out and "| 2 | 1 | 50.0 |" in out
    assert "| trained - base (paired) | 2 | | +0.0 | [+0.0, +0.0] |" in out


# ------------------------------------------------------------------------------------------------
# plot and side: curves of metrics.jsonl
# ------------------------------------------------------------------------------------------------

def test_rolling_mean_hand_worked():
    assert report.rolling_mean(np.array([1.0, 2.0, 3.0, 4.0]), 2).tolist() == [1.0, 1.5, 2.5, 3.5]
    # a missing step counts as a slot of the window but not as a value
    assert (report.rolling_mean(np.array([1.0, math.nan, 3.0, 5.0]), 2).tolist()
            == [1.0, 1.0, 3.0, 4.0])


def test_plot_figures_list_every_key_spell_logs_and_derive_figure_4_difficulty():
    row = report.add_derived(logged_metrics(1))
    # one of the two questions is valid;
    # its responders' mean reward is 1/4, so the difficulty is 3/4
    assert row["que/valid_rate"] == 0.5 and row["que/difficulty"] == 0.75
    listed = {k for _, _, panels in report.FIGURES.values() for _, keys in panels for k in keys}
    # every logged key has its panel, and no panel waits for a key never logged
    assert listed == set(row) - {"step"}
    # no valid question: the solve rate is a placeholder 0, not a difficulty of 1
    assert "que/difficulty" not in report.add_derived({**logged_metrics(1), "res/groups": 0})
    # the training reward carries the responder's format penalty: a difficulty never comes from it
    penalised = {**logged_metrics(1), "res/reward": -0.375}
    assert report.add_derived(penalised)["que/difficulty"] == 0.75
    del penalised["res/solve_rate"]
    assert "que/difficulty" not in report.add_derived(penalised)
    assert report.add_derived({"step": 1}) == {"step": 1}  # nothing to derive from: nothing added


def test_plot_reads_the_last_line_of_a_step_and_writes_one_png_per_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib",
                        reason="report.py plot needs matplotlib (requirements-cpu.txt); "
                               "compare does not")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{**logged_metrics(s), "que/new_rate": 0.1, "foo/bar": s} for s in range(1, 25)]
    # step 5 logged again (a resumed run): this line wins
    rows.insert(5, {**rows[4], "train/loss": 99.0})
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 25, "que/rew'  # a torn last line
    (run / "metrics.jsonl").write_text(text)
    metrics = report.read_metrics(run / "metrics.jsonl")
    assert list(metrics) == list(range(1, 25)) and metrics[5]["train/loss"] == 99.0
    assert "skipped 1 line" in capsys.readouterr().err
    keys = {k for row in metrics.values() for k in row}
    # a key of a role's namespace that no panel lists gets a panel of its own, last;
    # a new namespace goes to other
    assert report.figure_panels("questioner", keys)[-1] == ("que/new_rate", ["que/new_rate"])
    assert report.figure_panels("questioner", keys)[0] == (
        "valid questions (well-formed and grounded) / drawn", ["que/valid_rate"])
    assert (report.figure_panels("verifier", {"step", "que/reward"}) == []
            and report.other_keys(keys) == ["foo/bar"])
    written = report.plot_run(run)
    names = ["questioner", "responder", "verifier", "training", "throughput", "other"]
    assert written == [run / "plots" / f"{name}.png" for name in names]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_side_by_side_draws_the_keys_any_run_logs(tmp_path):
    pytest.importorskip("matplotlib",
                        reason="report.py side needs matplotlib (requirements-cpu.txt)")
    runs = []
    for name, n in (("spell", 4), ("spice", 3)):
        (tmp_path / name).mkdir()
        rows = [{**logged_metrics(s), **({"ver/tagged": 0.5} if name == "spell" else {})}
                for s in range(1, n + 1)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(tmp_path / name)
    out = tmp_path / "side.png"
    drawn = report.plot_side_by_side(runs, out, ("que/valid_rate", "ver/tagged", "nothing/logged"))
    assert (drawn == ["que/valid_rate", "ver/tagged"]
            and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n")
    with pytest.raises(report.ReportError, match="none of the keys"):
        report.plot_side_by_side(runs, out, ("nothing/logged",))

