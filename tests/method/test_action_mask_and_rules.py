"""Decision parsing, action-span → token masks through real tokenizer offsets, and the rule rewards."""

import pytest

from sapd.method.action_mask import action_token_mask, span_token_mask, token_char_offsets
from sapd.method.benchmarks import exact_match, parse_decision
from sapd.method.rules import RuleWeights, format_score, repetition_score, rule_score
from tests.tokenizer_util import build_test_tokenizer, qwen_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_test_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("text,valid,content", [
    ("<think>a</think>\n<action>Go To Desk 1</action>", True, "go to desk 1"),
    ("<think>a</think><action>  </action>", False, ""),
    ("<action>look</action>", False, "look"),  # no think block
    ("<think>a</think><action>look", False, ""),  # incomplete
    ("<think>a</think><action>look</action><action>inventory</action>", False, "look"),
])
def test_action_parsing(text, valid, content):
    d = parse_decision(text, "alfworld")
    assert (d.valid, d.content) == (valid, content)


@pytest.mark.parametrize("text,kind,valid,content", [
    ("<think>x</think><search> who wrote it </search>", "search", True, "who wrote it"),
    ("<think>x</think><answer> Paris </answer>", "answer", True, "Paris"),
    ("<search> q </search> then <answer> a </answer>", "search", True, "q"),  # text after </search> is cut
    ("<search> q <answer> a </answer>", "answer", False, "a"),  # both kinds before the cut
    ("<answer> a <answer> b </answer>", "answer", False, "a <answer> b"),  # twice
    ("no tags at all", "search", False, ""),
])
def test_search_parsing(text, kind, valid, content):
    d = parse_decision(text, "searchqa")
    assert (d.kind, d.valid, d.content) == (kind, valid, content)


def test_span_token_mask_by_hand():
    offsets = [(0, 2), (2, 5), (5, 9), (9, 9), (9, 12)]
    # (2, 5) reaches before the span: a tag piece, out
    assert span_token_mask(offsets, (3, 9)) == [False, False, True, False, False]
    assert span_token_mask(offsets, (2, 9)) == [False, True, True, False, False]
    assert span_token_mask(offsets, (2, 9), core=(5, 9)) == [False, False, True, False, False]  # white space only
    assert span_token_mask(offsets, None) == [False] * 5


@pytest.mark.parametrize("bench,text,inner", [
    ("alfworld", "<think>I need the mug.</think>\n<action>take mug 1 from table 1</action>", "take mug 1 from table 1"),
    ("webshop", "<think>ok</think>\n<action>click[Buy Now]</action>", "click[Buy Now]"),
    ("searchqa", "<think>hm</think>\n<search> capital of India </search>", " capital of India "),
    ("searchqa", "<think>hm</think>\n<answer> New Delhi </answer>", " New Delhi "),
])
def test_action_mask_covers_exactly_the_decision_block(tokenizer, bench, text, inner):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    mask = action_token_mask(tokenizer, ids, bench)
    assert len(mask) == len(ids) and not mask[-1]  # EOS never in the mask
    covered = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert inner.strip() in covered
    # nothing of the think block, and at most a tag fragment around the content
    assert "think" not in covered and len(covered) <= len(inner) + 2 * len("</action>")
    start = text.index(inner)
    lo, hi = start + len(inner) - len(inner.lstrip()), start + len(inner.rstrip())
    _, offsets = token_char_offsets(tokenizer, ids)
    for (s, e), m in zip(offsets, mask):  # inside the block, touching its content
        assert m == (start <= s and e <= start + len(inner) and s < hi and e > lo)


def test_non_canonical_tokenisation_falls_back_to_incremental_offsets(tokenizer):
    text = "<think>x</think><action>go to desk 1</action>"
    # a sampler may emit a non-canonical split: encode character by character
    ids = [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert ids != tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded, offsets = token_char_offsets(tokenizer, ids)
    assert decoded == text and len(offsets) == len(ids)
    mask = action_token_mask(tokenizer, ids, "alfworld")
    assert "".join(ch for ch, m in zip(text, mask) if m) == "go to desk 1"


def test_multibyte_characters_keep_offsets_monotone(tokenizer):
    text = "<think>café 漢字</think><action>look</action>"
    ids = [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    _, offsets = token_char_offsets(tokenizer, ids)
    assert all(a[1] <= b[0] or a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1][1] == len(text)
    mask = action_token_mask(tokenizer, ids, "alfworld")
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "look"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return qwen_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.mark.slow  # loading the real Qwen2.5 tokenizer (151,936 entries) takes seconds
@pytest.mark.parametrize("text,pieces", [
    # Qwen2.5's BPE makes ' </' of the space before the closing tag: not in the mask
    ("<think>ok</think>\n<action> put apple 1 in/on fridge 1 </action>",
     [" put", " apple", " ", "1", " in", "/on", " fridge", " ", "1"]),
    # … and '>\n' of the opening tag's '>' and the newline after it
    ("<think>ok</think>\n<action>\nopen fridge 1\n</action>", ["open", " fridge", " ", "1"]),
    ("<think>I need the apple.</think>\n<action>go to countertop 1</action>", ["go", " to", " countert", "op", " ", "1"]),
    ("<think>ok</think>\n<action>go to cabinet 10</action>\n", ["go", " to", " cabinet", " ", "1", "0"]),
])
def test_qwen_tag_pieces_stay_out_of_the_mask(qwen, text, pieces):
    """The real Qwen2.5 tokenizer (tests/assets/qwen2.5-tokenizer): the masked tokens are the action's own,
    no piece of '<action>' or '</action>' (the gpu-regime audit's E5 found ' </' and '>\n' inside)."""
    ids = qwen(text, add_special_tokens=False)["input_ids"] + [qwen.eos_token_id]
    assert qwen.eos_token == "<|im_end|>" and len(qwen) == 151665 + 271  # Qwen2.5's vocabulary, padded
    mask = action_token_mask(qwen, ids, "alfworld")
    masked = [qwen.decode([i]) for i, m in zip(ids, mask) if m]
    assert masked == pieces
    assert not any(c in "".join(masked) for c in "<>/") or "/on" in masked


def test_empty_mask_without_a_block(tokenizer):
    ids = tokenizer("<think>no action here</think>", add_special_tokens=False)["input_ids"]
    assert not any(action_token_mask(tokenizer, ids, "alfworld"))


# ------------------------------------------------------------------------------------------- rules


def test_format_rule():
    assert format_score("<think>a</think><action>look</action>", "alfworld") == 0.0
    assert format_score("<action>look</action>", "alfworld") == -1.0
    assert format_score("<think>a</think>look", "webshop") == -1.0
    assert format_score("<search> q </search>", "searchqa") == 0.0
    assert format_score("<search> q <answer> a </answer>", "searchqa") == -1.0


def test_repetition_rule():
    r = "<think>a</think><action>Go to desk 1</action>"
    assert repetition_score(r, "go to desk 1", "alfworld") == -1.0
    assert repetition_score(r, "go to desk 2", "alfworld") == 0.0
    assert repetition_score(r, None, "alfworld") == 0.0  # first turn: nothing to repeat
    assert repetition_score("<search> same query </search>", "same  query", "searchqa") == -1.0


def test_rule_score_weights():
    bad_and_repeated = "<action>look</action>"  # no think → format −1; repeats "look" → −1
    assert rule_score(bad_and_repeated, "look", "alfworld") == -2.0
    assert rule_score(bad_and_repeated, "look", "alfworld", RuleWeights(format=0.5, repetition=2.0)) == -2.5
    assert rule_score("<think>a</think><action>look</action>", "inventory", "alfworld") == 0.0


def test_exact_match_normalisation():
    assert exact_match("The Eiffel Tower.", ["eiffel tower"])
    assert exact_match("  NEW   delhi ", ["New Delhi"])
    assert not exact_match("Ganges", ["Yamuna", "Jumna"])
