"""The three task types of SPELL (§5.1): the environment the roles play in.

A task type says how a questioner's reference answer is checked (a format error, Eq. 7, when it
fails), how a response's final answer is read, and R_rule of Eq. 6: document QA (`doc_qa`, a short
span), financial math (`fin_math`, one number) and multiple choice (`doc_mc`, a letter). This file
holds them and everything they read text with: the reasoning block, the questioner's JSON, the
answer statement, normalisation, numbers, letters, the rule checks as allow-lists, the paper's own
cover exact match (paper_score, which the evaluation reports beside R_rule), and the two guards
every prompt built from model output needs (fence, defuse_control_tokens).

Every reader here runs in linear time and never raises: a model output is data. Each rule is an
allow-list: it pays only an answer whose whole shape it knows names one candidate and leaves the
rest to the verifier (doc_qa) or to nothing (fin_math, doc_mc; spell.py's departure 13). It may
miss a right answer; it never pays a hedge (docs/reference.md, departures 1 and 2).

A new task type is one more entry in TASKS (a check, an extractor, a rule) plus its prompt files
prompts/<family>_<task>.txt. spell.py calls this file as tasks.X; this file imports no other file
of the project and reads no config.
"""

from __future__ import annotations

import functools
import json
import math
import re
import string
import sys
import unicodedata
from decimal import Decimal
from typing import Any, Callable, NamedTuple, Sequence




# ==================================================================================================
# The task type: a check of the reference answer, an answer reader, a rule (§5.1, Eq. 6, Eq. 7)
# ==================================================================================================

class Task(NamedTuple):
    """One task type (§5.1): how its reference answer is checked (None = a format error, Eq. 7),
    how a response's final answer is read from the text after its reasoning, R_rule of Eq. 6 on the
    two answers, whether the text after the reasoning holds the gold anywhere (alone, in a sentence
    or among other candidates: what the rule cannot tell apart, so the verifier's filter takes no
    label from it and §4.1's grounding check counts it as answered), whether it is multiple choice
    (the questioner is then told which letter must be correct, the prompts show the options, and
    the evaluation asks no judge), whether the rule alone decides r_i (Eq. 6 without the verifier's
    max, departure 13), whether its clusters are financial documents (build_corpus assigns them),
    and the paper's own score of the text after a reply's reasoning (paper_score; None: R_rule)."""
    check: Callable[[str, str, dict, str | None, int], dict | None]
    extract: Callable[[str], str | None]
    rule: Callable[[str, str], bool]
    holds: Callable[[str, str], bool]
    multiple_choice: bool = False
    rule_decides: bool = False
    financial: bool = False
    paper: Callable[[str, str], bool] | None = None


LETTERS = ("A", "B", "C", "D")


# ==================================================================================================
# Reading a reply: the reasoning block, the questioner's JSON object, the answer statement
# ==================================================================================================

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def strip_reasoning(text: str) -> str | None:
    """Text after the last reasoning-close tag; None when a reasoning block never closes."""
    if _THINK_CLOSE in text:
        return text.rsplit(_THINK_CLOSE, 1)[1]
    if _THINK_OPEN in text:
        return None
    return text


def fenced_blocks(text: str) -> list[tuple[int, str]]:
    """(end, body) of every closed ``` fence; an unclosed fence holds nothing."""
    # str.find, not a lazy regex: r"```\s*(.*?)```" backtracks quadratically over an unclosed fence
    found, pos = [], 0
    while (start := text.find("```", pos)) >= 0:
        body = start + 3 + (4 if text.startswith(("json", "JSON"), start + 3) else 0)
        end = text.find("```", body)
        if end < 0:
            break
        found.append((end + 3, text[body:end]))
        pos = end + 3
    return found


_JSON_TOKEN = re.compile(r'\\.|[{}"\n]', re.S)  # an escaped character, a brace, a quote, a newline


def json_candidates(text: str, key: str) -> list[str]:
    """Fenced blocks and outermost balanced {...} spans holding `key` (e.g. '"question"'), by where
    they end: what spell.parse_question tries to read, in linear time.

    A span is outermost when no brace around it ever closes: an unclosed '{' in prose ("I think {
    maybe.") then cannot hide the object after it. Outermost spans are disjoint, so looking for the
    key in each, and parsing each, stays linear in the text.
    """
    # a span without the key cannot validate: skipping it keeps "{}" * 10**5 from costing 10**5
    # parses
    if key not in text:
        return []
    found = [(end, body) for end, body in fenced_blocks(text) if key in body]
    opened: list[int] = []  # positions of the braces open here, outermost first
    inner: dict[int, list] = {}  # depth d -> the spans that closed right inside opened[d]
    top: list[tuple[int, int]] = []  # spans that closed with no brace open around them
    in_str = False
    for m in _JSON_TOKEN.finditer(text):  # only these characters matter: the scan skips prose in C
        # inside a JSON string braces do not count, nor does an escaped quote; and a JSON string
        # holds no raw newline, so a quote opened in prose ends at the line's end
        if in_str:
            in_str = m[0] not in ('"', "\n")
            continue
        ch, i = m[0][-1], m.end() - 1  # outside a string a backslash means nothing: \{ still opens
        if ch == '"' and opened:
            in_str = True
        elif ch == "{":
            opened.append(i)
        elif ch == "}" and opened:
            start = opened.pop()
            inner.pop(len(opened), None)  # the spans inside it stop being outermost
            (inner.setdefault(len(opened) - 1, []) if opened else top).append((start, i + 1))
    # a brace that never closed was prose: the spans inside it are outermost too
    spans = top + [span for inside in inner.values() for span in inside]
    found += [(end, text[start:end]) for start, end in spans
              if text.find(key, start, end) >= 0]
    return [s for _, s in sorted(found, key=lambda p: p[0])]


def loads_lenient(s: str) -> Any:
    """json.loads, retried once with trailing commas removed (a common slip of the questioner)."""
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return json.loads(re.sub(r",\s*([}\]])", r"\1", s))


def is_utf8(s: str) -> bool:
    """False for a string with a lone surrogate (JSON "\\ud83d"): no tokenizer can encode it."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _scalar_text(x: Any) -> str | None:
    """A JSON string or finite number as text; None for anything else (bool, NaN, Infinity,
    list...)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return str(x)  # exact; json.loads already refused more than 4300 digits (a ValueError)
    if isinstance(x, float):
        return format_number(x) if math.isfinite(x) else None
    return x if isinstance(x, str) and is_utf8(x) else None


_TEMPLATE_TEXT = re.compile(r"\s*(?:<[^<>]*>|\{[A-Za-z_][A-Za-z0-9_]*\})\s*")


def is_template_text(s: Any) -> bool:
    """A field left as a template's text, one "<your question>" or "{correct_letter}" and nothing
    else: the questioner copied its prompt, or a data file its template."""
    return isinstance(s, str) and _TEMPLATE_TEXT.fullmatch(s) is not None


def validate_question(obj: Any, task: str, correct_letter: str | None,
                       max_answer_words: int) -> dict | None:
    """Check the keys and types a task needs; None means a format error (Eq. 7, r = -1)."""
    if not isinstance(obj, dict):
        return None
    q, a = obj.get("question"), _scalar_text(obj.get("answer"))
    if not isinstance(q, str) or not q.strip() or not is_utf8(q) or is_template_text(q):
        return None
    if is_template_text(a):
        return None
    # the gold written as "The correct answer is X." means X
    if a is not None and _MARKER.search(a):
        a = after_last_marker(a)
    if a is None:
        return None
    return TASKS[task].check(q.strip(), a, obj, correct_letter, max_answer_words)


# "answer is" as words: "answer isn't" is no marker. No two unbounded runs in these patterns can
# match the same characters, so 200k spaces after a marker cost linear time (r"\s*:?\s*\**\s*" was
# cubic)
_MARKER = re.compile(r"\banswer\s+is\b\s*:?", re.I)
_PLACEHOLDER_ANSWER = "insert answer here"


def extract_answer(text: str, task: str) -> str | None:
    """Final answer of a response: after the reasoning, read as its task reads it (SPEC §3)."""
    body = strip_reasoning(text)
    return None if body is None else TASKS[task].extract(body)


# ==================================================================================================
# Normalising text, reading numbers, stripping an answer's wrapping
# ==================================================================================================

# each pattern starts with a literal or a class, so re scans for it in C (a leading lookbehind is
# ~20x slower)
_THOUSANDS_COMMA = re.compile(r",(?<=\d,)(?=\d)")


_NON_DECIMAL_DOT = re.compile(r"\.(?:(?!\d)|(?<!\d\.))")  # a dot not between two digits


_ASCII_PUNCTUATION = re.compile("[" + re.escape(string.punctuation.replace(".", "")) + "]")


# punctuation and symbols, also combining marks
_NON_ASCII_NOT_WORD = re.compile(r"[^\w\s\x00-\x7f]+")


_ARTICLES = frozenset(("a", "an", "the"))


def _space_if_punctuation(m: re.Match) -> str:
    """Unicode punctuation (P*) and symbols (S*) become spaces; a combining mark (M*) stays in its
    word."""
    return "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in m[0])


# One text, however it is encoded (normalize_unicode), for every reader both a gold and an answer go
# through: a right answer that differs from the gold by NFD / NFC, fullwidth forms or a soft hyphen
# inside a word, or a number whose minus is an en dash, was read as another text or another sign.
# After NFKC (which folds the fullwidth and small hyphen-minus into '-', the small em dash into an
# em dash and the superscript minus into U+2212), every dash a sign is written with becomes '-'
# (hyphen, figure dash, en and em dash, horizontal bar, minus sign, heavy and modifier minus), and
# the fraction slash NFKC writes for "½" (and the division slash) a '/'
_MINUS_SIGNS = "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\u2796\u02d7"
_FOLDS = {**dict.fromkeys(_MINUS_SIGNS, "-"), "\u2044": "/", "\u2215": "/"}
# a superscript or subscript right after a digit is a footnote or an exponent, not one more digit:
# NFKC alone would read "10\u00b2" as 102 and "12.5\u00b9" as 12.51
_INDEX = "[\u00b2\u00b3\u00b9\u2070-\u209f]"
_AN_INDEX, _DIGIT_THEN_INDEX = re.compile(_INDEX), re.compile(rf"(?<=\d)(?={_INDEX})")
# UAX #15's stream-safe limit: NFKC sorts a run of combining marks by insertion (quadratic in the
# run: 40,000 alternating marks took 5 s), and no written text holds more than 30 in a row
MAX_MARKS = 30


def normalize_unicode(s: str) -> str:
    """s in NFKC, without format characters (Unicode category Cf: soft hyphen, zero-width space and
    joiners, byte-order mark, bidi controls), every minus sign and dash a '-', runs of combining
    marks cut at MAX_MARKS. Linear in len(s); ASCII comes back as it is."""
    if s.isascii():  # ASCII is NFKC already and holds no Cf
        return s
    # a class of characters beyond the BMP costs re a test per range: 5x slower than the BMP's
    format_chars, long_marks = _unicode_classes(beyond_bmp=max(s) > "\uffff")
    s = format_chars.sub("", s)
    if _AN_INDEX.search(s):  # the lookbehind scan costs 10x a class's: only where one may match
        s = _DIGIT_THEN_INDEX.sub(" ", s)
    s = long_marks.sub(lambda m: m[0][:MAX_MARKS], s)
    s = unicodedata.normalize("NFKC", s)
    for ch, folded in _FOLDS.items():  # str.translate looks up every character: 100x slower
        if ch in s:
            s = s.replace(ch, folded)
    return s


@functools.cache
def _unicode_classes(beyond_bmp: bool) -> tuple[re.Pattern, re.Pattern]:
    """(a format character, a run of more than MAX_MARKS non-starters), of the BMP or of all of
    Unicode: built on first use, from a scan of the code points (about 0.3 s, so importing this
    file stays fast)."""
    def is_non_starter(ch: str) -> bool:  # a mark NFKC reorders, or one it decomposes into
        return bool(unicodedata.combining(ch)
                    or unicodedata.combining(unicodedata.normalize("NFKD", ch)[:1] or "a"))
    chars = [chr(c) for c in range(sys.maxunicode + 1 if beyond_bmp else 0x10000)]
    format_chars = _char_class([ch for ch in chars if unicodedata.category(ch) == "Cf"])
    non_starters = _char_class([ch for ch in chars if is_non_starter(ch)])
    return re.compile(f"{format_chars}+"), re.compile(f"{non_starters}{{{MAX_MARKS + 1},}}")


def _char_class(chars: list[str]) -> str:
    """A regex class of the given characters (ascending), as ranges."""
    ranges: list[list[str]] = []
    for ch in chars:
        if ranges and ord(ch) == ord(ranges[-1][1]) + 1:
            ranges[-1][1] = ch
        else:
            ranges.append([ch, ch])
    return "[" + "".join(re.escape(a) + ("-" + re.escape(b) if b != a else "")
                         for a, b in ranges) + "]"


def normalize_text(s: str) -> str:
    """Lower-case, drop punctuation and English articles, collapse spaces (SQuAD-style,
    Unicode-aware)."""
    s = _THOUSANDS_COMMA.sub("", normalize_unicode(s).lower())  # "1,500" == "1500"
    s = _NON_DECIMAL_DOT.sub("", s)  # "U.S." == "US", but a decimal point stays: "3.5" is not "35"
    # quotes, dashes and apostrophes split words: “Paris”., Paris—, Paris’s all hold "paris"
    s = _ASCII_PUNCTUATION.sub(" ", s)
    if not s.isascii():
        s = _NON_ASCII_NOT_WORD.sub(_space_if_punctuation, s)
    return " ".join(w for w in s.split() if w not in _ARTICLES)


YES_NO = frozenset(("yes", "no"))


NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


CURRENCY = ("$", "€", "£", "¥")


def answer_number(s: str) -> re.Match | None:
    """The first number of s that is not a label, else the first number at all (a lone 'FY2023')."""
    # the answer comes first and its context after ("12.5% in 2023", "25% (2019 to 2020)"): so the
    # first number, not the last
    first = None
    for m in NUMBER.finditer(s):
        if not is_label(s, m):
            return m
        first = first or m
    return first


def is_label(s: str, m: re.Match) -> bool:
    """A number that names rather than counts: glued to a word ('FY2023', 'Q4') or before a colon
    ('2023: 1.5')."""
    glued = m.start() > 0 and s[m.start() - 1].isalpha()
    colon = s.startswith((": ", ":\t"), m.end()) or (s.endswith(":") and m.end() == len(s) - 1)
    return glued or colon


CLOSING_PAREN = re.compile(r"\s*\)")


def number_is_negative(s: str, m: re.Match) -> bool:
    """A minus before the number or its currency ('-12', '- $12', '$-12'), or accounting parentheses
    around them ('(12)', '$(1,234)', '($1,234)')."""
    # a scan back over the spaces before the number, not a regex (r"-?\s*\$?\s*-?\d" backtracks
    # cubically over a run of spaces) nor a copy of the text before it (numbers_hold_gold asks for
    # every number's sign: copies would make that quadratic)
    i = _skip_spaces_back(s, m.start())
    if i > 0 and s[i - 1] in CURRENCY:  # the sign or the parenthesis may stand before the currency
        i = _skip_spaces_back(s, i - 1)
    accounting = i > 0 and s[i - 1] == "(" and CLOSING_PAREN.match(s, m.end()) is not None
    return (i > 0 and s[i - 1] == "-") or accounting


def _skip_spaces_back(s: str, i: int) -> int:
    """Where the run of whitespace that ends at s[i - 1] starts (i itself when there is none)."""
    while i > 0 and s[i - 1].isspace():
        i -= 1
    return i


def parse_number(text: Any) -> float | None:
    """The number a text gives as its answer, else None ('$1,234.5 million' -> 1234.5, '-1%' -> -1).

    Where: the line after the last 'answer is' (as extract_answer reads it), else the last non-empty
    line; there the first number that is not a label ('FY2023: 1.5' -> 1.5, 'Q4' and '2023:' are
    labels). Accounting parentheses make it negative: '$(1,234)' -> -1234.0.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        try:
            value = float(text)
        except OverflowError:  # an integer beyond the float range (JSON integers are unbounded)
            return None
        return value if math.isfinite(value) else None
    s = number_region(normalize_unicode(str(text))).replace(",", "")
    m = answer_number(s)
    if m is None:
        return None
    value = float(m[0])
    if not math.isfinite(value):  # "1e999"
        return None
    return -value if number_is_negative(s, m) else value


def format_number(value: float) -> str:
    """A finite number in plain digits, never an exponent: 1500000.0 -> '1500000', 1.5e-07 ->
    '0.00000015'."""
    # f"{x:g}" would write 1.5e+06 (which CEM never matches) and keep only 6 significant digits
    if value.is_integer():
        return str(int(value))
    return format(Decimal(repr(value)), "f")  # repr: the shortest digits that give the float back


def cover_exact_match(prediction: str, gold: str) -> bool:
    """CEM (§4.2): the normalised gold answer occurs in the prediction, on word boundaries."""
    p, g = normalize_text(prediction), normalize_text(gold)
    if not p or not g:
        return False
    # padding both with spaces turns substring search into whole-word search: "5" is not in "1995"
    return f" {g} " in f" {p} "


def _bmp_chars(categories: str, but: str = "") -> str:
    """Every character of the BMP whose two-letter category is in `categories` ("Pi Pf ..."),
    except those in `but`, escaped for a regex class."""
    wanted = set(categories.split())
    return "".join(re.escape(chr(c)) for c in range(0x10000)
                   if unicodedata.category(chr(c)) in wanted and chr(c) not in but)


_MARKS = _bmp_chars("Mn Mc Me")  # combining marks belong to the word they follow ("e" + U+0301)
_QUOTES = _bmp_chars("Pi Pf") + re.escape("\"'`")
_EMPHASIS = re.escape("*_")  # markdown bold and italics
# what may wrap an answer at its ends: quotes, markdown, brackets (not braces, TeX's: "\boxed{B}"),
# and at the end a full stop or "!"
_OPEN_EDGE = re.compile(rf"[\s{_QUOTES}{_EMPHASIS}{_bmp_chars('Ps', but='{')}]*")
_STOPS = re.escape(".!。！")
_CLOSE_EDGE = re.compile(rf"[\s{_QUOTES}{_EMPHASIS}{_bmp_chars('Pe', but='}')}{_STOPS}]*")
# a number's edges keep their brackets: "(1,234)" is a negative amount, not a wrapped one
_NUMBER_OPEN_EDGE = re.compile(rf"[\s{_QUOTES}{_EMPHASIS}]*")
_NUMBER_CLOSE_EDGE = re.compile(rf"[\s{_QUOTES}{_EMPHASIS}{_STOPS}]*")


def strip_edges(text: str, open_edge: re.Pattern = _OPEN_EDGE,
                close_edge: re.Pattern = _CLOSE_EDGE) -> str:
    """text without the wrapping characters at its two ends ('**"Paris"**.' -> 'Paris')."""
    # the end is matched on the reversed text: a search for "[...]*\Z" retries at every start
    start = open_edge.match(text).end()
    end = len(text) - close_edge.match(text[::-1]).end()
    return text[start:max(start, end)]


# ---- Extraction: the answer statement is one line, and every \boxed{} on that line is opened

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
# a whole answer in TeX math: "$5$", "\(5\)", "\[5\]"
_MATH_PAIR = re.compile(r"\$(.*)\$|\\\((.*)\\\)|\\\[(.*)\\\]", re.S)


# Parentheses around a whole answer are the prompt's "(insert answer here)", copied, except around a
# number: "(12.5)" is the accounting negative, the reading financial documents give it, in a gold
# and in an answer alike (a gold "(12.5)" was -12.5 and an answer "(12.5)" 12.5, so the same number
# could never match). The price: a responder that keeps the prompt's parentheses around a positive
# number writes a negative one. A sign inside them ("(-12.5)") makes them the prompt's again.
_NUMBER_IN_PARENTHESES = re.compile(r"\(\s*(?:[$€£¥₹＄￡￥]\s*)?(?:\d|\.\d)")


def clean_answer(line: str) -> str | None:
    """An answer line without markdown, quotes, trailing dots, TeX math delimiters and the
    template's parentheses (not those around a number); None when empty, still the template's
    placeholder, or without a letter or digit (")" of "The answer is (The answer is)" states
    nothing, and must not pass as an answer: bootstrap.responder_format_penalty reads it)."""
    line = line.replace("*", "").strip().strip('"\u201c\u201d\'').strip().rstrip(".").strip()
    if m := _MATH_PAIR.fullmatch(line):
        line = next(g for g in m.groups() if g is not None).strip()
    if (line.startswith("(") and line.endswith(")")
            and not _NUMBER_IN_PARENTHESES.match(line)):  # the template's parentheses, copied
        line = line[1:-1].strip()
    if not any(ch.isalnum() for ch in line) or _PLACEHOLDER_ANSWER in line.lower():
        return None
    return line


def last_match(pattern: re.Pattern, text: str, pos: int = 0,
               endpos: int | None = None) -> re.Match | None:
    """The last match of pattern in text[pos:endpos], or None."""
    # one match object alive at a time: a list of 10^5 of them made the garbage collector's passes
    # grow with the text, and the scan superlinear
    last = None
    for last in pattern.finditer(text, pos, len(text) if endpos is None else endpos):
        pass
    return last


def after_last_marker(text: str) -> str | None:
    """The first line after the last 'answer is' marker, cleaned (clean_answer)."""
    mark = last_match(_MARKER, text)
    if mark is None:
        return None
    return clean_answer(text[mark.end():].strip().split("\n", 1)[0])


_TEX_OPENER_REVERSED = re.compile(r"[ \t*]*(?:\$|[(\[]\\)?")  # "$", "\(" or "\[" before a box


def box_statement(body: str, box: re.Match, labels: tuple[re.Pattern, ...] = (_MARKER,)) -> int:
    """Where the statement of a \\boxed{} starts (it ends with the line): after a marker or label on
    the box's line ("the answer is \\boxed{X}"), else at the line's first box and its TeX opener."""
    line = body.rfind("\n", 0, box.start()) + 1
    ends = [m.end() for m in (last_match(p, body, line, box.start()) for p in labels) if m]
    if ends:
        return max(ends)
    # prose before the first box is left out: "So \boxed{Rome}"
    first = _BOXED.search(body, line, box.end()).start()
    return first - _TEX_OPENER_REVERSED.match(body[line:first][::-1]).end()


def rest_of_line(text: str, start: int) -> str:
    end = text.find("\n", start)
    return text[start:end if end >= 0 else len(text)]


def extract_text_answer(body: str) -> str | None:
    """The final answer of a free-form response (SPEC §3): the line after the last 'answer is', or
    the statement of the last \\boxed{} when that comes later (box_statement), every box opened."""
    mark, box = last_match(_MARKER, body), last_match(_BOXED, body)
    if box is None or (mark is not None and mark.start() > box.start()):
        return after_last_marker(body)
    # all boxes of the statement, so "\boxed{Paris} or \boxed{Berlin}" reaches the rule as a hedge
    return clean_answer(_BOXED.sub(r"\1", rest_of_line(body, box_statement(body, box))))


def extract_number_answer(body: str) -> str | None:
    """A financial answer: the free-form answer, which must contain a number (the verifier is shown
    it even where the number rule refuses it)."""
    answer = extract_text_answer(body)
    return answer if answer is not None and parse_number(answer) is not None else None



# ---- doc_qa: the gold itself, once, with nothing beside it but "the" and a preposition (Eq. 6)

# What may stand before the gold. "the" never names a candidate; the prepositions count only in
# lower case ("In", "At" are element symbols: "In Ga" is a list of two); "a" and "an" only where the
# gold itself starts with them ("A" is a letter: "A B" is a list of two). A word that joins,
# excludes, compares or negates ("or", "and", "but", "than", "not", "no", "vs") is never allowed:
# with one of them the gold plus allowed words would build a hedge. Nothing may follow the gold.
FILLERS = frozenset(("the",))
PREPOSITIONS = frozenset(("in", "on", "at"))  # "in 1995", "on Monday", "at 5 pm"
MAX_FILLERS = 3  # "in the 1990s" needs two
_ABBREVIATION_DOT = re.compile(r"([^\W\d_])\.")  # "U.S." is "US"; "3.5" keeps its point
# "1,500" is 1500 only in a valid grouping: "1,2,3" stays three numbers, "1994,1995" two
_GROUPED = re.compile(r"(?<![\w.,])[0-9]{1,3}(?:,[0-9]{3})+(?![0-9]|,[0-9])")
# a decimal, a word, or a run of marks (spaces inside the run dropped later: "? !" is "?!")
_MARK, _MARK_OR_SPACE = rf"[^\w{_MARKS}\s]", rf"[^\w{_MARKS}]"
_UNIT = re.compile(rf"[0-9]+(?:\.[0-9]+)+|[\w{_MARKS}]+|{_MARK}(?:{_MARK_OR_SPACE}*{_MARK})?")
_WORD_START = re.compile(rf"[\w{_MARKS}]")
MAX_GOLD = 1000  # characters; a doc_qa gold is a short span (rollout.max_answer_words words)


def answer_units(text: str) -> list[str]:
    """The words and runs of punctuation of an answer, in its own case, its edges stripped
    (strip_edges): '**"U.S. Army"**.' -> ['US', 'Army'], 'AC / DC' -> ['AC', '/', 'DC']."""
    s = strip_edges(normalize_unicode(text)).replace("_", " ")
    s = _ABBREVIATION_DOT.sub(r"\1", s)
    s = _GROUPED.sub(lambda m: m[0].replace(",", ""), s)
    return [u if _is_word(u) else "".join(u.split()) for u in _UNIT.findall(s)]


def _is_word(unit: str) -> bool:
    return _WORD_START.match(unit) is not None


def _filler(unit: str, lead: set[str]) -> bool:
    """A unit that may stand before the gold: 'the', a lower-case preposition, the gold's own
    article."""
    return unit.lower() in FILLERS or unit in PREPOSITIONS or unit.lower() in lead


def rule_doc_qa(prediction: str, gold: str) -> bool:
    """R_rule for doc_qa (Eq. 6, departure 1): the answer, its wrapping quotes, markdown and end
    punctuation removed, is the gold's words once, with the gold's own punctuation or none between
    them, led at most by "the", a lower-case "in"/"on"/"at" or the gold's own leading article."""
    if len(gold) > MAX_GOLD:  # no short answer: the verifier decides
        return False
    g = answer_units(gold)
    lead = set()
    while g and g[0].lower() in _ARTICLES:  # "The Beatles" is "Beatles", led by its own "the"
        lead.add(g.pop(0).lower())
    gold_words = [u.lower() for u in g if _is_word(u)]
    if not gold_words:
        return False
    # every right answer is shorter than this (fillers, the gold with a space around every piece,
    # a dot after every letter, wrapping): anything longer is no answer the rule pays, at no cost
    if len(prediction) > 4 * len(gold) + 64:
        return False
    p = answer_units(prediction)
    i = len(p) - 1
    for j in range(len(g) - 1, -1, -1):  # the gold's units, matched from the answer's end
        if i < 0:
            return False
        if _is_word(g[j]) or not 0 < j < len(g) - 1:  # words, and marks at the gold's ends
            if p[i].lower() != g[j].lower():
                return False
            i -= 1
        elif not _is_word(p[i]):  # marks inside the gold: its own ("AC/DC"), or none ("AC DC")
            if p[i] != g[j]:
                return False
            i -= 1
    rest = p[:i + 1]
    if rest and (" ".join(gold_words) in YES_NO or len(rest) > MAX_FILLERS
                 or not all(_filler(u, lead) for u in rest)):
        return False  # a yes/no gold takes nothing beside it
    words = [u.lower() for u in p if _is_word(u)]
    n = len(gold_words)  # once: "in in" for a gold "in" names it twice
    return sum(words[k:k + n] == gold_words for k in range(len(words) - n + 1)) == 1


def text_holds_gold(body: str, gold: str) -> bool:
    """Whether a free-form answer names the gold anywhere: the paper's cover exact match (§4.2) of
    the answer statement, on word boundaries ("It was 25 percent." and "25 or 35 percent" for
    "25 percent"; not "35 percent")."""
    predicted = extract_text_answer(body)
    return predicted is not None and cover_exact_match(predicted, gold)



# ---- fin_math: one number, with its currency, sign, scale and percent, and a few harmless words

CURRENCY_MARKS = frozenset("$€£¥₹")
CURRENCY_WORDS = frozenset(("usd", "us", "eur", "gbp", "jpy", "cny", "rmb", "inr", "dollar",
                            "dollars", "euro", "euros", "pound", "pounds", "yen", "yuan", "rupee",
                            "rupees", "cent", "cents"))
SCALE_WORDS = frozenset(("hundred", "thousand", "thousands", "million", "millions", "billion",
                         "billions", "trillion", "trillions", "k", "m", "mm", "mn", "b", "bn", "t",
                         "tn"))
GLUED_SUFFIXES = frozenset(("", "k", "m", "mm", "mn", "b", "bn", "t", "tn", "x"))  # "1.5bn", "2x"
PERCENT_WORDS = frozenset(("percent", "per", "cent", "pct", "percentage", "point", "points"))
UNIT_WORDS = frozenset(("share", "shares", "unit", "units", "day", "days", "month", "months",
                        "year", "years", "annum", "times"))
# before the number: an approximation names one value still ("about 5"); a range ("over 5",
# "between 5 and 6", "up to 5") or a negation ("not 5") has no word here
PREFIX_WORDS = frozenset(("approximately", "approx", "about", "around", "roughly",
                          "the")) | CURRENCY_WORDS
SUFFIX_WORDS = SCALE_WORDS | PERCENT_WORDS | UNIT_WORDS | CURRENCY_WORDS
MAX_WORDS = 4  # on each side of the number
_NUMBER_PIECE = re.compile(
    r"(?P<num>(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)"
    r"(?:(?P<exp>e[+-]?[0-9]+)|/(?P<den>[0-9]+))?"
    r"(?P<glued>[^\W_]*)|(?P<word>[^\W_]+)|(?P<mark>\S)")
# a plain fraction anywhere in a statement, for numbers_hold_gold
_FRACTION = re.compile(r"(?<![0-9])[0-9]+/[0-9]+")  # from a run's start: no quadratic retries


def number_region(text: str) -> str:
    """The part of a text that states its number: after the last 'answer is' marker, else the last
    non-empty line; cleaned alike (clean_answer), so a gold reads as the same words after a marker
    would."""
    if (region := after_last_marker(text)) is not None or _MARKER.search(text):
        return region or ""
    text = text.rstrip()
    return clean_answer(text[text.rfind("\n") + 1:]) or ""


def answer_value(text: Any) -> float | None:
    """The one number an answer states, else None (departure 2): '$1,234.5 million' -> 1234.5,
    '$(1,234)' -> -1234.0, 'FY2023: 1.5' -> 1.5; '5 or 6', 'not 5', '1,2,3', '12.5% in 2023' ->
    None.

    Allowed beside the number: first a label glued to digits with its colon ('FY2023:', 'Q4:'); then
    PREFIX_WORDS; then a currency mark, a sign or accounting parentheses; after the number a glued
    scale ('1.5bn'), '%' and SUFFIX_WORDS. A second number, any other word or mark: None.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return parse_number(text)  # a JSON number: exact, finite
    s = number_region(normalize_unicode(str(text)))  # every minus sign a '-'
    s = strip_edges(s, _NUMBER_OPEN_EDGE, _NUMBER_CLOSE_EDGE).lower()
    number, colon_due, words, before, after = None, False, 0, "", []
    # read lazily: the first piece refused ends the reading, so a long text costs one regex scan
    for k, m in enumerate(_NUMBER_PIECE.finditer(s)):
        kind, piece = "num" if m["num"] else m.lastgroup, m[0]  # lastgroup: "glued" closes last
        if colon_due:  # a label stands for what follows its colon
            if piece != ":":
                return None
            colon_due = False
        elif number is None and kind == "num":
            if m["glued"] not in GLUED_SUFFIXES:  # "5or6", "2023fy"
                return None
            number, words = m, 0
        elif number is None and kind == "word" and k == 0 and not piece.isalpha():
            colon_due = True  # letters glued to digits: "fy2023", "q4"
        elif number is None and kind == "word":
            if before or piece not in PREFIX_WORDS or words == MAX_WORDS:  # words come first
                return None
            words += 1
        elif number is None and kind == "mark":
            if piece not in "$€£¥₹-+(" or piece in before:
                return None
            before += piece
        elif number is not None and kind == "word" and piece in SUFFIX_WORDS and words < MAX_WORDS:
            words += 1
            after.append(piece)
        elif number is not None and kind == "mark" and piece in "%)" and piece not in after:
            after.append(piece)
        else:
            return None
    if number is None or colon_due:
        return None
    signs = sum(c in "-+(" for c in before)
    if signs > 1 or sum(c in CURRENCY_MARKS for c in before) > 1:  # "-(5)", "$€5"
        return None
    accounting = "(" in before
    if accounting != (")" in after):
        return None
    # accounting parentheses close right after the number or its scale: "(1.2) million",
    # "(1.2 million)"; "(12.5%)" may be an aside or a negative share, so it states nothing
    if accounting and ("%" in after or after.index(")") > int(after[0] in SCALE_WORDS)):
        return None
    if number["den"] is not None:
        # a plain fraction, two integers ("1/4" is 0.25), as the authors' normaliser evaluates it;
        # "(1/4)" may be a grouping or a negative, so it states nothing
        if not number["num"].isdigit() or accounting:
            return None
        value = _fraction_value(number["num"], number["den"])
    else:
        value = float(number["num"].replace(",", "") + (number["exp"] or ""))
    if value is None or not math.isfinite(value):  # "1e999"
        return None
    return -value if "-" in before or accounting else value


def _fraction_value(numerator: str, denominator: str) -> float | None:
    """numerator / denominator, two runs of digits; None for a zero or unbounded denominator."""
    den = float(denominator)  # float, not int: int() refuses more than 4300 digits
    return float(numerator) / den if 0 < den < math.inf else None


def values_match(p: float, g: float, rel_tol: float = 0.0015) -> bool:
    """Equal within rel_tol of the gold, up to a scale of 100/1e3/1e6/1e9; sign matters (SPEC
    §3)."""
    if g == 0 or p == 0:
        return p == g
    if (p < 0) != (g < 0):
        return False
    ratio = p / g  # |p*s - g| <= tol*|g| as |ratio*s - 1| <= tol: no overflow for huge golds
    return any(abs(ratio * s - 1) <= rel_tol or abs(ratio / s - 1) <= rel_tol
               for s in (1.0, 100.0, 1e3, 1e6, 1e9))


def numbers_match(prediction: str, gold: str, rel_tol: float = 0.0015) -> bool:
    """R_rule for fin_math (Eq. 6): the one number each states (answer_value) match
    (values_match)."""
    p, g = answer_value(prediction), answer_value(gold)
    return p is not None and g is not None and values_match(p, g, rel_tol)


def numbers_hold_gold(body: str, gold: str) -> bool:
    """Whether any number of the answer statement, with its sign, is the gold's (values_match):
    "5 or 6" and "about $5 million, up from 4" hold a gold of 5; "6" does not."""
    predicted, g = extract_text_answer(normalize_unicode(body)), answer_value(gold)
    if predicted is None or g is None:
        return False
    s = predicted.replace(",", "")
    for m in NUMBER.finditer(s):
        value = float(m[0])
        if math.isfinite(value) and values_match(-value if number_is_negative(s, m) else value, g):
            return True
    for m in _FRACTION.finditer(s):  # "about 1/4 of it" holds 0.25
        value = _fraction_value(*m[0].split("/"))
        if value is not None and math.isfinite(value) and values_match(
                -value if number_is_negative(s, m) else value, g):
            return True
    return False



# ---- doc_mc: the last answer statement is one letter and nothing else

# where a letter is read (SPEC §3): after 'answer is', after an 'Answer:' label at a line's start,
# in a \boxed{}, or a last line that starts with 'Option'
_ANSWER_LABEL = re.compile(r"^[ \t*#>]*(?i:(?:final|correct)[ \t]+)?(?i:answer)[ \t*]*:", re.M)
_OPTION_LINE = re.compile(r"[ \t*#>]*(?i:option|choice)[ \t]*\(?[A-Da-d]\)?(?![A-Za-z0-9])")
# a statement is one whose text starts with a letter in one of these forms; prose after 'answer is'
# ("this answer is supported by...") is no statement
_LETTER_START = re.compile(r"(?:\\boxed\{\s*)?"
                           r"(?:(?i:option|choice)[ \t]*\(?[A-Da-d]\)?|\(?[A-D]\)?)(?![A-Za-z0-9])")
_LETTER = re.compile(r"(?i:option|choice)[ \t]*\(?([A-Da-d])\)?|\(?([A-D])\)?")
# a letter named anywhere in a statement (letters_hold_gold) is a token of its own: no letter or
# digit touches it, so "Cash" names no C and "Adoption" holds no "option"; brackets may ("(C)Cash")
_LETTER_TOKEN = re.compile(r"(?<![^\W_])(?:(?i:option|choice)[ \t]*\(?([A-Da-d])|([A-D]))"
                           r"(?![^\W_])")
# An "A" before a lower-case word or a digit is read as the English article ("A bank loan", "A 10%
# rise"), not as option A: a no-document answer that spells an option's text out would otherwise
# name A and make a grounded question look answered (§4.1). The words below can follow an option
# letter but never the article (they join letters or state something of one: "A or B", "A is
# correct"), so before them "A" stays a letter; an "A" before a capital ("A B") stays one too. The
# price: "A fits best" reads as the article, so a response that says so for a gold of A is labelled
# wrong rather than left undecided (rule_label).
LETTER_FOLLOWERS = frozenset((
    "or", "and", "nor", "but", "vs", "versus", "plus", "then", "to", "through", "is", "was", "has",
    "seems", "appears", "looks", "would", "could", "should", "might", "because", "since", "as",
    "if"))
_NEXT_LOWER_WORD = re.compile(r"\s+([a-z0-9][^\W_]*)")
MAX_LETTER_LINE = 200  # characters: a statement of one letter in any allowed wrapping is shorter


def _letter_of(region: str) -> str | None:
    """The letter a statement's text names when it is nothing but one letter form ('(B)', 'B',
    'Option b', '\\boxed{B}', wrapped in markdown, quotes or TeX), else None."""
    if len(region) > MAX_LETTER_LINE:
        return None
    # the end's dot goes before "\\]" can be read as a bracket
    region = region.replace("*", "").strip().rstrip(".!").strip()
    if m := _MATH_PAIR.fullmatch(region):
        region = next(g for g in m.groups() if g is not None)
    region = strip_edges(region)
    if m := _BOXED.fullmatch(region):
        region = strip_edges(m[1])
    m = _LETTER.fullmatch(region)
    return (m[1] or m[2]).upper() if m else None


def extract_letter_answer(body: str) -> str | None:
    """The option a multiple-choice response settles on (SPEC §3): its last answer statement, when
    that states one letter and nothing else ("A or B", "A good choice", "(B) and (C)": None)."""
    body = normalize_unicode(body)  # "(\uff22)" is "(B)"
    last = (-1, -1)  # the last statement: where it stands, where its text starts (to the line end)
    for pattern in (_MARKER, _ANSWER_LABEL):
        for m in pattern.finditer(body):
            # the text may start on a later line ("The answer is\n\n(B)"); the runs skipped here
            # are disjoint (each stops before the next marker's letters): the scan stays linear
            text_at = _OPEN_EDGE.match(body, m.end()).end()
            if _LETTER_START.match(body, text_at):
                last = max(last, (m.start(), text_at))
    if box := last_match(_BOXED, body):  # a box always states
        last = max(last, (box.start(), box_statement(body, box, (_MARKER, _ANSWER_LABEL))))
    tail = body.rstrip()
    line = tail.rfind("\n") + 1
    if _OPTION_LINE.match(tail, line) and _letter_of(tail[line:]):  # a last line "Option B."
        last = max(last, (line, line))
    at, start = last
    return None if at < 0 else _letter_of(rest_of_line(body, start))


def letters_hold_gold(body: str, gold: str) -> bool:
    """Whether the gold's letter is among the letters the last answer statement names ("A or B",
    "either (A) or (C)", "\\boxed{A} or \\boxed{B}"): the line after the last 'answer is' or
    'Answer:' (from its first visible character on), else the last line."""
    body, gold = normalize_unicode(body), normalize_unicode(gold)
    marks = [m for m in (last_match(_MARKER, body), last_match(_ANSWER_LABEL, body)) if m]
    if marks:
        start = _OPEN_EDGE.match(body, max(m.end() for m in marks)).end()
    else:
        start = body.rstrip().rfind("\n") + 1
    region = _BOXED.sub(r" \1 ", rest_of_line(body, start))
    named = {(m[1] or m[2]).upper() for m in _LETTER_TOKEN.finditer(region)
             if not _is_article(region, m)}
    return gold.strip().strip("()").upper() in named


def _is_article(text: str, m: re.Match) -> bool:
    """Whether a bare "A" is the article: a lower-case word or a digit follows it, and the word is
    none of LETTER_FOLLOWERS."""
    if m[2] != "A":
        return False
    nxt = _NEXT_LOWER_WORD.match(text, m.end())
    return nxt is not None and nxt[1] not in LETTER_FOLLOWERS


# ==================================================================================================
# The questioner's reference answer per task (a format error, Eq. 7, when it fails)
# ==================================================================================================

def check_doc_qa(question: str, answer: str, obj: dict, letter, max_words: int) -> dict | None:
    """A general-QA question: the reference answer is a short span (rollout.max_answer_words)."""
    if not answer.strip() or len(answer.split()) > max_words or not _matchable_gold(answer):
        return None
    return {"question": question, "answer": answer.strip()}


def _matchable_gold(answer: str) -> bool:
    """A doc_qa gold that the rule can match at all: some word left after normalisation (not a bare
    "A" or "The"), one line (extraction reads one), no '*' (extraction drops an answer's '*'), at
    most MAX_GOLD characters (rule_doc_qa leaves longer ones to the verifier)."""
    one_line = "\n" not in answer.strip() and "*" not in answer
    return bool(normalize_text(answer)) and one_line and len(answer) <= MAX_GOLD


def check_fin_math(question: str, answer: str, obj: dict, letter, max_words: int) -> dict | None:
    """A financial-math question: the reference is one non-zero number, kept in plain digits."""
    # the strict reader, the one the rule reads a response with: a range or a list ("5 or 6",
    # "10 to 12") is a format error, not its first number, and "1/4" is 0.25, not 1
    value = answer_value(answer)
    if value is None or value == 0:  # the prompt asks for a non-zero number
        return None
    return {"question": question, "answer": format_number(value)}


def check_doc_mc(question: str, answer: str, obj: dict, letter, max_words: int) -> dict | None:
    """A multiple-choice question: options A-D, each a text, and the answer is the letter the
    questioner was told to make correct (departure 3)."""
    options = obj.get("options")
    if not isinstance(options, dict) or sorted(options) != list(LETTERS):
        return None
    texts = {k: _scalar_text(options[k]) for k in LETTERS}
    if not all(t is not None and t.strip() and not is_template_text(t) for t in texts.values()):
        return None
    given = normalize_unicode(answer).strip().strip("()").strip().upper()
    if given not in LETTERS or (letter is not None and given != letter):
        return None
    return {"question": question, "options": {k: t.strip() for k, t in texts.items()},
            "answer": given}


# ==================================================================================================
# The three task types (§5.1), and the paper's own rule beside ours
# ==================================================================================================

def rule_fin_math(predicted: str, gold: str) -> bool:
    """The same number: within 0.15 %, up to a scale of 100 / 1e3 / 1e6 / 1e9 (numbers_match)."""
    return numbers_match(predicted, gold)


def rule_doc_mc(predicted: str, gold: str) -> bool:
    """The same letter."""
    return predicted == gold.strip().strip("()").upper()


def paper_doc_qa(body: str, gold: str) -> bool:
    """The paper's doc_qa rule: cover exact match on word boundaries (§4.2)."""
    predicted = extract_text_answer(body)
    return predicted is not None and cover_exact_match(predicted, gold)


def paper_fin_math(body: str, gold: str) -> bool:
    """The paper's fin_math rule: the first number of the answer."""
    predicted = extract_text_answer(body)
    if predicted is None:
        return False
    p, g = parse_number(predicted), parse_number(gold)
    return p is not None and g is not None and values_match(p, g)


def paper_doc_mc(body: str, gold: str) -> bool:
    """The paper's doc_mc rule: the letter the last answer statement starts with."""
    mark = last_match(_MARKER, body)
    if mark is None:
        return False
    letter = _LETTER_START.match(body, _OPEN_EDGE.match(body, mark.end()).end())
    return letter is not None and _letter_of(letter[0]) == gold.strip().strip("()")


# §5.1's three task types; data.task_weights draws among them in this order
TASKS: dict[str, Task] = {
    "doc_qa": Task(check=check_doc_qa, extract=extract_text_answer, rule=rule_doc_qa,
                   holds=text_holds_gold, paper=paper_doc_qa),
    "fin_math": Task(check=check_fin_math, extract=extract_number_answer, rule=rule_fin_math,
                     holds=numbers_hold_gold, rule_decides=True, financial=True,
                     paper=paper_fin_math),
    "doc_mc": Task(check=check_doc_mc, extract=extract_letter_answer, rule=rule_doc_mc,
                   holds=letters_hold_gold, multiple_choice=True, rule_decides=True,
                   paper=paper_doc_mc),
}


def paper_score(response: str, gold: str, task: str) -> float:
    """The score the paper's rule gives, without this file's hedge guards (departures 1, 2): the
    task's Task.paper (for a task the paper has no rule of its own for, R_rule). Eval reports it
    beside R_rule, so a reader sees when hedging inflates the paper's number."""
    body = strip_reasoning(response)
    if body is None:
        return 0.0
    kind = TASKS[task]
    if kind.paper is None:
        return float((answer := kind.extract(body)) is not None and kind.rule(answer, gold))
    return float(kind.paper(body, gold))


# ==================================================================================================
# Prompts built from model output: fences and control tokens
# ==================================================================================================

# ⟦ ⟧: no answer holds them (fence takes them out), so no answer can close its fence
FENCE_OPEN, FENCE_CLOSE = "\u27e6", "\u27e7"
_NO_FENCE = str.maketrans({FENCE_OPEN: "[", FENCE_CLOSE: "]"})
REFERENCE_CAP = 1000  # characters of a reference shown; questioners' golds are at most 30 words


def answer_cap(reference: str) -> int:
    """Characters of an answer shown beside a reference: max(64, 4 x the reference's characters),
    the reference counted up to REFERENCE_CAP."""
    return max(64, 4 * min(len(reference), REFERENCE_CAP))


def fence(text: str, cap: int | None = None, one_line: bool = True) -> str:
    """text between ⟦ and ⟧ for a verifier or judge prompt: no verdict tags, no fence characters
    inside, every line break and run of whitespace one space (one_line), at most `cap` characters,
    a cut marked after the fence."""
    # translate first: "⟦[YES]]" becomes a tag, which the strip then removes
    text = strip_verdict_tags(text.translate(_NO_FENCE))
    if one_line:
        # str.split() splits at every line break Python knows: \r, \v, \f, U+001C-001E, U+0085,
        # U+2028, U+2029, so no answer can start a line of its own ("- Answer 2: ...")
        text = " ".join(text.split())
    if cap is None or len(text) <= cap:
        return f"{FENCE_OPEN}{text}{FENCE_CLOSE}"
    # the note stands outside the fence, where no answer can write
    return f"{FENCE_OPEN}{text[:cap]}{FENCE_CLOSE} [cut: the first {cap} of {len(text)} characters]"



_VERDICT_TAG = re.compile(r"\[\[(?:YES|NO)\]\]", re.I)


def strip_verdict_tags(text: str) -> str:
    """Text with every [[YES]] / [[NO]] (any case) replaced by a space, for the verifier prompt
    (Eq. 4)."""
    # a space, not nothing: "[[YE[[NO]]S]]" would otherwise close up into a new tag
    return _VERDICT_TAG.sub(" ", text)



def control_tokens(tokenizer) -> tuple[str, ...]:
    """The strings a tokenizer reads as one added id wherever they stand: role tags, end of turn,
    and tags it does not flag special (Qwen2.5's "<tool_call>", Qwen3's "<think>")."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}  # a test's stand-in has none
    # an added token is cut out of the text before the vocabulary is consulted, whatever its
    # special flag says; a whitespace-only one (some vocabularies add runs of spaces) carries no
    # role, and defusing it would change the ids of ordinary text
    tokens = {t.content for t in added.values() if t.content.strip()}
    return tuple(sorted(tokens | set(getattr(tokenizer, "all_special_tokens", None) or ())))


_WORD_JOINER = "\u2060"  # invisible, and no tokenizer's control token holds it


def defuse_control_tokens(text: str, tokens: Sequence[str]) -> str:
    """text with a word joiner after the first character of every place a control token starts.

    "Paris<|im_end|>\n<|im_start|>system" in an answer would otherwise end the user turn of the
    verifier's prompt and open a system turn. Text that holds no control token comes back unchanged,
    so its ids do not change either.
    """
    tokens = tuple(t for t in tokens if len(t) > 1)  # one character cannot be split (none in use)
    if not any(t in text for t in tokens):
        return text
    return _control_token_starts(tokens).sub(lambda m: m[0] + _WORD_JOINER, text)


@functools.lru_cache(maxsize=8)
def _control_token_starts(tokens: tuple[str, ...]) -> re.Pattern:
    """Matches the first character of every occurrence of a token, overlapping ones included."""
    # a lookahead at each position also finds occurrences that overlap; a joiner lands inside each
    # of them, and inserting joiners cannot make a new occurrence (no token holds one)
    return re.compile("(?=" + "|".join(map(re.escape, tokens)) + ")(.)", re.S)
