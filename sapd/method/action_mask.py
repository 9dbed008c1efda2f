"""Action span → token mask (docs/SAPD.md §3, Eq. 6): which generated tokens belong to the executable
decision block, found in the decoded text and mapped to tokens through the tokenizer's offsets.

A token is in the mask when its character range lies inside the inner text of the decision block
(``<action>…</action>``, or the first ``<search>``/``<answer>`` block for search QA) and overlaps that
text stripped of surrounding white space. Under byte-level BPE a token can straddle a tag: Qwen2.5's
tokenizer makes ``' </'`` of ``… 1 </action>`` and ``'>\n'`` of ``<action>\nopen …``; such a piece is
left out (docs/SAPD.md §6: the mask excludes the tags), and so is white space alone at the block's
edges. A response with no complete block has an empty mask (its step score is 0; the format rule
penalises it).
"""

from __future__ import annotations

from typing import Sequence

from sapd.method.benchmarks import BenchmarkSpec, parse_decision


def span_token_mask(offsets_T: Sequence[tuple[int, int]], span: tuple[int, int] | None,
                    core: tuple[int, int] | None = None) -> list[bool]:
    """mask_T[k] = token k's character range [s, e) lies inside ``span`` = [a, b) and overlaps ``core``
    (default: ``span``; the span without its edge white space), so no token reaching outside the span — a
    piece of a tag — is in the mask.

    >>> span_token_mask([(0, 3), (3, 8), (8, 12)], (3, 12))
    [False, True, True]
    >>> span_token_mask([(0, 4), (4, 8), (8, 9), (9, 13)], (3, 9), core=(4, 8))  # (0,4) and (9,13) straddle
    [False, True, False, False]
    """
    if span is None:
        return [False] * len(offsets_T)
    a, b = span
    ca, cb = core or span
    return [a <= s and e <= b and s < cb and e > ca for s, e in offsets_T]


def token_char_offsets(tokenizer, token_ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """Decode ``token_ids`` and give each token its [start, end) in the decoded text.

    Fast path: re-tokenise the decoded text with offsets; when that reproduces the sampled ids exactly
    (the usual case) its offset mapping is the answer. Otherwise (a sampled tokenisation that is not the
    canonical one) fall back to incremental decoding, which is exact for any ids but O(T²).
    """
    ids = list(token_ids)
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) == ids:
        return text, [tuple(o) for o in enc["offset_mapping"]]
    offsets, prev = [], 0
    for k in range(len(ids)):
        end = len(tokenizer.decode(ids[:k + 1], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False))
        # a token ending inside a multi-byte character decodes to U+FFFD until the character completes
        end = max(end, prev)
        offsets.append((prev, end))
        prev = end
    return text, offsets


def action_token_mask(tokenizer, token_ids: Sequence[int], benchmark: str | BenchmarkSpec) -> list[bool]:
    """Action mask of one generated response given as token ids (special tokens such as EOS are never
    inside a block, so they are never in the mask)."""
    text, offsets = token_char_offsets(tokenizer, token_ids)
    span = parse_decision(text, benchmark).span
    if span is None:
        return [False] * len(offsets)
    inner = text[span[0]:span[1]]
    start = span[0] + len(inner) - len(inner.lstrip())
    core = (start, max(start, span[0] + len(inner.rstrip())))
    return span_token_mask(offsets, span, core)
