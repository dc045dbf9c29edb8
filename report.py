"""Reports on SPELL runs: learning curves from metrics.jsonl, a paired bootstrap between two evals.

    python report.py plot RUN_DIR [--out DIR] [--smooth N]
        RUN_DIR/metrics.jsonl (one JSON object per step, written by spell.py) -> RUN_DIR/plots/:
        one PNG per role (questioner.png, responder.png, verifier.png), training.png and
        throughput.png. The questioner's figure adds two quantities computed from logged keys: the
        valid-question rate and Figure 4's difficulty, 1 - pass@1 of the responders on its
        questions. Absent keys are skipped; a logged key no figure lists gets a panel of its own (a
        new namespace goes to other.png), so metrics added later still show up.

    python report.py side RUN_DIR [RUN_DIR ...] --out FILE.png [--keys K,K,...]
        Several runs' metrics.jsonl -> one PNG with a panel per key and a line per run (labelled by
        its folder name): recipes side by side on the same budget.

    python report.py compare BASE_EVAL_DIR TRAINED_EVAL_DIR [--metric rule|score] [--boot 10000]
                             [--seed 0]
        Two `spell.py eval` output folders (eval_samples.jsonl each) on the same questions -> pass@1
        of each model with a 95 % bootstrap confidence interval over questions, and the paired
        difference (trained - base) with its 95 % interval and the share of draws <= 0.

pass@1 of a question is the mean of its n samples' scores (Appendix C.2, Eq. 11 with k = 1); the
rule metric is the rule score alone (cover exact match for doc_qa), score is max(rule, judge).
The bootstrap resamples questions with replacement and takes percentile intervals; the paired
difference resamples the same questions for both models, which is what makes it paired.

Bad input ends in one line naming the file, never in a traceback (both files go through one reader,
json_lines), and a bad argument in one line naming it, before any file is read. A line of
eval_samples.jsonl that is not a sample with a score in [0, 1] and a sample index is an error naming
its line and field (eval_sample): a NaN or a 5 would print a table of nan or 500 %; so is a sample
index given twice for one question, which a file written twice over would otherwise double.
metrics.jsonl is read leniently, since a plot of a crashed run should still draw (read_metrics): a
line that is not a step is skipped, and a value no curve can draw is left out (a gap), each with a
note on stderr naming the first such line.

Needs numpy; `plot` also needs matplotlib (requirements.txt, requirements-cpu.txt). Importing this
file runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np


class ReportError(Exception):
    """Bad input files: missing, empty, a line that is not a sample, or two evals that do not cover
    the same questions. main prints it as one line."""


# ==================================================================================================
# reading: one JSON-lines reader for metrics.jsonl and eval_samples.jsonl
# ==================================================================================================

def json_lines(file: Path) -> Iterator[tuple[int, object, str | None]]:
    """(line number, value, None) for each non-blank line of a JSONL file that parses, and (line
    number, None, why) for one that does not; the caller decides whether that is fatal. A file it
    cannot open is a ReportError. Linear in the file's size: json.loads is, and its two failures
    that are not syntax errors are caught by type, RecursionError (nesting deeper than the stack)
    and ValueError (an integer of over 4300 digits, Python's limit on parsing ints). A FIFO or a
    device is a ReportError before it is opened: reading one waits for a writer forever."""
    if file.exists() and not file.is_file():
        raise ReportError(f"{file}: cannot read it (not a file: a folder, FIFO or device)")
    try:
        f = open(file, "rb")  # bytes: text that is not UTF-8 is one line's problem, not the file's
    except OSError as e:  # missing, a directory, no permission
        raise ReportError(f"{file}: cannot read it ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            value, why = None, None
            try:  # the first two are ValueErrors too: they go before it
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                why = f"not UTF-8 (byte {e.start + 1} of the line)"
            except json.JSONDecodeError as e:
                why = f"not JSON ({e.msg}, column {e.colno})"
            except RecursionError:
                why = "JSON nested too deeply to parse"
            except ValueError:
                why = "an integer of over 4300 digits (Python's limit)"
            yield lineno, value, why


def shown(value) -> str:
    """A parsed JSON value as JSON text cut to 40 characters, for a message: a line can hold
    megabytes, and an array or an object (perhaps a thousand deep) is named, not printed."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    return cut(json.dumps(value))  # NaN, Infinity, true, null, "text": as the file spells them


def cut(text: str, limit: int = 40) -> str:
    """text, or its first limit - 3 characters and '...'."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ==================================================================================================
# plot: metrics.jsonl -> PNG figures
# ==================================================================================================

# One figure per file name: (title, key prefix it owns, panels); a panel is (title, [keys]). Keys
# of the prefix that no panel lists are appended as panels of their own; keys that are absent are
# skipped. The keys are those of spell.step_metrics, plus the two that add_derived computes.
FIGURES = {
    "questioner": ("Questioner (§4.1; reward Eq. 7)", "que/", [
        ("valid questions (well-formed and grounded) / drawn", ["que/valid_rate"]),
        # Figure 4: the questioner learns to ask harder questions, so this should rise over training
        ("difficulty 1 - pass@1 of the responders on its valid questions (Figure 4)",
         ["que/difficulty"]),
        ("reward r_que", ["que/reward"]),
        ("kept samples: positive / floor (bootstrapping) / negative (§4.3)",
         ["que/pos", "que/floor", "que/neg"]),
        ("kept questions every response or none solved, and their mean advantage",
         ["que/all_or_none", "que/all_or_none_adv"]),
        ("format error / ungrounded rate", ["que/format_error", "que/ungrounded"]),
        ("questions: drawn / skipped (too long) / history entries forgotten to fit",
         ["que/questions", "que/skipped", "que/evicted"]),
        ("generations cut at the role's budget (max_new_tokens)", ["que/truncated"]),
    ]),
    "responder": ("Responder (§4.1; reward Eq. 6)", "res/", [
        ("solve rate max(rule, vote) (Eq. 6) / rule pass rate",
         ["res/solve_rate", "res/rule_pass"]),
        ("training reward (with bootstrap.responder_format_penalty)", ["res/reward"]),
        ("responses paid by the votes alone (r_i = 1, rule 0)", ["res/paid_without_rule"]),
        ("groups: valid / kept / all solved / none solved", ["res/groups", "res/kept_groups",
                                                            "res/all_solved", "res/none_solved"]),
        ("groups whose rewards vary by length shaping alone (not kept)", ["res/length_only"]),
        ("responses of kept groups left out by reward.no_majority = mask", ["res/masked"]),
        ("response length (tokens)", ["res/length"]),
        ("generations cut at the role's budget (max_new_tokens)", ["res/truncated"]),
    ]),
    "verifier": ("Verifier (§4.1; majority vote Eq. 4)", "ver/", [
        ("majority rate / majority agrees with the rule",
         ["ver/majority_rate", "ver/agrees_with_rule"]),
        ("votes with a verdict (the rest abstain) / split by the verdict order (paired)",
         ["ver/tagged", "ver/order_split"]),
        ("responses the rule did not pass that the votes paid (Eq. 6)",
         ["ver/paid_without_rule"]),
        ("kept groups / candidates", ["ver/kept_groups", "ver/candidates"]),
        ("generations cut at the role's budget (max_new_tokens)", ["ver/truncated"]),
        ("responses whose votes have no strict majority (reward.no_majority)",
         ["ver/no_majority"]),
        # the held-out check (data.verify_set, every log.verify_every steps): a point per check
        ("held-out verifier: accuracy / YES on wrong answers / NO on right ones",
         ["ver/gold_accuracy", "ver/gold_yes_on_wrong", "ver/gold_no_on_right"]),
        ("held-out accuracy where the rule is wrong", ["ver/gold_beyond_rule"]),
        ("held-out votes with a verdict tag (the rest abstain)", ["ver/gold_tagged"]),
        ("held-out accuracy by kind of candidate (evals/README.md)",
         [f"ver/gold_kind_{kind}" for kind in ("exact", "paraphrase", "near_miss",
                                               "other_question", "hedge", "negation")]),
    ]),
    "training": ("Policy update (Eq. 10)", "train/", [
        ("loss", ["train/loss"]),
        ("gradient norm (before clipping)", ["train/grad_norm"]),
        ("entropy (nats per token)", ["train/entropy"]),
        ("clip fraction", ["train/clipfrac"]),
        ("sequences / micro-batches / groups split over micro-batches",
         ["train/sequences", "train/micro_batches", "train/split_groups"]),
        ("sequences trained per role", ["train/que_sequences", "train/res_sequences",
                                        "train/ver_sequences"]),
        ("tokens trained / encoded (prompts once per group with engine.shared_prefix)",
         ["train/tokens", "train/row_tokens"]),
        ("mean |log-prob trainer - vLLM| per token", ["train/rollout_logp_gap"]),
        ("rollout correction: mean min(ratio, C) / share outside [1/C, C] / sequences rejected",
         ["train/rollout_is_weight", "train/rollout_outside_cap", "train/rollout_rejected"]),
        ("batch entropy (QwenLong-L1.5 Eq. 11: mean of each sequence's mean)",
         ["train/batch_entropy"]),
        ("AEPO: masking negative advantages (0/1) / samples masked",
         ["train/aepo_masking", "train/aepo_masked"]),
        ("tokens vLLM gave a NaN or infinite log-prob (their samples trained as unrecorded)",
         ["train/rollout_logp_nonfinite"]),
    ]),
    "throughput": ("Throughput", "perf/", [
        ("seconds per step, by phase (verify: the held-out check)",
         ["perf/rollout_s", "perf/update_s", "perf/sync_s", "perf/verify_s", "perf/step_s"]),
        ("rollout seconds per step, by role",
         ["perf/que_s", "perf/ground_s", "perf/res_s", "perf/ver_s"]),
        ("generated tokens per second, by role", ["perf/que_tokens_per_s", "perf/res_tokens_per_s",
                                                  "perf/ver_tokens_per_s"]),
        ("trained tokens per second", ["perf/train_tokens_per_s"]),
        ("generation rounds per step", ["perf/rounds"]),
    ]),
}


def add_derived(row: dict) -> dict:
    """The row plus que/valid_rate and que/difficulty (1 - pass@1, Figure 4) where their inputs are
    logged."""
    row = dict(row)
    keys = ("que/questions", "res/groups", "res/solve_rate")
    drawn, valid, solved = (number(row.get(k)) for k in keys)
    if drawn > 0 and math.isfinite(valid):
        row["que/valid_rate"] = valid / drawn
    # not from res/reward: that is the training reward, which bootstrap.responder_format_penalty can
    # make negative. Logs written before res/solve_rate existed get no difficulty
    if valid > 0 and math.isfinite(solved):  # with no valid question, the solve rate is a filler 0
        row["que/difficulty"] = 1.0 - solved
    return row


PLOTTABLE = 1e300  # |value| past this overflows matplotlib's axis arithmetic (span, margins, ticks)
MAX_KEY = 200      # characters of a metric's key: it is a panel title and a legend label
MAX_PANELS = 32    # per figure: a line of a million keys would otherwise take hours to draw


def number(v) -> float:
    """v as a float if a curve can draw it (a number, not a bool, within +-PLOTTABLE), else NaN: a
    missing value, a string, NaN, Infinity, or an integer past float's range."""
    # the range test fails NaN and Infinity, and compares a huge integer without float() overflowing
    drawable = isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= PLOTTABLE
    return float(v) if drawable else math.nan


def step_problem(row) -> str | None:
    """Why a parsed line of metrics.jsonl is not a step's metrics, or None if it is: a JSON object
    whose step is an integer (not a bool) in [0, 2**53), which a float x axis holds exactly."""
    if not isinstance(row, dict):
        return f"{shown(row)}, not a JSON object"
    if "step" not in row:
        return "no step"
    step = row["step"]
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**53:
        return f"step {shown(step)}, not an integer in [0, 2**53)"
    return None


def is_key(key: str) -> bool:
    """A metric key a panel title can show: at most MAX_KEY characters, all printable (no newline,
    no lone surrogate, which matplotlib cannot render)."""
    return len(key) <= MAX_KEY and key.isprintable()


def read_metrics(path: Path) -> dict[int, dict]:
    """step -> metrics (and add_derived's), from metrics.jsonl. A step logged twice (a resumed run)
    keeps its last line. Lenient otherwise, since a plot of a crashed or a live run should still
    draw; each kind of damage gets one note on stderr, naming its first line:
      - a line that is not a step's metrics (step_problem) is skipped: a run killed mid-write
        leaves a torn line, and bytes that are not UTF-8 or JSON nested too deep count as torn;
      - a value no curve can draw (number: NaN, Infinity, past +-PLOTTABLE, a string, a bool, null)
        is left out of its step, so its curve has a gap there, as where the step lacks the key; so
        is the value of a key that is no panel title (is_key).
    A file with no step at all is a ReportError."""
    rows, skipped, left_out = {}, [], []  # skipped: (line, why); left_out: (line, key, value)
    for lineno, row, why in json_lines(path):
        why = why or step_problem(row)
        if why is not None:
            skipped.append((lineno, why))
            continue
        kept = {"step": row["step"]}
        for key, value in row.items():
            if key == "step":
                continue
            if is_key(key) and math.isfinite(number(value)):
                kept[key] = value
            else:
                left_out.append((lineno, key, value))
        rows[row["step"]] = add_derived(kept)
    first_skipped = "(first: line {}, {})".format(*skipped[0]) if skipped else ""
    if not rows:
        raise ReportError(f"{path}: no metrics rows {first_skipped}".rstrip())
    if skipped:
        print(f"{path}: skipped {len(skipped)} line(s) that are not a JSON object with an integer "
              f"step {first_skipped}", file=sys.stderr)
    if left_out:
        lineno, key, value = left_out[0]
        print(f"{path}: left out {len(left_out)} value(s) that no curve can draw (first: line "
              f"{lineno}, {shown(key)}: {shown(value)})", file=sys.stderr)
    return dict(sorted(rows.items()))


def series(rows: dict[int, dict], key: str) -> np.ndarray:
    """The key's value at every step, NaN where a step lacks it or holds a non-number."""
    return np.array([number(row.get(key)) for row in rows.values()], dtype=float)


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean of the finite values among the last `window` steps; the first steps use
    fewer."""
    window = min(window, len(values))  # longer is the mean so far (and a huge --smooth fits int64)
    ok = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    hi = np.arange(1, len(values) + 1)
    lo = np.maximum(hi - window, 0)
    n = counts[hi] - counts[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums[hi] - sums[lo]) / np.maximum(n, 1), np.nan)


def figure_panels(name: str, keys: set[str]) -> list[tuple[str, list[str]]]:
    """The figure's panels restricted to present keys, then one panel per unlisted key of its
    prefix."""
    _, prefix, panels = FIGURES[name]
    out = [(title, [k for k in ks if k in keys]) for title, ks in panels]
    out = [(title, ks) for title, ks in out if ks]
    listed = {k for _, ks in panels for k in ks}
    out += [(k, [k]) for k in sorted(keys) if k.startswith(prefix) and k not in listed]
    return out


def other_keys(keys: set[str]) -> list[str]:
    """Keys no figure owns (a new namespace); they go to other.png."""
    prefixes = tuple(prefix for _, prefix, _ in FIGURES.values())
    return sorted(k for k in keys if k != "step" and not k.startswith(prefixes))


def panel_grid(plt, n: int):
    """A figure of n panels in two columns (one column for one panel); its n axes in reading
    order."""
    ncols = 2 if n > 1 else 1
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.2 * nrows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)[:n]


def finish_panel(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def pyplot():
    """matplotlib.pyplot, drawing to files only (Agg), with mathtext off for the process: a metric
    key or a run folder's name is plain text, and a "$" in one would start a formula ("$\\frac$"
    fails to parse)."""
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, path: Path) -> None:
    """fig as a PNG at path, written beside it and renamed: a save that fails (a full disk) leaves
    the PNG of a past run as it was."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=100, format="png")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; give it the usual mode
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def check_output_path(path: Path, folder: bool, name: str = "--out") -> None:
    """An output a run creates or replaces, a folder or a PNG: not the other kind, and below a
    folder (its nearest existing ancestor). Errors call it `name` and its path."""
    if path.exists() and path.is_dir() != folder:
        raise ReportError(f"{name} {path}: " + ("is not a folder" if folder else "is a folder"))
    if not folder and path.suffix.lower() != ".png":
        raise ReportError(f"{name} {path}: not a .png file name")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ReportError(f"{name} {path}: {parent} is not a folder")


def draw_figure(plt, title: str, panels, steps: np.ndarray, rows: dict[int, dict], smooth: int,
                path: Path):
    """One PNG: a grid of panels (two columns), each key a line; a rolling mean over it when
    smooth > 1."""
    fig, axes = panel_grid(plt, len(panels))
    for ax, (panel_title, keys) in zip(axes, panels):
        for i, key in enumerate(keys):
            color, y = f"C{i}", series(rows, key)
            ok = np.isfinite(y)
            if smooth > 1:  # raw values faint, the trend bold
                ax.plot(steps[ok], y[ok], color=color, alpha=0.25, linewidth=0.8)
                trend = rolling_mean(y, smooth)
                ax.plot(steps[ok], trend[ok], color=color, linewidth=1.8,
                        label=f"{key} (mean of {smooth})")
            else:
                marker = "." if ok.sum() < 30 else None
                ax.plot(steps[ok], y[ok], color=color, marker=marker, label=key)
        finish_panel(ax, panel_title)
    fig.suptitle(title)
    fig.tight_layout()
    try:
        save_png(fig, path)
    finally:
        plt.close(fig)


def plot_run(run_dir: Path, out_dir: Path | None = None, smooth: int | None = None) -> list[Path]:
    """Write the figures of one run; figures with no key present are skipped, and a figure draws its
    first MAX_PANELS panels (a note on stderr says how many it has). Returns the PNG paths."""
    if smooth is not None:
        check_range("--smooth", smooth)
    check_output_path(out_dir or run_dir / "plots", folder=True,
                      name="--out" if out_dir else "the figures' folder")
    plt = pyplot()
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = np.array(list(rows), dtype=float)
    if smooth is None:  # a rolling mean once there are enough steps for noise to hide the trend
        smooth = max(5, len(steps) // 20) if len(steps) >= 20 else 1
    keys = {k for row in rows.values() for k in row}
    out_dir = out_dir or run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [(name, FIGURES[name][0], figure_panels(name, keys)) for name in FIGURES]
    figures.append(("other", "Other metrics", [(k, [k]) for k in other_keys(keys)]))
    written = []
    for name, title, panels in figures:
        path = out_dir / f"{name}.png"
        if len(panels) > MAX_PANELS:
            print(f"{path}: drew the first {MAX_PANELS} of {len(panels)} panels", file=sys.stderr)
            panels = panels[:MAX_PANELS]
        if panels:
            draw_figure(plt, title, panels, steps, rows, smooth, path)
            written.append(path)
    return written


SIDE_BY_SIDE_KEYS = ("que/valid_rate", "res/solve_rate", "res/kept_groups", "train/sequences",
                     "train/entropy", "perf/step_s")


def plot_side_by_side(run_dirs: list[Path], out: Path,
                      keys: tuple[str, ...] = SIDE_BY_SIDE_KEYS) -> list[str]:
    """One PNG: a panel per key (absent from every run: skipped), a line per run. Returns the keys
    drawn."""
    check_output_path(out, folder=False)
    plt = pyplot()
    runs = [(d.name, read_metrics(d / "metrics.jsonl")) for d in run_dirs]
    keys = [k for k in keys if any(k in row for _, rows in runs for row in rows.values())]
    if not keys:
        raise ReportError("none of the keys is logged by any of the runs")
    fig, axes = panel_grid(plt, len(keys))
    for ax, key in zip(axes, keys):
        for i, (name, rows) in enumerate(runs):
            steps, y = np.array(list(rows), dtype=float), series(rows, key)
            ok = np.isfinite(y)
            ax.plot(steps[ok], y[ok], color=f"C{i}", marker=".", label=name)
        finish_panel(ax, key)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_png(fig, out)
    finally:
        plt.close(fig)
    return keys


# ==================================================================================================
# compare: two evals -> pass@1 with bootstrap intervals and the paired difference
# ==================================================================================================

def is_score(v) -> bool:
    """A pass rate: a number in [0, 1], not a bool. The range test fails NaN, Infinity and 5, and
    compares a huge integer without float() overflowing."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1


def eval_sample(sample, metric: str, where: str) -> tuple[tuple[str, str], int, float]:
    """((benchmark, id), sample index, score) of one parsed line of eval_samples.jsonl, or a
    ReportError at `where` (file and line) naming the field that is missing or wrong. The score,
    rule or score (max(rule, judge)), must pass is_score: a NaN or a 5 would make pass@1 nan or
    500 %. The index (an integer >= 0) tells a question's n samples from a line written twice."""
    need = f"a sample has benchmark, id, sample and {metric!r}"
    if not isinstance(sample, dict):
        raise ReportError(f"{where}: {shown(sample)}, not a sample ({need})")
    for field in ("benchmark", "id", metric):
        if field not in sample:
            raise ReportError(f"{where}: no {field!r} field ({need})")
    benchmark, qid, score = sample["benchmark"], sample["id"], sample[metric]
    if not isinstance(benchmark, str):
        raise ReportError(f"{where}, field 'benchmark': {shown(benchmark)} is not a string")
    if not isinstance(qid, (str, int)) or isinstance(qid, bool):
        raise ReportError(f"{where}, field 'id': {shown(qid)} is not a string or an integer")
    if not is_score(score):
        raise ReportError(f"{where}, field {metric!r}: {shown(score)} is not a score "
                          "(a number in [0, 1], not a boolean)")
    if "sample" not in sample:
        raise ReportError(f"{where}: no 'sample' field ({need})")
    index = sample["sample"]
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ReportError(f"{where}, field 'sample': {shown(index)} is not a sample index "
                          "(an integer >= 0)")
    return (benchmark, str(qid)), index, float(score)


def read_eval_samples(path: Path, metric: str = "rule") -> dict[tuple[str, str], list[float]]:
    """(benchmark, id) -> the metric of each sample, from eval_samples.jsonl (a folder holding it,
    or the file). Strict: any line that is not a sample (eval_sample), or that repeats a sample
    index of its question (a file written twice over), is a ReportError naming the file, the line
    and the field, since a comparison on a silently changed eval would mislead."""
    file = path / "eval_samples.jsonl" if path.is_dir() else path
    if not file.exists():
        raise ReportError(f"{file}: not found (expected the eval_samples.jsonl of a "
                          "`spell.py eval` run)")
    scores: dict[tuple[str, str], list[float]] = {}
    first_line: dict[tuple[tuple[str, str], int], int] = {}  # (question, index) -> its line
    for lineno, sample, why in json_lines(file):
        where = f"{file}, line {lineno}"
        if why is not None:
            raise ReportError(f"{where}: {why}")
        key, index, score = eval_sample(sample, metric, where)
        if (key, index) in first_line:
            raise ReportError(f"{where}: sample {index} of ({cut(key[0])!r}, {cut(key[1])!r}) "
                              f"again, first at line {first_line[key, index]}")
        first_line[key, index] = lineno
        scores.setdefault(key, []).append(score)
    if not scores:
        raise ReportError(f"{file}: no samples")
    return scores


def pass_at_1(scores: dict[tuple[str, str], list[float]],
              keys: list[tuple[str, str]]) -> np.ndarray:
    """pass@1 per question (Eq. 11, k = 1): the mean of its samples' scores, in the order of
    keys."""
    return np.array([np.mean(scores[k]) for k in keys], dtype=float)


def matched_questions(base: dict, trained: dict) -> list[tuple[str, str]]:
    """The shared (benchmark, id) keys, sorted; an error naming a few keys if the two sets
    differ."""
    only = {"base": sorted(set(base) - set(trained)), "trained": sorted(set(trained) - set(base))}
    if only["base"] or only["trained"]:
        parts = []
        for side, keys in only.items():
            examples = [(cut(b), cut(q)) for b, q in keys[:3]]  # an id can be megabytes long
            parts.append(f"{len(keys)} only in {side}" + (f" (e.g. {examples})" if keys else ""))
        raise ReportError("the two evals cover different questions: " + ", ".join(parts))
    return sorted(base)


def bootstrap_means(per_question: np.ndarray, boot: int, seed: int,
                    chunk: int = 1000) -> np.ndarray:
    """Means of `boot` resamples of the questions, drawn with replacement; each row of per_question
    is one model (or the paired difference), and every row is resampled with the same indices."""
    per_question = np.atleast_2d(per_question)                      # (M, Q)
    rng = np.random.default_rng(seed)
    q = per_question.shape[1]
    out = []
    for start in range(0, boot, chunk):  # chunks hold memory at chunk x Q indices on big benchmarks
        idx = rng.integers(0, q, size=(min(chunk, boot - start), q))  # (b, Q)
        out.append(per_question[:, idx].mean(axis=2))              # (M, b)
    return np.concatenate(out, axis=1)                             # (M, boot)


def percentile_ci(draws: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval: the (1-level)/2 and (1+level)/2 quantiles of the draws."""
    lo, hi = np.percentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def compare(base: dict, trained: dict, boot: int = 10000, seed: int = 0) -> dict:
    """pass@1 of both models with 95 % intervals, and the paired difference with its interval and
    P(draw <= 0), the one-sided bootstrap p-value of "trained is no better than base"."""
    check_range("--boot", boot)
    check_range("--seed", seed)
    keys = matched_questions(base, trained)
    b, t = pass_at_1(base, keys), pass_at_1(trained, keys)
    draws = bootstrap_means(np.stack([b, t, t - b]), boot, seed)   # (3, boot)
    return {
        "questions": len(keys),
        "samples": (sorted({len(base[k]) for k in keys}), sorted({len(trained[k]) for k in keys})),
        "base": (float(b.mean()), *percentile_ci(draws[0])),
        "trained": (float(t.mean()), *percentile_ci(draws[1])),
        "diff": (float((t - b).mean()), *percentile_ci(draws[2])),
        "p_le_0": float(np.mean(draws[2] <= 0)),
    }


def compare_table(result: dict, names: tuple[str, str], metric: str, boot: int, seed: int) -> str:
    """The comparison as a Markdown table in percent."""
    def ns(counts: list[int]) -> str:
        return "/".join(map(str, counts))

    n = result["questions"]
    scored = {"rule": "the rule score alone", "score": "max(rule, judge)"}[metric]
    lines = [f"pass@1 of {scored} (per question the mean over its samples), {n} questions; 95 % "
             f"percentile bootstrap intervals over questions, {boot} draws, seed {seed}.", "",
             "| model | questions | samples per question | pass@1 % | 95 % CI |",
             "|---|---:|---:|---:|---|"]
    for label, name, counts in (("base", names[0], result["samples"][0]),
                                ("trained", names[1], result["samples"][1])):
        mean, lo, hi = result[label]
        lines.append(f"| {label}: {name} | {n} | {ns(counts)} | {100 * mean:.1f} "
                     f"| [{100 * lo:.1f}, {100 * hi:.1f}] |")
    mean, lo, hi = result["diff"]
    lines.append(f"| trained - base (paired) | {n} | | {100 * mean:+.1f} "
                 f"| [{100 * lo:+.1f}, {100 * hi:+.1f}] |")
    lines += ["", "share of bootstrap draws with difference <= 0 (one-sided p): "
                  f"{result['p_le_0']:.4f}"]
    return "\n".join(lines)


# ==================================================================================================
# command line
# ==================================================================================================

# Each numeric argument's range (low, high; None: no bound), stated in its --help and checked
# before any file is read. The bootstrap's own error, about 1/sqrt(boot), is far below a
# percentile's spread over questions long before a million draws; past that a run only takes longer.
ARG_RANGES = {"--smooth": (1, None), "--boot": (1, 1_000_000), "--seed": (0, 2**32 - 1)}


def range_text(flag: str) -> str:
    """How --help states the argument's range."""
    low, high = ARG_RANGES[flag]
    return f">= {low}" if high is None else f"in [{low}, {high}]"


def check_range(flag: str, value: int) -> None:
    """A ReportError naming the argument unless its value is in its range."""
    low, high = ARG_RANGES[flag]
    if value < low or (high is not None and value > high):
        raise ReportError(f"{flag} {value}: must be {range_text(flag)}")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plot", help="PNG learning curves from RUN_DIR/metrics.jsonl")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/plots)")
    p.add_argument("--smooth", type=int, default=None,
                   help=f"rolling-mean window in steps, 1 for none ({range_text('--smooth')}; "
                        "default: none under 20 steps, else max(5, steps/20))")
    b = sub.add_parser("side", help="one PNG comparing several runs' curves, a line per run")
    b.add_argument("run_dirs", type=Path, nargs="+")
    b.add_argument("--out", type=Path, required=True, help="the PNG to write (a .png name)")
    b.add_argument("--keys", default=",".join(SIDE_BY_SIDE_KEYS),
                   help="comma-separated metric keys (default %(default)s)")
    c = sub.add_parser("compare", help="pass@1 of two evals with bootstrap intervals and the "
                                       "paired difference")
    c.add_argument("base", type=Path,
                   help="eval output folder of the base model (eval_samples.jsonl)")
    c.add_argument("trained", type=Path, help="eval output folder of the trained model")
    c.add_argument("--metric", choices=("rule", "score"), default="rule",
                   help="rule: the rule score alone; score: max(rule, judge) (default %(default)s)")
    c.add_argument("--boot", type=int, default=10000,
                   help=f"bootstrap draws ({range_text('--boot')}; default %(default)s)")
    c.add_argument("--seed", type=int, default=0,
                   help=f"seed of the bootstrap draws ({range_text('--seed')}; "
                        "default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    try:
        for flag in ARG_RANGES:  # before any file is read
            value = getattr(args, flag[2:], None)
            if value is not None:
                check_range(flag, value)
        if args.command == "plot":
            for path in plot_run(args.run_dir, args.out, args.smooth):
                print(path)
        elif args.command == "side":
            plot_side_by_side(args.run_dirs, args.out, tuple(k for k in args.keys.split(",") if k))
            print(args.out)
        else:
            base = read_eval_samples(args.base, args.metric)
            trained = read_eval_samples(args.trained, args.metric)
            result = compare(base, trained, args.boot, args.seed)
            names = (str(args.base), str(args.trained))
            print(compare_table(result, names, args.metric, args.boot, args.seed))
    except (ReportError, OSError) as e:  # bad input: one clear line, no traceback
        sys.exit(f"report.py: {e}")


if __name__ == "__main__":
    main()
