"""IFEval scoring offline: lm-eval's own checkers with the NLTK-free tokenizers of qrecover.evaluate.ifeval_offline.

Every instruction type that occurs in the IFEval data gets hand-written responses, each with the verdict
derived by hand from the checker's rule (and, for the two checkers that use NLTK, from what trained Punkt
would do). Where the untrained sentence splitter and trained Punkt disagree, the item is listed in
``PUNKT_DIFFERENCES`` with the reason. Importing and scoring must not reach the network or print to stdout.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qrecover.evaluate import ifeval_offline

# (instruction id, kwargs as in the data file, response, verdict)
CASES = [
    ("punctuation:no_comma", {}, "There are no commas in this sentence.", True),
    ("punctuation:no_comma", {}, "Yes, there is one.", False),
    ("length_constraints:number_words", {"relation": "at least", "num_words": 5}, "one two three four five", True),
    ("length_constraints:number_words", {"relation": "at least", "num_words": 5}, "one two three four", False),
    # \w+ splits "It's" into two words: 3 words, not less than 3
    ("length_constraints:number_words", {"relation": "less than", "num_words": 3}, "It's fine.", False),
    ("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 3}, "This is one. This is two.", True),
    ("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 3}, "One. Two! Three?", False),
    ("length_constraints:number_sentences", {"relation": "at least", "num_sentences": 2}, "A single sentence without a stop", False),
    # 3.5 is not a sentence boundary for either splitter
    ("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 2}, "It costs 3.5 dollars today.", True),
    ("keywords:forbidden_words", {"forbidden_words": ["apple", "pear"]}, "I like bananas.", True),
    ("keywords:forbidden_words", {"forbidden_words": ["apple", "pear"]}, "An Apple a day.", False),  # case-insensitive
    ("keywords:forbidden_words", {"forbidden_words": ["apple", "pear"]}, "Pineapples are sweet.", True),  # \b word match
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*first part* and *second part*", True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "**only one**", False),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "at least"}, "The cat saw another Cat.", True),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "at least"}, "A dog.", False),
    # substring matches count: "conCATenate" + "cat" = 2, not less than 2
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "less than"}, "concatenate the cat", False),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a haiku about rain."},
     "Write a haiku about rain. Drops fall on the roof", True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a haiku about rain."}, "Here is a haiku: rain", False),
    ("startend:quotation", {}, '"Wrapped in quotes."', True),
    ("startend:quotation", {}, 'Not "wrapped".', False),
    ("change_case:english_lowercase", {}, "this whole response is written in lowercase english letters only, as asked.", True),
    ("change_case:english_lowercase", {}, "This response starts with a capital letter, so it fails.", False),
    ("keywords:existence", {"keywords": ["banana", "kiwi"]}, "A banana and a kiwi.", True),
    ("keywords:existence", {"keywords": ["banana", "kiwi"]}, "A banana only.", False),
    ("detectable_format:title", {}, "<<A Poem>>\nroses are red", True),
    ("detectable_format:title", {}, "<< >>\nan empty title", False),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "at least"}, "Zebras zigzag.", True),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "at least"}, "A lazy dog.", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two\n- three", False),  # exactly 2
    ("language:response_language", {"language": "en"},
     "The weather today is sunny and warm, so we are going to the park with our friends.", True),
    ("language:response_language", {"language": "en"},
     "Das Wetter ist heute sonnig und warm, deshalb gehen wir mit unseren Freunden in den Park.", False),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name], we visit [address] soon.", True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name], see you soon.", False),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First paragraph.\n***\nSecond paragraph.", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "One.\n***\n***\nTwo.", False),  # empty middle
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Done. Any other questions?", True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Any other questions? Done.", False),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hello.\nP.S. see you", True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hello, no postscript.", False),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hello.\nP.P.S one more thing", True),
    ("change_case:english_capital", {}, "THIS RESPONSE IS WRITTEN ENTIRELY IN CAPITAL LETTERS, AS REQUESTED.", True),
    ("change_case:english_capital", {}, "Mostly CAPITAL LETTERS but not all of them.", False),
    # trained Punkt + Treebank: I, LOVE, NYC, ., YES, . -> 4 capital words; preserve_line: I, LOVE, NYC., YES, . -> 4
    ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": "at least"}, "I LOVE NYC. YES.", True),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "less than"}, "Only ONE word is loud.", True),
    # a hyphenated word is one token: STATE-OF-THE-ART counts once
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "at least"}, "It is STATE-OF-THE-ART.", False),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "less than"}, "WE ARE LOUD. VERY.", False),
    ("combination:two_responses", {}, "First answer.\n******\nSecond answer.", True),
    ("combination:two_responses", {}, "Same.\n******\nSame.", False),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', True),
    ("detectable_format:json_format", {}, "{a: 1}", False),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nIntro\nSection 2\nEnd", True),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2}, "Section 1\nOnly one", False),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
     "Some text.\n\nHowever, more text.", True),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
     "Some text.\n\nBut more text.", False),
    ("detectable_format:constrained_response", {}, "My answer is yes.", True),
    ("detectable_format:constrained_response", {}, "Yes.", False),
]

# Where the untrained sentence splitter differs from trained Punkt (lm-eval's english.pickle): trained
# Punkt knows the abbreviations "Dr.", "Mr.", "U.S.", "e.g." and does not end a sentence after them;
# the untrained splitter ends one after every token-final period. (instruction, kwargs, response,
# verdict here, verdict with trained Punkt)
PUNKT_DIFFERENCES = [
    # here: "Dr." | "Smith arrived." | "He sat down." = 3 sentences; trained Punkt: 2
    ("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 3}, "Dr. Smith arrived. He sat down.", False, True),
    # here: "The U.S." | "is large." = 2 sentences; trained Punkt: 1
    ("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 2}, "The U.S. is large.", False, True),
    # here: "Use tools, e.g." | "a hammer." = 2; trained Punkt: 1
    ("length_constraints:number_sentences", {"relation": "at least", "num_sentences": 2}, "Use tools, e.g. a hammer.", True, False),
]


@pytest.fixture(scope="module")
def util():
    return ifeval_offline.install()


def verdict(instruction_id: str, kwargs: dict, response: str, prompt: str = "a prompt") -> bool:
    from lm_eval.tasks.ifeval.utils import InputExample, test_instruction_following_strict

    inp = InputExample(key=0, instruction_id_list=[instruction_id], prompt=prompt, kwargs=[kwargs])
    return test_instruction_following_strict(inp, response).follow_instruction_list[0]


def test_every_instruction_type_of_the_data_is_covered():
    from qrecover.benchdata import data_file

    rows = [json.loads(line) for line in data_file("ifeval").read_text().splitlines()]
    in_data = {i for r in rows for i in r["instruction_id_list"]}
    covered = {c[0] for c in CASES}
    assert len(rows) == 541
    assert in_data <= covered, sorted(in_data - covered)
    for iid in covered:  # a true and a false verdict for every type
        assert {c[3] for c in CASES if c[0] == iid} == {True, False}, iid


@pytest.mark.parametrize("iid,kwargs,response,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_verdicts_match_hand_derived(util, iid, kwargs, response, expected):
    assert verdict(iid, kwargs, response) is expected


@pytest.mark.parametrize("iid,kwargs,response,here,trained", PUNKT_DIFFERENCES)
def test_known_differences_from_trained_punkt(util, iid, kwargs, response, here, trained):
    assert verdict(iid, kwargs, response) is here
    assert here is not trained  # documented difference, not an accident


def test_sentence_and_word_counts(util):
    assert util.count_sentences("One. Two! Three? Four") == 4
    assert util.count_sentences("It costs 3.5 dollars.") == 1
    assert util.count_words("It's a well-known fact.") == 6  # It, s, a, well, known, fact
    # capital words do not depend on the sentence split: the Treebank tokenizer run per sentence (as
    # word_tokenize does with trained Punkt) and on the whole line give the same isupper() count
    from nltk.tokenize import TreebankWordTokenizer

    tb = TreebankWordTokenizer()
    for text in ["I LOVE NYC. YES. no", "HELLO World. I AM HERE! Right? OK.", "Dr. WHO is ON TV. WOW."]:
        per_sentence = [w for s in util.split_into_sentences(text) for w in tb.tokenize(s)]
        whole = util.nltk.word_tokenize(text)
        assert sum(w.isupper() for w in per_sentence) == sum(w.isupper() for w in whole), text


def test_loose_and_prompt_level(util):
    from lm_eval.tasks.ifeval.utils import process_results

    doc = {"key": 1, "prompt": "p", "instruction_id_list": ["punctuation:no_comma", "startend:quotation"],
           "kwargs": [{}, {}]}
    # strict: the comma-free response is not wrapped in quotes; loose drops the first line ("Sure:")
    out = process_results(doc, ['Sure:\n"A reply without commas"'])
    assert out == {"prompt_level_strict_acc": False, "inst_level_strict_acc": [True, False],
                   "prompt_level_loose_acc": True, "inst_level_loose_acc": [True, True]}


def test_install_is_idempotent(util):
    assert ifeval_offline.install() is util
    assert isinstance(util.nltk, ifeval_offline._NltkProxy)


def test_no_download_no_network_no_stdout(tmp_path):
    """In a fresh interpreter with no NLTK data and sockets refused, importing and scoring works silently."""
    code = f"""
import socket, nltk
def refuse(*a, **k):
    raise RuntimeError("network access attempted")
socket.socket.connect = refuse
socket.create_connection = refuse
nltk.data.path[:] = [{str(tmp_path)!r}]
from qrecover.evaluate.ifeval_offline import install
util = install()
from lm_eval.tasks.ifeval.utils import process_results
doc = {{"key": 1, "prompt": "p", "instruction_id_list": ["length_constraints:number_sentences",
       "change_case:capital_word_frequency"], "kwargs": [{{"relation": "less than", "num_sentences": 3}},
       {{"capital_frequency": 1, "capital_relation": "at least"}}]}}
r = process_results(doc, ["I am here. Really."])
assert r["inst_level_strict_acc"] == [True, True], r
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == ""
    assert "network access attempted" not in p.stderr
