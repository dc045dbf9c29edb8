"""Build evals/sotu_verify_set.jsonl: held-out items for the verifier of SPELL (§4.1, Eq. 4), to
measure while the policy trains whether, as verifier, it still tells answers that mean the same as
the reference from answers that do not.

Each item pairs one question of evals/sotu_heldout_qa.jsonl (its reference answer is the question's
first gold answer) with a candidate answer, as a responder's extracted final answer would read, and
a label: YES when the candidate means the same as the reference, NO when it does not. Every
candidate and label below was written and checked by hand against the question's passage
(evals/README.md, "Verification set"); nothing here derives a candidate or a label by a rule.

Kinds: exact (the reference itself, YES), paraphrase (the same answer in other words, units or
notation, YES), other_question (another question's answer, NO), near_miss (a nearby number, the
wrong scale or unit, a related but wrong name, NO), hedge (several candidates, the right one among
them, NO), negation (the right answer denied, NO).

Run from the repository root: .venv/bin/python evals/build_verify_set.py
"""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# build() looks up only the 75 question ids ITEMS names (the held-out file's first 75, 1961-1980);
# the 150 questions appended to that file on 2026-11-28 have no items, so a rerun writes the same
# 321 items, byte for byte (tests/test_verify_set.py)
HELDOUT = ROOT / "evals" / "sotu_heldout_qa.jsonl"
OUT = ROOT / "evals" / "sotu_verify_set.jsonl"

# what each kind claims, so a mistyped label stops the build instead of entering the set
KIND_LABEL = {"exact": "YES", "paraphrase": "YES", "other_question": "NO", "near_miss": "NO",
              "hedge": "NO", "negation": "NO"}

# (question _id, [(kind, candidate, label)]); the comment is what the passage says
ITEMS = [
    # "Since 1951 farm income has been squeezed down by 25 percent."
    ("1961-Kennedy-1#00-q1", [
        ("exact", "25 percent", "YES"),
        ("paraphrase", "25%", "YES"),
        ("paraphrase", "by a quarter", "YES"),
        ("near_miss", "35 percent", "NO"),
        ("negation", "not 25 percent", "NO"),
    ]),
    # "during each month some 150,000 workers are exhausting ... jobless benefit rights"
    ("1961-Kennedy-1#00-q2", [
        ("exact", "150,000", "YES"),
        ("paraphrase", "some 150,000 workers", "YES"),
        ("near_miss", "15,000", "NO"),
        ("near_miss", "one million", "NO"),  # those who searched for work over four months
        ("other_question", "155,000", "NO"),
    ]),
    # "increase the dollar price of gold from $35 an ounce"
    ("1961-Kennedy-1#01-q3", [
        ("exact", "$35", "YES"),
        ("paraphrase", "35 dollars an ounce", "YES"),
        ("near_miss", "$53", "NO"),
        ("hedge", "$35 or $40", "NO"),
    ]),
    # "some $22 billion in total gold stocks and other international monetary reserves"
    ("1961-Kennedy-1#01-q4", [
        ("exact", "$22 billion", "YES"),
        ("paraphrase", "22 billion dollars", "YES"),
        ("near_miss", "$22 million", "NO"),
        ("other_question", "$11 billion", "NO"),
    ]),
    # "we still have 25 million Americans living in substandard homes"
    ("1961-Kennedy-1#01-q5", [
        ("exact", "25 million", "YES"),
        ("paraphrase", "25,000,000 Americans", "YES"),
        ("near_miss", "2 million", "NO"),  # the passage's "2 million more children" in classrooms
        ("negation", "anything but 25 million", "NO"),
    ]),
    # "I urge a new Department of Urban Affairs and Housing."
    ("1962-Kennedy-1#01-q1", [
        ("exact", "Urban Affairs and Housing", "YES"),
        ("paraphrase", "a Department of Urban Affairs and Housing", "YES"),
        ("near_miss", "Department of Transportation", "NO"),
        ("hedge", "either Urban Affairs and Housing or Transportation", "NO"),
    ]),
    # "Since 1950 our agricultural output per man-hour has actually doubled!"
    ("1962-Kennedy-1#01-q2", [
        ("exact", "1950", "YES"),
        ("paraphrase", "since 1950", "YES"),
        ("near_miss", "1960", "NO"),
        ("near_miss", "1961", "NO"),  # the passage's year of the farm-income rise
        ("negation", "no, it is not 1950", "NO"),
    ]),
    # "the 100th anniversary, next January, of the Emancipation Proclamation"
    ("1962-Kennedy-1#01-q3", [
        ("exact", "Emancipation Proclamation", "YES"),
        ("paraphrase", "Lincoln's Emancipation Proclamation", "YES"),
        ("near_miss", "the Gettysburg Address", "NO"),
        ("hedge", "the Emancipation Proclamation or the Constitution", "NO"),
    ]),
    # "155,000 members of the Reserve and National Guard were activated"
    ("1962-Kennedy-1#03-q4", [
        ("exact", "155,000", "YES"),
        ("paraphrase", "155 thousand", "YES"),
        ("near_miss", "165,000", "NO"),
        ("other_question", "150,000", "NO"),
    ]),
    # "identifying, marking, and stocking 50 million spaces"
    ("1962-Kennedy-1#03-q5", [
        ("exact", "50 million", "YES"),
        ("paraphrase", "fifty million spaces", "YES"),
        ("near_miss", "50 thousand", "NO"),
        ("negation", "it is not 50 million", "NO"),
    ]),
    # "This net reduction in tax liabilities of $10 billion"
    ("1963-Kennedy-1#01-q1", [
        ("exact", "$10 billion", "YES"),
        ("paraphrase", "ten billion dollars", "YES"),
        ("near_miss", "$10 million", "NO"),
        ("other_question", "$11 billion", "NO"),
    ]),
    # "to improve the lives of 32 million Americans who live on the outskirts of poverty"
    ("1963-Kennedy-1#01-q2", [
        ("exact", "32 million", "YES"),
        ("paraphrase", "32 million Americans", "YES"),
        ("near_miss", "four million", "NO"),  # the passage's Americans born every year
        ("hedge", "32 million or 4 million", "NO"),
    ]),
    # "three times as high as that of Sweden"
    ("1963-Kennedy-1#01-q3", [
        ("exact", "Sweden", "YES"),
        ("paraphrase", "the Kingdom of Sweden", "YES"),
        ("near_miss", "Norway", "NO"),
        ("negation", "anything other than Sweden", "NO"),
    ]),
    # "that France will be such a power in the future"
    ("1963-Kennedy-1#03-q4", [
        ("exact", "France", "YES"),
        ("paraphrase", "the French Republic", "YES"),
        ("near_miss", "West Germany", "NO"),
        ("other_question", "Great Britain", "NO"),
    ]),
    # "It has distributed 1.5 million school books and is building 17,000 classrooms."
    ("1963-Kennedy-1#03-q5", [
        ("exact", "17,000", "YES"),
        ("paraphrase", "seventeen thousand classrooms", "YES"),
        ("near_miss", "1.5 million", "NO"),  # the school books
        ("hedge", "between 15,000 and 17,000", "NO"),
    ]),
    # "total expenditures of $97,900 million--compared to $98,400 million for the current year"
    ("1964-Johnson-1#00-q1", [
        ("exact", "$97,900 million", "YES"),
        ("paraphrase", "$97.9 billion", "YES"),
        ("near_miss", "$98,400 million", "NO"),
        ("negation", "not $97,900 million", "NO"),
    ]),
    # "One thousand dollars ... can return $40,000 or more in his lifetime."
    ("1964-Johnson-1#00-q2", [
        ("exact", "$40,000", "YES"),
        ("paraphrase", "forty thousand dollars", "YES"),
        ("near_miss", "$4,000", "NO"),
        ("other_question", "$227", "NO"),
    ]),
    # "a special effort in the chronically distressed areas of Appalachia"
    ("1964-Johnson-1#01-q3", [
        ("exact", "Appalachia", "YES"),
        ("paraphrase", "the Appalachian region", "YES"),
        ("near_miss", "the Ozarks", "NO"),
        ("hedge", "Appalachia, the Deep South, or New England", "NO"),
    ]),
    # "more hospitals and nursing homes under the Hill-Burton Act"
    ("1964-Johnson-1#01-q4", [
        ("exact", "Hill-Burton", "YES"),
        ("paraphrase", "the Hill-Burton Act", "YES"),
        ("near_miss", "the Social Security Act", "NO"),  # hospital insurance, the next sentence
        ("negation", "not the Hill-Burton Act", "NO"),
    ]),
    # "release $11 billion of tax reduction into the private spending stream"
    ("1964-Johnson-1#01-q5", [
        ("exact", "$11 billion", "YES"),
        ("paraphrase", "11 billion dollars", "YES"),
        ("near_miss", "$11 million", "NO"),
        ("other_question", "$10 billion", "NO"),
    ]),
    # "changes in the Taft-Hartley Act including section 14(b)"
    ("1965-Johnson-1#02-q1", [
        ("exact", "Taft-Hartley", "YES"),
        ("paraphrase", "the Taft-Hartley Act", "YES"),
        ("near_miss", "the Wagner Act", "NO"),
        ("hedge", "Taft-Hartley or Landrum-Griffin", "NO"),
    ]),
    # "test projects between Washington and Boston"
    ("1965-Johnson-1#02-q2", [
        ("exact", "Boston", "YES"),
        ("paraphrase", "Boston, Massachusetts", "YES"),
        ("near_miss", "New York", "NO"),
        ("negation", "no, not Boston", "NO"),
    ]),
    # "Thomas Jefferson said that no nation can be both ignorant and free."
    ("1965-Johnson-1#02-q3", [
        ("exact", "Jefferson", "YES"),
        ("paraphrase", "Thomas Jefferson", "YES"),
        ("paraphrase", "President Jefferson", "YES"),
        ("near_miss", "James Madison", "NO"),
        ("other_question", "Sam Rayburn", "NO"),
    ]),
    # "We hope to make the Potomac a model of beauty here in the Capital"
    ("1965-Johnson-1#03-q4", [
        ("exact", "Potomac", "YES"),
        ("paraphrase", "the Potomac River", "YES"),
        ("near_miss", "the Anacostia River", "NO"),
        ("hedge", "the Potomac or the Hudson", "NO"),
        ("hedge", "the Potomac, or maybe the Hudson", "NO"),
    ]),
    # "Last year we saved almost $3,500 million by eliminating waste"
    ("1965-Johnson-1#03-q5", [
        ("exact", "$3,500 million", "YES"),
        ("paraphrase", "$3.5 billion", "YES"),
        ("near_miss", "$3.5 million", "NO"),
        ("negation", "anything but $3,500 million", "NO"),
    ]),
    # "reduced from $2.8 billion in 1964 to $1.3 billion, or less, in 1965"
    ("1966-Johnson-1#01-q1", [
        ("exact", "$1.3 billion", "YES"),
        ("paraphrase", "1.3 billion dollars", "YES"),
        ("paraphrase", "$1,300 million", "YES"),
        ("near_miss", "$1.3 million", "NO"),
        ("near_miss", "$2.8 billion", "NO"),  # the 1964 deficit
    ]),
    # "Over the past 5 years it is up 40 percent, and over the past year it is up 22 percent"
    ("1966-Johnson-1#01-q2", [
        ("exact", "22 percent", "YES"),
        ("paraphrase", "22%", "YES"),
        ("near_miss", "40 percent", "NO"),  # five years, not the past year
        ("hedge", "22 percent or 40 percent", "NO"),
    ]),
    # "We will need expenditures of $58.3 billion for the next fiscal year"
    ("1966-Johnson-1#03-q3", [
        ("exact", "$58.3 billion", "YES"),
        ("paraphrase", "58.3 billion dollars", "YES"),
        ("near_miss", "$5.8 billion", "NO"),  # the increase in special Vietnam expenditures
        ("negation", "other than $58.3 billion", "NO"),
        ("hedge", "$58.3 billion to $63 billion", "NO"),  # a range around the answer
    ]),
    # "trying to wipe out smallpox and malaria and control yellow fever"
    ("1966-Johnson-1#03-q4", [
        ("exact", "yellow fever", "YES"),
        ("near_miss", "malaria", "NO"),  # the question sets it aside
        ("hedge", "yellow fever or cholera", "NO"),
    ]),
    # "little more than 6 years ago, North Vietnam decided on conquest"
    ("1966-Johnson-1#03-q5", [
        ("exact", "North Vietnam", "YES"),
        ("paraphrase", "Communist North Vietnam", "YES"),
        ("near_miss", "South Vietnam", "NO"),
        ("other_question", "France", "NO"),
    ]),
    # "For 83 months this Nation has been on a steady upward trend of growth."
    ("1968-Johnson-1#01-q1", [
        ("exact", "83 months", "YES"),
        ("paraphrase", "83", "YES"),
        ("paraphrase", "eighty-three months", "YES"),
        ("near_miss", "83 years", "NO"),
        ("hedge", "83 months or 38 months", "NO"),
    ]),
    # "equipped with more than 70 million television sets"
    ("1968-Johnson-1#01-q2", [
        ("exact", "70 million", "YES"),
        ("paraphrase", "70,000,000 sets", "YES"),
        ("near_miss", "70 thousand", "NO"),
        ("negation", "not 70 million", "NO"),
    ]),
    # "Congress authorized $662 million ... But the Congress appropriated only $312 million"
    ("1968-Johnson-1#02-q3", [
        ("exact", "$312 million", "YES"),
        ("paraphrase", "312 million dollars", "YES"),
        ("near_miss", "$662 million", "NO"),  # authorized, not appropriated
        ("other_question", "$100 million", "NO"),
    ]),
    # "a 10-year campaign to build 6 million new housing units"
    ("1968-Johnson-1#02-q4", [
        ("exact", "6 million", "YES"),
        ("paraphrase", "six million", "YES"),
        ("paraphrase", "6,000,000 units", "YES"),
        ("near_miss", "300,000", "NO"),  # the units to start next year
        ("hedge", "6 million or 600,000", "NO"),
    ]),
    # "in saving the lives of babies, America ranks 15th among the nations of the world"
    ("1968-Johnson-1#02-q5", [
        ("exact", "15th", "YES"),
        ("paraphrase", "fifteenth", "YES"),
        ("near_miss", "5th", "NO"),
        ("negation", "not 15th", "NO"),
    ]),
    # "we have resumed discussions with Communist China in our talks at Warsaw"
    ("1970-Nixon-1#01-q1", [
        ("exact", "Warsaw", "YES"),
        ("paraphrase", "Warsaw, Poland", "YES"),
        ("near_miss", "Helsinki", "NO"),
        ("other_question", "Warsaw Pact", "NO"),  # an alliance, not the city
        ("other_question", "Moscow", "NO"),
    ]),
    # "It is time for a New Federalism"
    ("1970-Nixon-1#01-q2", [
        ("exact", "New Federalism", "YES"),
        ("paraphrase", "the New Federalism", "YES"),
        ("near_miss", "the New Deal", "NO"),
        ("hedge", "New Federalism or the Great Society", "NO"),
    ]),
    # "the Federal Government spent $57 billion more than it took in in taxes"
    ("1970-Nixon-1#01-q3", [
        ("exact", "$57 billion", "YES"),
        ("paraphrase", "57 billion dollars", "YES"),
        ("near_miss", "$75 billion", "NO"),
        ("negation", "definitely not $57 billion", "NO"),
    ]),
    # "a $10 billion nationwide clean waters program"
    ("1970-Nixon-1#03-q4", [
        ("exact", "$10 billion", "YES"),
        ("paraphrase", "a $10 billion program", "YES"),
        ("near_miss", "$10 million", "NO"),
        ("other_question", "16 billion", "NO"),
    ]),
    # "the environment ... in which we spend 80 percent of our time"
    ("1970-Nixon-1#03-q5", [
        ("exact", "80 percent", "YES"),
        ("paraphrase", "80%", "YES"),
        ("paraphrase", "four-fifths", "YES"),
        ("near_miss", "8 percent", "NO"),
        ("hedge", "80 percent or 90 percent", "NO"),
    ]),
    # "an appropriation of an extra $100 million to launch an intensive campaign"
    ("1971-Nixon-1#01-q1", [
        ("exact", "$100 million", "YES"),
        ("paraphrase", "an extra 100 million dollars", "YES"),
        ("near_miss", "$100 billion", "NO"),
        ("negation", "anything except $100 million", "NO"),
    ]),
    # "just recently San Diego and Cleveland cut back on trash collections"
    ("1971-Nixon-1#01-q2", [
        ("exact", "Cleveland", "YES"),
        ("paraphrase", "Cleveland, Ohio", "YES"),
        ("near_miss", "San Diego", "NO"),  # the question sets it aside
        ("other_question", "Boston", "NO"),
        ("hedge", "probably Cleveland but maybe Detroit", "NO"),
    ]),
    # "my home town of Whittier, California-which has a population of 67,000"
    ("1971-Nixon-1#02-q3", [
        ("exact", "Whittier", "YES"),
        ("paraphrase", "Whittier, California", "YES"),
        ("near_miss", "Yorba Linda", "NO"),  # Nixon's birthplace, not the town the passage names
        ("hedge", "Whittier or San Clemente", "NO"),
    ]),
    # the same sentence: "Whittier, California-which has a population of 67,000"
    ("1971-Nixon-1#02-q4", [
        ("exact", "67,000", "YES"),
        ("paraphrase", "67 thousand people", "YES"),
        ("near_miss", "76,000", "NO"),
        ("negation", "not 67,000", "NO"),
    ]),
    # "a $ 16 billion investment ... Five billion dollars of this will be in new ... funds"
    ("1971-Nixon-1#02-q5", [
        ("exact", "16 billion", "YES"),
        ("paraphrase", "$16 billion", "YES"),
        ("near_miss", "$5 billion", "NO"),  # the unrestricted part of it
        ("other_question", "$11 billion", "NO"),  # also the passage's other part
    ]),
    # "Let us do everything we can to avoid gasoline rationing"
    ("1974-Nixon-1#01-q1", [
        ("exact", "gasoline rationing", "YES"),
        ("paraphrase", "rationing of gasoline", "YES"),
        ("paraphrase", "gas rationing", "YES"),
        ("near_miss", "heating oil rationing", "NO"),
        ("hedge", "gasoline rationing or price controls", "NO"),
        ("hedge", "gasoline rationing if not price controls", "NO"),
    ]),
    # "last year, for the first time in 18 years, there has been a halt in the growth"
    ("1974-Nixon-1#03-q2", [
        ("exact", "18 years", "YES"),
        ("paraphrase", "eighteen years", "YES"),
        ("near_miss", "18 months", "NO"),
        ("negation", "no, not 18 years", "NO"),
    ]),
    # "bringing it down from 44 percent in 1969 to 29 percent in the current year"
    ("1974-Nixon-1#03-q3", [
        ("exact", "29 percent", "YES"),
        ("paraphrase", "29%", "YES"),
        ("near_miss", "44 percent", "NO"),  # 1969
        ("other_question", "25 percent", "NO"),
    ]),
    # "cut our military manpower ... from 3.5 million to 2.2 million"
    ("1974-Nixon-1#03-q4", [
        ("exact", "2.2 million", "YES"),
        ("paraphrase", "2,200,000", "YES"),
        ("near_miss", "3.5 million", "NO"),  # the level it was cut from
        ("hedge", "2.2 million or 2.5 million", "NO"),
    ]),
    # "negotiating with the nations of the Warsaw Pact on mutual and balanced reduction"
    ("1974-Nixon-1#03-q5", [
        ("exact", "Warsaw Pact", "YES"),
        ("paraphrase", "the Warsaw Pact nations", "YES"),
        ("near_miss", "NATO", "NO"),
        ("negation", "anything but the Warsaw Pact", "NO"),
    ]),
    # "a freshman Congressman ... stood before Sam Rayburn in the well of the House"
    ("1975-Ford-1#00-q1", [
        ("exact", "Sam Rayburn", "YES"),
        ("paraphrase", "Speaker Sam Rayburn", "YES"),
        ("paraphrase", "Rayburn", "YES"),
        ("near_miss", "Harry Truman", "NO"),  # quoted in the next paragraph
        ("other_question", "Jefferson", "NO"),
    ]),
    # "There were 59 million Americans employed at the start of 1949; now ... more than 85 million"
    ("1975-Ford-1#00-q2", [
        ("exact", "59 million", "YES"),
        ("paraphrase", "59,000,000 Americans", "YES"),
        ("near_miss", "85 million", "NO"),  # employed now
        ("hedge", "59 million or 85 million", "NO"),
    ]),
    # "I call on the Congress to act by April 1."
    ("1975-Ford-1#00-q3", [
        ("exact", "April 1", "YES"),
        ("paraphrase", "the first of April", "YES"),
        ("paraphrase", "April 1st", "YES"),
        ("near_miss", "April 15", "NO"),
        ("negation", "not by April 1", "NO"),
    ]),
    # "legally obligated to spend more than $360 billion in fiscal year 1976"
    ("1975-Ford-1#01-q4", [
        ("exact", "$360 billion", "YES"),
        ("paraphrase", "360 billion dollars", "YES"),
        ("near_miss", "$360 million", "NO"),
        ("other_question", "$58.3 billion", "NO"),
    ]),
    # "commercial production at the Elk Hills, California, Naval Petroleum Reserve"
    ("1975-Ford-1#01-q5", [
        ("exact", "Elk Hills", "YES"),
        ("paraphrase", "Elk Hills, California", "YES"),
        ("near_miss", "Teapot Dome", "NO"),
        ("hedge", "Elk Hills or Teapot Dome", "NO"),
    ]),
    # "The worst recession since World War II turned around in April."
    ("1976-Ford-1#01-q1", [
        ("exact", "April", "YES"),
        ("paraphrase", "in April", "YES"),
        ("near_miss", "January", "NO"),
        ("other_question", "April 1", "NO"),  # a day the passage does not give, not the month
    ]),
    # "for a family of four making $15,000 a year, there will be $227 more in take-home pay"
    ("1976-Ford-1#01-q2", [
        ("exact", "$227", "YES"),
        ("paraphrase", "227 dollars a year", "YES"),
        ("near_miss", "$272", "NO"),
        ("negation", "it isn't $227", "NO"),
    ]),
    # "additional housing assistance for 500,000 families"
    ("1976-Ford-1#01-q3", [
        ("exact", "500,000", "YES"),
        ("paraphrase", "half a million families", "YES"),
        ("near_miss", "50,000", "NO"),
        ("other_question", "150,000", "NO"),
    ]),
    # "The American farmer, who now feeds 215 million Americans"
    ("1976-Ford-1#01-q4", [
        ("exact", "215 million", "YES"),
        ("paraphrase", "215,000,000 Americans", "YES"),
        ("near_miss", "250 million", "NO"),
        ("hedge", "between 200 and 215 million", "NO"),
    ]),
    # "I propose to consolidate some 59 separate Federal programs"
    ("1976-Ford-1#03-q5", [
        ("exact", "59", "YES"),
        ("paraphrase", "some 59 programs", "YES"),
        ("near_miss", "95", "NO"),
        ("other_question", "59 million", "NO"),
    ]),
    # "our country will have the first $2 trillion economy in the history of the world"
    ("1978-Carter-1#01-q1", [
        ("exact", "$2 trillion", "YES"),
        ("paraphrase", "a $2 trillion economy", "YES"),
        ("paraphrase", "2 trillion dollars", "YES"),
        ("near_miss", "$2 billion", "NO"),
        ("negation", "not $2 trillion", "NO"),
    ]),
    # "the early passage of a greatly improved Humphrey-Hawkins bill"
    ("1978-Carter-1#01-q2", [
        ("exact", "Humphrey-Hawkins", "YES"),
        ("paraphrase", "the Humphrey-Hawkins bill", "YES"),
        ("near_miss", "Davis-Bacon", "NO"),
        ("other_question", "Taft-Hartley", "NO"),
    ]),
    # "For 30 years, concerted but unsuccessful efforts have been made to ban the testing"
    ("1978-Carter-1#03-q3", [
        ("exact", "30 years", "YES"),
        ("paraphrase", "thirty years", "YES"),
        ("near_miss", "13 years", "NO"),
        ("hedge", "20 years or 30 years", "NO"),
    ]),
    # "We are hard at work with Great Britain and the Soviet Union on an agreement"
    ("1978-Carter-1#03-q4", [
        ("exact", "Great Britain", "YES"),
        ("paraphrase", "Britain", "YES"),
        ("paraphrase", "the United Kingdom", "YES"),
        ("near_miss", "West Germany", "NO"),
        ("other_question", "France", "NO"),
        ("negation", "not Great Britain", "NO"),
    ]),
    # "approval of the Panama Canal treaties"
    ("1978-Carter-1#03-q5", [
        ("exact", "Panama Canal", "YES"),
        ("paraphrase", "the Panama Canal treaties", "YES"),
        ("near_miss", "the SALT treaties", "NO"),
        ("other_question", "Warsaw Pact", "NO"),
    ]),
    # "we've created 7,100,000 new jobs"
    ("1979-Carter-1#00-q1", [
        ("exact", "7,100,000", "YES"),
        ("paraphrase", "7.1 million", "YES"),
        ("near_miss", "710,000", "NO"),
        ("hedge", "7,100,000 or 7,700,000", "NO"),
    ]),
    # "the largest contributor to that inflation—skyrocketing hospital costs"
    ("1979-Carter-1#00-q2", [
        ("exact", "hospital costs", "YES"),
        ("paraphrase", "skyrocketing hospital costs", "YES"),
        ("near_miss", "doctors' fees", "NO"),
        ("negation", "anything but hospital costs", "NO"),
    ]),
    # "The presence of Vice Premier Deng Xiaoping next week will help to inaugurate that new era."
    ("1979-Carter-1#02-q3", [
        ("exact", "Deng Xiaoping", "YES"),
        ("paraphrase", "Vice Premier Deng Xiaoping", "YES"),
        ("paraphrase", "Teng Hsiao-ping", "YES"),  # the same name in Wade-Giles spelling
        ("near_miss", "Hua Guofeng", "NO"),
        ("other_question", "Sam Rayburn", "NO"),
    ]),
    # "The first SALT agreement was concluded in 1972."
    ("1979-Carter-1#02-q4", [
        ("exact", "1972", "YES"),
        ("paraphrase", "in 1972", "YES"),
        ("near_miss", "1979", "NO"),
        ("hedge", "1972 or 1974", "NO"),
    ]),
    # "just one of our relatively invulnerable Poseidon submarines ... carries enough warheads"
    ("1979-Carter-1#02-q5", [
        ("exact", "Poseidon", "YES"),
        ("paraphrase", "Poseidon submarines", "YES"),
        ("near_miss", "Trident", "NO"),
        ("negation", "not Poseidon", "NO"),
    ]),
    # "At this time in Iran, 50 Americans are still held captive"
    ("1980-Carter-2#00-q1", [
        ("exact", "50", "YES"),
        ("paraphrase", "50 Americans", "YES"),
        ("paraphrase", "fifty", "YES"),
        ("near_miss", "52", "NO"),
        ("other_question", "50 million", "NO"),
    ]),
    # "neither the American people nor I will support sending an Olympic team to Moscow"
    ("1980-Carter-2#01-q2", [
        ("exact", "Moscow", "YES"),
        ("paraphrase", "Moscow, USSR", "YES"),
        ("near_miss", "Lake Placid", "NO"),  # the 1980 winter games, in the United States
        ("hedge", "Moscow or Leningrad", "NO"),
    ]),
    # "It contains more than two-thirds of the world's exportable oil."
    ("1980-Carter-2#01-q3", [
        ("exact", "two-thirds", "YES"),
        ("paraphrase", "2/3", "YES"),
        ("paraphrase", "two thirds", "YES"),
        ("near_miss", "one-third", "NO"),
        ("negation", "not two-thirds", "NO"),
    ]),
    # "brought Soviet military forces to within 300 miles of the Indian Ocean"
    ("1980-Carter-2#01-q4", [
        ("exact", "300 miles", "YES"),
        ("paraphrase", "three hundred miles", "YES"),
        ("near_miss", "300 kilometers", "NO"),
        ("other_question", "30 years", "NO"),
    ]),
    # "Israel makes another major withdrawal from the Sinai"
    ("1980-Carter-2#01-q5", [
        ("exact", "Sinai", "YES"),
        ("paraphrase", "the Sinai Peninsula", "YES"),
        ("near_miss", "the West Bank", "NO"),  # named in the paragraph before
        ("hedge", "the Sinai or Gaza", "NO"),
    ]),
]


def build() -> list[dict]:
    """One record per (question, candidate), in the order written above; ids are QUESTION_ID-vN."""
    questions = {}
    for line in HELDOUT.read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        questions[q["_id"]] = q
    records, seen = [], set()
    for qid, candidates in ITEMS:
        assert qid in questions, f"{HELDOUT.name}: no question {qid}"
        assert qid not in seen, f"{qid} listed twice"
        seen.add(qid)
        q = questions[qid]
        for n, (kind, candidate, label) in enumerate(candidates, 1):
            where = f"{qid} item {n} ({candidate!r})"
            assert KIND_LABEL.get(kind) == label, f"{where}: kind {kind!r} with label {label!r}"
            assert candidate.strip() and "\n" not in candidate, f"{where}: not one line"
            records.append({"id": f"{qid}-v{n}", "question_id": qid, "question": q["input"],
                            "reference": q["answers"][0], "candidate": candidate,
                            "label": label, "kind": kind})
    return records


def render(records: list[dict]) -> str:
    """The file's text: one JSON object a line."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


if __name__ == "__main__":
    records = build()
    OUT.write_text(render(records), encoding="utf-8")
    yes = sum(r["label"] == "YES" for r in records)
    print(f"{len(records)} items ({yes} YES, {len(records) - yes} NO) "
          f"on {len(ITEMS)} questions -> {OUT}")
