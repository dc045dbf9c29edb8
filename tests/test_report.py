"""Tests of report.py: the paired bootstrap of `compare`, the curves of `plot` and `side`, and
hostile input files, each of which ends in one line naming the file, the line and the field (a
ReportError, which main turns into a one-line exit), or in a correct table or plot; never in a
traceback, a hang, or a table of nan or 500 %."""

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

import report
from conftest import deadline, held_out_metrics, logged_metrics


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
    (tmp_path / "bad.jsonl").write_text('{"id": "q0", "benchmark": "hotpotqa", "sample": 0, '
                                        '"rule": 1}\n'
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
    # a step with the held-out verifier check (log.verify_every): its ver/gold_* keys too
    row = report.add_derived({**logged_metrics(1), **held_out_metrics()})
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
    rows = [{**logged_metrics(s), "que/new_rate": 0.1, "foo/bar": s,
             **(held_out_metrics() if s % 10 == 0 else {})} for s in range(1, 25)]
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
    # the held-out check ran at steps 10 and 20: its curve has those two points, gaps elsewhere
    gold = report.series(metrics, "ver/gold_accuracy")
    assert np.isfinite(gold).sum() == 2 and gold[9] == pytest.approx(4 / 6)
    assert ("held-out verifier: accuracy / YES on wrong answers / NO on right ones",
            ["ver/gold_accuracy", "ver/gold_yes_on_wrong", "ver/gold_no_on_right"]) \
        in report.figure_panels("verifier", keys)
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


# ------------------------------------------------------------------------------------------------
# Hostile input files
# ------------------------------------------------------------------------------------------------

DEEP = "[" * 100_000          # json.loads raises RecursionError
DIGITS = "1" * 5000           # json.loads raises ValueError: past Python's 4300-digit int limit
BIG = "1" * 4000              # parses, but float() of it raises OverflowError
MEGA = "x" * 10_000_000       # a 10 MB string


def sample(qid="q0", **fields) -> str:
    """A line of eval_samples.jsonl as evaluation.write_eval_results writes it, some fields
    replaced."""
    return json.dumps({"id": qid, "benchmark": "hotpotqa", "sample": 0, "rule": 1.0, "judge": None,
                       "score": 1.0, **fields})


def eval_dir(folder: Path, *lines: bytes | str) -> Path:
    """A `spell.py eval` output folder whose eval_samples.jsonl holds these lines."""
    folder.mkdir()
    data = b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines)
    (folder / "eval_samples.jsonl").write_bytes(data)
    return folder


def one_line_exit(argv: list[str], *names: str) -> str:
    """The message main exits with; it must be one short line naming each of `names`."""
    with pytest.raises(SystemExit) as exit:
        report.main(argv)
    message = exit.value.code
    assert isinstance(message, str) and message.startswith("report.py: ")
    assert "\n" not in message and len(message) < 300 + sum(map(len, names)), message[:300]
    assert all(name in message for name in names), message
    return message


# ------------------------------------------------------------------------------------------------
# compare: every line of eval_samples.jsonl is a sample with a score in [0, 1]
# ------------------------------------------------------------------------------------------------

# the second line of a base eval (the first is a good sample q0) -> what the error says after
# "eval_samples.jsonl, line 2"
BAD_SAMPLES = {
    "not UTF-8": (b'{"id": "q1", "benchmark": "hotpot\xffqa", "rule": 1}', r": not UTF-8"),
    "nested 100000 deep": (DEEP, r": JSON nested too deeply"),
    "nested in a field": ('{"id": "q1", "benchmark": "hotpotqa", "rule": ' + DEEP,
                          r": JSON nested too deeply"),
    "5000-digit integer": ('{"id": "q1", "benchmark": "hotpotqa", "rule": ' + DIGITS + "}",
                           r": an integer of over 4300 digits"),
    "4000-digit integer": ('{"id": "q1", "benchmark": "hotpotqa", "rule": ' + BIG + "}",
                           r", field 'rule': 1111111111.*\.\.\. is not a score"),
    "NaN": (sample("q1", rule=math.nan), r", field 'rule': NaN is not a score"),
    "Infinity": (sample("q1", rule=math.inf), r", field 'rule': Infinity is not a score"),
    "-Infinity": (sample("q1", rule=-math.inf), r", field 'rule': -Infinity is not a score"),
    "5": (sample("q1", rule=5), r", field 'rule': 5 is not a score"),
    "-1": (sample("q1", rule=-1), r", field 'rule': -1 is not a score"),
    "true": (sample("q1", rule=True), r", field 'rule': true is not a score"),
    "false": (sample("q1", rule=False), r", field 'rule': false is not a score"),
    "a numeric string": (sample("q1", rule="0.5"), r", field 'rule': \"0\.5\" is not a score"),
    "the string nan": (sample("q1", rule="nan"), r", field 'rule': \"nan\" is not a score"),
    "null": (sample("q1", rule=None), r", field 'rule': null is not a score"),
    "a 10 MB string": (sample("q1", rule=MEGA), r", field 'rule': \"xxxx.*\.\.\. is not a score"),
    "a list score": (sample("q1", rule=[1]), r", field 'rule': an array is not a score"),
    "no rule": (json.dumps({"id": "q1", "benchmark": "hotpotqa"}), r": no 'rule' field"),
    "a list line": ("[1, 2]", r": an array, not a sample"),
    "a number line": ("1", r": 1, not a sample"),
    "id a list": (sample([1, 2]), r", field 'id': an array is not a string or an integer"),
    "id nested 500 deep": ('{"id": ' + "[" * 500 + "]" * 500 + ', "benchmark": "b", "rule": 1}',
                           r", field 'id': an array is not a string or an integer"),
    "benchmark null": (sample("q1", benchmark=None), r", field 'benchmark': null is not a string"),
}


@pytest.mark.parametrize("line, says", BAD_SAMPLES.values(), ids=list(BAD_SAMPLES))
def test_a_bad_eval_sample_is_one_line_naming_file_line_and_field(tmp_path, line, says):
    bad = eval_dir(tmp_path / "bad", sample("q0"), line)
    good = eval_dir(tmp_path / "good", sample("q0"), sample("q1"))
    where = f"{bad / 'eval_samples.jsonl'}, line 2"
    with pytest.raises(report.ReportError, match=re.escape(where) + says) as error:
        report.read_eval_samples(bad)
    assert len(str(error.value)) < 200 + len(where)  # a 10 MB value is cut, not copied
    for argv in (["compare", str(bad), str(good)], ["compare", str(good), str(bad)]):
        one_line_exit(argv + ["--boot", "10"], where)


def test_metric_score_checks_the_score_field_and_rule_reads_rule(tmp_path, capsys):
    base = eval_dir(tmp_path / "base", sample("q0", score=1.5), sample("q1", rule=0.0))
    where = f"{base / 'eval_samples.jsonl'}, line 1"
    with pytest.raises(report.ReportError, match=re.escape(where) + ", field 'score': 1.5 is not"):
        report.read_eval_samples(base, "score")
    one_line_exit(["compare", str(base), str(base), "--metric", "score"], where)
    report.main(["compare", str(base), str(base), "--boot", "10"])  # the rule is fine: a table
    assert "| base: " in capsys.readouterr().out


def test_a_huge_question_id_is_cut_in_the_different_questions_error(tmp_path):
    base = eval_dir(tmp_path / "base", sample("q0" + MEGA))
    trained = eval_dir(tmp_path / "trained", sample("q0"))
    message = one_line_exit(["compare", str(base), str(trained)])
    assert "cover different questions: 1 only in base (e.g. [('hotpotqa', 'q0xxx" in message


def test_an_eval_file_that_is_a_directory_is_a_report_error(tmp_path):
    (tmp_path / "eval" / "eval_samples.jsonl").mkdir(parents=True)
    file = str(tmp_path / "eval" / "eval_samples.jsonl")
    with pytest.raises(report.ReportError, match=re.escape(file) + r": cannot read it"):
        report.read_eval_samples(tmp_path / "eval")
    good = eval_dir(tmp_path / "good", sample("q0"))
    one_line_exit(["compare", str(good), str(tmp_path / "eval")], file)


# ------------------------------------------------------------------------------------------------
# plot and side: a line that is not a step is skipped, a value no curve can draw is left out
# ------------------------------------------------------------------------------------------------

def metrics_run(folder: Path, line: bytes | str) -> Path:
    """A run folder whose metrics.jsonl has good steps 1, 2 and 4 around `line` as line 3."""
    folder.mkdir()
    good = [json.dumps({"step": s, "res/groups": 2, "res/solve_rate": 0.25}) for s in (1, 2, 4)]
    lines = [*good[:2], line, good[2]]
    data = b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines)
    (folder / "metrics.jsonl").write_bytes(data)
    return folder


# line 3 of metrics.jsonl, which is not a step: skipped, with a note naming it
BAD_STEPS = {
    "not UTF-8": b'{"step": 3, "res/solve_rate": "\xff"}',
    "nested 100000 deep": DEEP,
    "nested in a field": '{"step": 3, "res/solve_rate": ' + DEEP,
    "5000-digit integer": '{"step": 3, "res/solve_rate": ' + DIGITS + "}",
    "4000-digit step": '{"step": ' + BIG + ', "res/solve_rate": 0.5}',
    "step 2**53": json.dumps({"step": 2**53, "res/solve_rate": 0.5}),
    "step -1": json.dumps({"step": -1, "res/solve_rate": 0.5}),
    "step true": json.dumps({"step": True, "res/solve_rate": 0.5}),
    "step NaN": json.dumps({"step": math.nan, "res/solve_rate": 0.5}),
    "step a string": json.dumps({"step": "3", "res/solve_rate": 0.5}),
    "step a float": json.dumps({"step": 3.0, "res/solve_rate": 0.5}),
    "a list line": "[1, 2]",
}


@pytest.mark.parametrize("line", BAD_STEPS.values(), ids=list(BAD_STEPS))
def test_a_metrics_line_that_is_not_a_step_is_skipped_with_a_note(tmp_path, capsys, line):
    run = metrics_run(tmp_path / "run", line)
    rows = report.read_metrics(run / "metrics.jsonl")
    assert [type(s) for s in rows] == [int] * 3 and list(rows) == [1, 2, 4]
    assert all(row["res/solve_rate"] == 0.25 for row in rows.values())
    note = capsys.readouterr().err
    assert re.fullmatch(re.escape(f"{run / 'metrics.jsonl'}: skipped 1 line(s)") + r".*line 3.*\n",
                        note), note[:300]


# line 3 is step 3; this value of res/solve_rate is left out of it (a gap), with a note naming it
BAD_VALUES = {
    "NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "1e308": "1e308",
    "4000-digit integer": BIG, "true": "true", "a string": '"0.5"', "null": "null",
    "a list": "[1]", "an object": '{"a": 1}', "a 10 MB string": json.dumps(MEGA),
}


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=list(BAD_VALUES))
def test_a_metric_value_no_curve_can_draw_is_left_out_with_a_note(tmp_path, capsys, value):
    line = '{"step": 3, "res/groups": 2, "res/solve_rate": ' + value + "}"
    run = metrics_run(tmp_path / "run", line)
    rows = report.read_metrics(run / "metrics.jsonl")
    assert list(rows) == [1, 2, 3, 4] and rows[3]["res/groups"] == 2
    assert "res/solve_rate" not in rows[3] and "que/difficulty" not in rows[3]
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and len(note) < 300 + len(str(run)), note[:300]
    assert note.startswith(f"{run / 'metrics.jsonl'}: left out 1 value(s)"), note[:300]
    assert 'line 3, "res/solve_rate": ' in note, note[:300]


# a key that no panel title can hold: left out of step 3, with a note naming it
BAD_KEYS = {"a 10 MB key": MEGA, "a lone surrogate": "res/\ud800", "201 characters": "x" * 201,
            "a newline": "res/a\nb"}


@pytest.mark.parametrize("key", BAD_KEYS.values(), ids=list(BAD_KEYS))
def test_a_metric_key_no_panel_can_show_is_left_out_with_a_note(tmp_path, capsys, key):
    run = metrics_run(tmp_path / "run", json.dumps({"step": 3, key: 1, "res/solve_rate": 0.5}))
    rows = report.read_metrics(run / "metrics.jsonl")
    assert rows[3] == {"step": 3, "res/solve_rate": 0.5}
    note = capsys.readouterr().err
    assert "left out 1 value(s)" in note and "line 3, " in note and len(note) < 300 + len(str(run))


def test_plot_and_side_draw_a_file_of_every_bad_line_and_value(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="report.py plot needs matplotlib")
    lines = [*BAD_STEPS.values(), *('{"step": 3, "res/solve_rate": ' + v + "}"
                                    for v in BAD_VALUES.values()),
             json.dumps({"step": 3, "res/x": 1e300}), json.dumps({"step": 5, "res/x": -1e300}),
             json.dumps({"step": 2**53 - 1, "res/\ud800": 1, MEGA: 1})]
    run = metrics_run(tmp_path / "run", b"\n".join(x if isinstance(x, bytes) else x.encode()
                                                   for x in lines))
    report.main(["plot", str(run)])
    out, err = capsys.readouterr()
    assert out.split() == [str(run / "plots" / f"{n}.png") for n in ("questioner", "responder")]
    file = run / "metrics.jsonl"
    assert err.startswith(f"{file}: skipped {len(BAD_STEPS)} line(s)") and err.count("\n") == 2
    assert f"\n{file}: left out {len(BAD_VALUES) + 2} value(s)" in err
    side = tmp_path / "side.png"
    report.main(["side", str(run), str(run), "--out", str(side), "--keys", "res/x,res/solve_rate"])
    assert side.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_figure_of_many_keys_draws_the_first_panels_with_a_note(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason="report.py plot needs matplotlib")
    monkeypatch.setattr(report, "MAX_PANELS", 3)  # the cap's value does not matter; 32 take 4 s
    run = metrics_run(tmp_path / "run", json.dumps({"step": 3, **{f"x/{i:03}": i for i in
                                                                  range(200)}}))
    written = report.plot_run(run)
    assert [p.name for p in written] == ["questioner.png", "responder.png", "other.png"]
    assert f"other.png: drew the first {report.MAX_PANELS} of 200 panels" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, b"\xff\n", DEEP.encode()],
                         ids=["a directory", "only not UTF-8", "only nested too deep"])
def test_a_metrics_file_with_no_step_to_read_is_one_line_naming_it(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    file = run / "metrics.jsonl"
    if content is None:
        file.mkdir()
    else:
        file.write_bytes(content)
    with pytest.raises(report.ReportError, match=re.escape(str(file))):
        report.read_metrics(file)
    one_line_exit(["plot", str(run)], str(file))
    one_line_exit(["side", str(run), "--out", str(tmp_path / "side.png")], str(file))


def test_rolling_mean_window_longer_than_the_run_is_the_mean_so_far():
    values = np.array([1.0, 3.0, math.nan, 8.0])
    for window in (4, 5, 10**30):  # --smooth 10**30 once overflowed numpy's int64
        assert report.rolling_mean(values, window).tolist() == [1.0, 2.0, 2.0, 4.0]


# ------------------------------------------------------------------------------------------------
# Arguments out of range, output paths that cannot be written, files that are not files
# ------------------------------------------------------------------------------------------------

def test_a_sample_given_twice_is_an_error_naming_both_lines(tmp_path):
    # a file written twice over (or two evals concatenated) once merged into 2 samples of q0
    twice = eval_dir(tmp_path / "twice", sample("q0"), sample("q1"), sample("q0"))
    good = eval_dir(tmp_path / "good", sample("q0"), sample("q1"))
    where = f"{twice / 'eval_samples.jsonl'}, line 3"
    with pytest.raises(report.ReportError, match=re.escape(where) + r": .*sample 0 .*line 1"):
        report.read_eval_samples(twice)
    one_line_exit(["compare", str(twice), str(good)], where, "line 1")
    # the same question's samples 0 and 1 are two samples, as `spell.py eval` writes them
    two = eval_dir(tmp_path / "two", sample("q0"), sample("q0", sample=1, rule=0.0))
    assert report.read_eval_samples(two) == {("hotpotqa", "q0"): [1.0, 0.0]}
    # id 7 and id "7" are one question
    mixed = eval_dir(tmp_path / "mixed", sample(7), sample("7"))
    one_line_exit(["compare", str(mixed), str(mixed)], "line 2", "line 1")


@pytest.mark.parametrize("index", [None, -1, True, 0.0, "0"],
                         ids=["absent", "negative", "a bool", "a float", "a string"])
def test_a_sample_index_that_is_not_an_integer_from_0_is_an_error(tmp_path, index):
    fields = json.loads(sample("q1"))
    del fields["sample"]
    line = json.dumps(fields if index is None else {**fields, "sample": index})
    bad = eval_dir(tmp_path / "bad", sample("q0"), line)
    where = f"{bad / 'eval_samples.jsonl'}, line 2"
    with pytest.raises(report.ReportError, match=re.escape(where) + ".*'sample'"):
        report.read_eval_samples(bad)


# an argument out of the range its --help states -> the flag the error names
BAD_ARGS = {
    "compare --seed -1": (["--seed", "-1"], "--seed"),
    "compare --seed 2**32": (["--seed", str(2**32)], "--seed"),
    "compare --boot 0": (["--boot", "0"], "--boot"),
    "compare --boot 10**7": (["--boot", str(10**7)], "--boot"),
}


@pytest.mark.parametrize("args, flag", BAD_ARGS.values(), ids=list(BAD_ARGS))
def test_a_compare_argument_out_of_range_is_one_line_before_reading(tmp_path, args, flag):
    missing = str(tmp_path / "no-such-eval")  # the argument is checked first: no file is read
    one_line_exit(["compare", missing, missing, *args], flag)
    with pytest.raises(report.ReportError, match=flag):
        base = {("b", "q0"): [1.0]}
        report.compare(base, base, boot=int(args[1]) if flag == "--boot" else 10,
                       seed=int(args[1]) if flag == "--seed" else 0)


def test_help_states_the_range_of_every_numeric_argument():
    for command, sub in report.make_parser()._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.type in (int, float):
                flag = action.option_strings[0]
                assert report.range_text(flag) in action.help, (command, flag, action.help)


def good_run(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "res/solve_rate": 0.5}) + "\n" for s in (1, 2, 3)))
    return run


@pytest.mark.parametrize("smooth", ["0", "-3"])
def test_plot_smooth_below_1_is_one_line(tmp_path, smooth):
    out = tmp_path / "plots"
    one_line_exit(["plot", str(good_run(tmp_path)), "--smooth", smooth, "--out", str(out)],
                  "--smooth")
    assert not out.exists()


def test_an_output_path_that_cannot_be_written_is_one_line_and_writes_nothing(tmp_path):
    run = good_run(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    for out, says in ((tmp_path / "folder", "is a folder"),  # once wrote folder.png, printed folder
                      (tmp_path / "side", "not a .png"),     # once wrote side.png
                      (tmp_path / "side.xyz", "not a .png"),  # once a matplotlib traceback
                      (tmp_path / "file" / "side.png", "is not a folder")):
        one_line_exit(["side", str(run), "--out", str(out)], "--out", says)
    one_line_exit(["plot", str(run), "--out", str(tmp_path / "file")], "--out", "is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder", "run"]
    assert list((tmp_path / "folder").iterdir()) == [] and (tmp_path / "file").read_text() == "x"


def test_a_figure_that_fails_to_save_leaves_the_old_png_as_it_was(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="report.py side needs matplotlib")
    from matplotlib.figure import Figure

    def full_disk(self, fname, **kwargs):  # writes part of the file, then the disk is full
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device", str(fname))

    run, out = good_run(tmp_path), tmp_path / "side.png"
    out.write_bytes(b"the figure of a past run")
    monkeypatch.setattr(Figure, "savefig", full_disk)
    one_line_exit(["side", str(run), "--out", str(out)], "No space left on device")
    assert out.read_bytes() == b"the figure of a past run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "side.png"]  # no temporary left


def test_a_metric_key_or_run_name_with_dollar_signs_is_drawn_as_plain_text(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="report.py plot needs matplotlib")
    run = tmp_path / "run $x"
    run.mkdir()
    keys = ["res/$\\frac$", "res/a$b$", "$", "res/_^{"]  # mathtext failed to parse the first
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, **{k: s for k in keys}}) + "\n" for s in (1, 2)))
    report.main(["plot", str(run)])
    assert capsys.readouterr().out.splitlines() == [str(run / "plots" / f"{n}.png")
                                               for n in ("responder", "other")]
    report.main(["side", str(run), "--out", str(tmp_path / "side.png"), "--keys", ",".join(keys)])
    assert (tmp_path / "side.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_fifo_where_a_file_is_read_is_one_line_not_a_hang(tmp_path):
    run, evals = tmp_path / "run", tmp_path / "eval"
    run.mkdir()
    evals.mkdir()
    os.mkfifo(run / "metrics.jsonl")  # opening it for reading would wait for a writer forever
    os.mkfifo(evals / "eval_samples.jsonl")
    with deadline(10):
        one_line_exit(["plot", str(run)], str(run / "metrics.jsonl"), "not a file")
        one_line_exit(["side", str(run), "--out", str(tmp_path / "s.png")], "not a file")
        one_line_exit(["compare", str(evals), str(evals)], str(evals), "not a file")
        one_line_exit(["compare", str(evals / "eval_samples.jsonl"), str(evals)], "not a file")
