"""StopMatcher and TokenStopMatcher (§4.6): cross-token stop matching, hold-back, the
earliest-end / longest / configuration-order rule, and the absorbing first hit (§4.3).

The Hypothesis properties compare the matcher with a brute-force oracle written here: scan the
whole text for every stop at every position and apply the rule of spec/DECISIONS.md.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.machine import IllegalTransition
from decodespec.runtime.stop import StopHit, StopKind, StopMatcher, TokenStopMatcher
from decodespec.spec import load_spec

RULE = load_spec("stop_matcher").params["stop_rule_version"]


# -- the brute-force oracle -----------------------------------------------------------------------


def oracle_hit(stops, text) -> tuple[int, int, int] | None:
    """(index, start, end) of the winner: earliest end, then longest, then configuration order.

    Works on bytes (stop strings) and on tuples of ids (stop token sequences) alike.
    """
    found = [
        (start + len(s), -len(s), i, start)
        for i, s in enumerate(stops)
        for start in range(len(text) - len(s) + 1)
        if text[start : start + len(s)] == s
    ]
    if not found:
        return None
    end, _, i, start = min(found)
    return i, start, end


def oracle_held(stops, text):
    """The longest suffix of `text` that is a proper prefix of some stop (bytes or id tuples)."""
    for k in range(min(len(text), max(map(len, stops), default=0)), 0, -1):
        suffix = text[len(text) - k :]
        if any(len(s) > k and s[:k] == suffix for s in stops):
            return suffix
    return text[:0]


def run_chunks(m: StopMatcher, chunks: list[bytes]) -> tuple[list[bytes], StopHit | None]:
    outs: list[bytes] = []
    for c in chunks:
        out, hit = m.push(c)
        outs.append(out)
        if hit is not None:
            return outs, hit
    return outs, None


# -- the §4.6 fixture and hand-checked cases ----------------------------------------------------


def test_fixture_4_6_holds_B_then_hides_BCD():
    """§4.6 fixture: 101 -> "AB", 102 -> "CD", stop "BCD": "A" is emitted, B held, then nothing."""
    m = StopMatcher(["BCD"])
    assert m.push(b"AB") == (b"A", None)
    assert m.held == b"B" and m.state == "HOLDING"
    out, hit = m.push(b"CD")
    assert out == b""
    assert hit == StopHit("BCD", 0, 1, 4, RULE, StopKind.STRING)
    assert hit.kind == "string" and m.hit is hit and m.state == "HIT"
    m.discard_from_first_match()
    assert m.state == "DISCARDED" and m.held == b""


def test_stop_spanning_two_pushes_is_caught():
    """§4.6: a stop split across two tokens is matched; only bytes before it are emitted."""
    outs, hit = run_chunks(StopMatcher(["stop"]), [b"go st", b"op now"])
    assert b"".join(outs) == b"go " and (hit.start, hit.end) == (3, 7)


def test_stop_spanning_three_pushes_is_caught():
    """§4.6: a stop split across three tokens; its first bytes stay held until it completes."""
    m = StopMatcher(["<end>"])
    assert m.push(b"x<e") == (b"x", None)
    assert m.push(b"n") == (b"", None) and m.held == b"<en"
    out, hit = m.push(b"d>tail")
    assert out == b"" and hit.stop == "<end>" and (hit.start, hit.end) == (1, 6)
    assert m.held == b"<end>tail"  # the match and what follows it, never returned


def test_held_suffix_released_when_it_stops_being_a_prefix():
    """§4.6: held bytes are emitted as soon as no stop can start with them any more."""
    m = StopMatcher(["abc"])
    assert m.push(b"xab") == (b"x", None)
    assert m.push(b"x") == (b"abx", None)
    assert m.state == "SCANNING" and m.held == b""


def test_hold_back_is_the_longest_prefix_suffix_not_a_fixed_window():
    """§4.6: hold exactly the longest suffix that is a proper prefix, not a max-len-1 window."""
    m = StopMatcher(["abcdefgh"])
    assert m.push(b"zzzzzzzzab") == (b"zzzzzzzz", None)  # a fixed window would keep 7 bytes
    assert m.held == b"ab"


def test_stop_ending_inside_a_multibyte_character():
    """§4.6: stops match UTF-8 bytes, so a stop may end halfway through "é" (0xC3 0xA9)."""
    m = StopMatcher([b"a\xc3"])
    assert m.push(b"xa") == (b"x", None)
    out, hit = m.push("é!".encode())
    assert out == b"" and hit.stop == b"a\xc3" and (hit.start, hit.end) == (1, 3)


def test_str_stop_matches_a_character_split_across_pushes():
    """§4.6: a str stop is matched on its UTF-8 bytes even when a token splits the character."""
    m = StopMatcher(["é"])
    assert m.push(b"ok\xc3") == (b"ok", None)
    assert m.held == b"\xc3"
    out, hit = m.push(b"\xa9")
    assert out == b"" and hit.stop == "é"


def test_cjk_and_emoji_stops_split_across_tokens():
    """§4.6: CJK and emoji stops (3 and 4 UTF-8 bytes) split mid-character across tokens."""
    text = "你好，世界😀再见".encode()
    stops = ["世界😀", "再见"]
    chunks = [text[i : i + 2] for i in range(0, len(text), 2)]
    outs, hit = run_chunks(StopMatcher(stops), chunks)
    assert b"".join(outs) == "你好，".encode()
    assert hit.stop == "世界😀" and hit.index == 0


def test_earliest_end_beats_configuration_order():
    """§4.6 rule v1: "abcd" is configured first, but "bc" ends earlier in "xabcd", so it wins."""
    out, hit = StopMatcher(["abcd", "bc"]).push(b"xabcd")
    assert out == b"xa" and (hit.stop, hit.index, hit.start, hit.end) == ("bc", 1, 2, 4)


def test_same_end_longest_wins():
    """§4.6 rule v1: "xbc" and "bc" end at the same byte; the longer one wins."""
    out, hit = StopMatcher(["bc", "xbc"]).push(b"axbcd")
    assert out == b"a" and (hit.stop, hit.index) == ("xbc", 1)


def test_equal_matches_configuration_order_wins():
    """§4.6 rule v1: the same bytes configured twice (str and bytes): the first configured wins."""
    out, hit = StopMatcher([b"bc", "bc"]).push(b"abc")
    assert out == b"a" and hit.stop == b"bc" and hit.index == 0


def test_stop_does_not_span_the_prompt_boundary():
    """§4.6 (DECISIONS: stops match output only): prompt "...X" + output "Y" never fires "XY"."""
    m = StopMatcher(["XY"])  # the prompt ended with "X"; the matcher only ever sees output bytes
    assert m.push(b"Y and more") == (b"Y and more", None)
    assert m.flush() == b"" and m.hit is None


def test_push_after_hit_is_illegal_and_changes_nothing():
    """§4.3: the first hit is absorbing; a later push or flush is rejected by the table."""
    m = StopMatcher(["BCD"])
    m.push(b"ABCDE")
    before = (m.state, m.held, m.hit)
    with pytest.raises(IllegalTransition, match="'hold'|'clear'"):
        m.push(b"more")
    with pytest.raises(IllegalTransition, match="'hit'"):
        m.push(b"BCD")
    with pytest.raises(IllegalTransition, match="'flush'"):
        m.flush()
    assert (m.state, m.held, m.hit) == before == ("HIT", b"BCDE", before[2])


def test_flush_returns_the_held_suffix_and_closes():
    """§4.3 flush_safe_suffix: at the end without a hit the held bytes are emitted."""
    m = StopMatcher(["BCD"])
    assert m.push(b"ABC") == (b"A", None)
    assert m.flush() == b"BC"
    assert m.state == "FLUSHED" and m.held == b""
    with pytest.raises(IllegalTransition):
        m.push(b"x")


def test_discard_without_a_hit_is_illegal():
    """§4.3: discard_from_first_match needs a match; the table rejects it before one."""
    m = StopMatcher(["x"])
    with pytest.raises(IllegalTransition, match="discard"):
        m.discard_from_first_match()
    assert m.state == "SCANNING"


def test_no_stops_emits_everything():
    """§4.6: an empty stop set never holds and never hits."""
    m = StopMatcher([])
    assert m.push(b"abc") == (b"abc", None) and m.flush() == b""


def test_push_accepts_bytes_like_and_refuses_str():
    """§4.6: the matcher works on bytes; a str chunk is a clear TypeError."""
    m = StopMatcher(["z"])
    assert m.push(bytearray(b"ab")) == (b"ab", None)
    assert m.push(memoryview(b"cd")) == (b"cd", None)
    with pytest.raises(TypeError, match=re.escape("push() takes bytes, got str: 'ef'")):
        m.push("ef")


def test_stops_using_all_256_byte_values():
    """§4.6: a stop set that uses every byte value (no spare byte class) still obeys the oracle."""
    stops = [bytes([b, (b * 7 + 1) % 256]) for b in range(256)]
    text = bytes(range(256)) + bytes([5, 36, 255, 0])
    check_against_oracle(stops, text, [3, 100, 258])
    check_against_oracle(stops[:-1], bytes([255, 0, 2]), [1])


def test_automaton_is_built_once_per_stop_set():
    """§4.6: one automaton per stop set, shared by every matcher of that set."""
    assert StopMatcher(["a", "bc"])._auto is StopMatcher(["a", "bc"])._auto


@pytest.mark.parametrize(
    ("stops", "kwargs", "exc", "message"),
    [
        ("stop", {}, TypeError, "stops must be a list of str or bytes, not a bare str; pass ['stop'] for a single stop"),
        (b"stop", {}, TypeError, "stops must be a list of str or bytes, not a bare bytes; pass [b'stop'] for a single stop"),
        ({"a"}, {}, TypeError, "stops must be a list or tuple of str or bytes, got set"),
        (["a", ""], {}, ValueError, "stops[1] is empty: a stop string needs at least one byte"),
        (["a", b""], {}, ValueError, "stops[1] is empty: a stop string needs at least one byte"),
        (["a", 5], {}, TypeError, "stops[1] must be str or bytes, got int: 5"),
        ([bytearray(b"a")], {}, TypeError, "stops[0] must be str or bytes, got bytearray: bytearray(b'a')"),
        (["a", "b", "c"], {"max_stops": 2}, ValueError, "stops: 3 stops given, more than max_stops=2"),
        (["a"], {"max_stops": 0}, ValueError, "max_stops must be a positive int, got 0"),
        (["abc", "é"], {"max_stop_bytes": 4}, ValueError, "stops: 5 bytes in all, more than max_stop_bytes=4"),
        (["a"], {"max_stop_bytes": True}, ValueError, "max_stop_bytes must be a positive int, got True"),
    ],
)
def test_bad_stop_configuration_names_the_offending_value(stops, kwargs, exc, message):
    """§4.6: bad stop sets are refused with an error naming the value and its index."""
    with pytest.raises(exc, match=re.escape(message)) as info:
        StopMatcher(stops, **kwargs)
    assert str(info.value) == message


# -- Hypothesis properties against the oracle ----------------------------------------------------


def chunked(text: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [b""]


def check_against_oracle(stops: list[bytes], text: bytes, cuts: list[int]) -> None:
    m = StopMatcher(stops)
    expected = oracle_hit(stops, text)
    seen = b""
    outs: list[bytes] = []
    hit = None
    for chunk in chunked(text, cuts):
        out, hit = m.push(chunk)
        seen += chunk
        outs.append(out)
        if hit is not None:
            break
        # (3) hold-back is minimal and sufficient after every push
        assert m.held == oracle_held(stops, seen)
        assert b"".join(outs) + m.held == seen
    emitted = b"".join(outs)
    if expected is None:
        assert hit is None
        # (1) without a hit everything comes out, the held tail at flush
        assert emitted + m.flush() == text
    else:
        index, start, end = expected
        # (4) the winner is the oracle's, positions included
        assert (hit.index, hit.start, hit.end) == (index, start, end)
        assert hit.stop == stops[index] and hit.rule_version == RULE
        # (1) exactly the bytes before the winning match are emitted
        assert emitted == text[:start]
        # (2) the stop bytes never appear in the emitted output
        assert all(s not in emitted for s in stops)
        with pytest.raises(IllegalTransition):
            m.push(b"a")


def abc(raw: bytes) -> bytes:
    """Fold random bytes onto the alphabet "abc" so that stops overlap and recur often."""
    return bytes(97 + x % 3 for x in raw)


small_stops = st.lists(st.binary(min_size=1, max_size=4).map(abc), max_size=5)
small_text = st.binary(max_size=40).map(abc)
cuts = st.lists(st.integers(min_value=0, max_value=64), max_size=12)


@settings(deadline=None, max_examples=400)
@given(stops=small_stops, text=small_text, cuts=cuts)
def test_matches_brute_force_oracle_over_random_chunkings(stops, text, cuts):
    """§4.6: for any stop set and chunking, output, hold-back and winner equal the naive oracle."""
    check_against_oracle(stops, text, cuts)


UTF8_CHARS = "aé€😀你"
utf8_text = st.text(alphabet=UTF8_CHARS, max_size=12).map(str.encode)


def byte_slice(chars: str, cut_front: int, cut_back: int) -> bytes:
    """A non-empty slice of the UTF-8 of `chars`, usually starting or ending mid-character."""
    raw = chars.encode()
    front = cut_front % len(raw)
    return raw[front : max(front + 1, len(raw) - cut_back)]


utf8_stops = st.lists(
    st.builds(
        byte_slice,
        st.text(alphabet=UTF8_CHARS, min_size=1, max_size=3),
        st.integers(0, 3),
        st.integers(0, 3),
    ),
    max_size=4,
)


@settings(deadline=None, max_examples=300)
@given(stops=utf8_stops, text=utf8_text, cuts=cuts)
def test_multibyte_stops_match_brute_force_oracle(stops, text, cuts):
    """§4.6: stops that start or end inside UTF-8 characters obey the same oracle."""
    check_against_oracle(stops, text, cuts)


# -- token-id stop sequences ---------------------------------------------------------------------


def test_token_sequence_spanning_tokens_hits_with_token_positions():
    """§4.6: a stop token sequence is matched on the id stream across several selections."""
    m = TokenStopMatcher([[7, 8, 9]])
    assert [m.push(t) for t in (1, 7, 8)] == [None, None, None]
    assert m.held == (7, 8) and m.state == "HOLDING"
    hit = m.push(9)
    assert hit == StopHit((7, 8, 9), 0, 1, 4, RULE, StopKind.TOKEN_IDS)
    assert hit.kind == "token_ids"


def test_token_rule_earliest_end_then_longest_then_order():
    """§4.6 rule v1 on token ids: earliest end beats order; at one end the longest; then order."""
    m = TokenStopMatcher([[1, 2, 3, 4], [2, 3]])
    assert [m.push(t) for t in (1, 2)] == [None, None]
    assert m.push(3).stop == (2, 3)
    m = TokenStopMatcher([[2, 3], [1, 2, 3]])
    m.push(1), m.push(2)
    assert m.push(3).index == 1
    m = TokenStopMatcher([[5], (5,)])
    assert m.push(5).index == 0


def test_token_push_after_hit_is_illegal():
    """§4.3: the first token-sequence hit is absorbing; the table rejects later pushes."""
    m = TokenStopMatcher([[4]])
    m.push(4)
    with pytest.raises(IllegalTransition):
        m.push(1)
    assert m.state == "HIT"
    m.discard_from_first_match()
    assert m.state == "DISCARDED"


def test_token_flush_returns_partial_match():
    """§4.3: at the end without a hit, flush returns (and forgets) the partial match."""
    m = TokenStopMatcher([[1, 2, 3]])
    m.push(1), m.push(2)
    assert m.flush() == (1, 2) and m.state == "FLUSHED" and m.held == ()


@pytest.mark.parametrize(
    ("sequences", "exc", "message"),
    [
        ([1, 2], TypeError, "sequences[0] must be a list of token ids, got int: 1"),
        ("ab", TypeError, "sequences must be a list of token-id sequences, not a bare str; pass ['ab'] for a single stop"),
        ([[1], []], ValueError, "sequences[1] is empty: a stop sequence needs at least one token id"),
        ([[1, "2"]], TypeError, "sequences[0][1] must be an int token id, got str: '2'"),
        ([[True]], TypeError, "sequences[0][0] must be an int token id, got bool: True"),
        ([[3, -1]], ValueError, "sequences[0][1] is a negative token id: -1"),
        ([b"\x01"], TypeError, "sequences[0] must be a list of token ids, got bytes: b'\\x01'"),
    ],
)
def test_bad_token_sequences_name_the_offending_value(sequences, exc, message):
    """§4.6: bad stop token sequences are refused with an error naming the value and its index."""
    with pytest.raises(exc, match=re.escape(message)):
        TokenStopMatcher(sequences)


def test_token_ids_may_be_numpy_integers():
    """§4.6: ids coming from an array (numpy integers) are accepted like ints."""
    import numpy as np

    m = TokenStopMatcher([[np.int64(3), np.int16(4)]])
    assert m.push(np.int64(3)) is None
    assert m.push(np.int32(4)).stop == (3, 4)


def test_token_push_refuses_non_int_and_negative_ids():
    """§4.6: a pushed id must be a non-negative int."""
    m = TokenStopMatcher([[1]])
    message = "push(): token_id must be an int token id, got str: 'x'"
    with pytest.raises(TypeError, match=re.escape(message)):
        m.push("x")
    with pytest.raises(ValueError, match=re.escape("push(): token_id is a negative token id: -3")):
        m.push(-3)
    assert m.state == "SCANNING"


@settings(deadline=None, max_examples=300)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4).map(tuple), max_size=5),
    ids=st.lists(st.integers(0, 3), max_size=30),
)
def test_token_matcher_matches_brute_force_oracle(seqs, ids):
    """§4.6: the token-sequence winner and its positions equal the naive oracle's."""
    m = TokenStopMatcher(seqs)
    hit = None
    for n, t in enumerate(ids, 1):
        hit = m.push(t)
        if hit is not None:
            break
        assert m.held == oracle_held(seqs, tuple(ids[:n]))
    expected = oracle_hit(seqs, tuple(ids))
    if expected is None:
        assert hit is None
    else:
        assert (hit.index, hit.start, hit.end) == expected


def test_a_stop_set_seen_before_is_not_checked_again_but_a_bad_one_always_is():
    """Building a matcher for a known stop set reuses its checked bytes; a bad entry is
    refused with its index every time, hashable or not."""
    from decodespec.runtime.stop import _encode_cached

    stops = tuple(f"stop{i}" for i in range(64))
    StopMatcher(stops)
    hits = _encode_cached.cache_info().hits
    StopMatcher(list(stops))
    assert _encode_cached.cache_info().hits == hits + 1
    for bad, message in ((("a", 3), r"stops\[1\] must be str or bytes, got int"),
                         (["a", ["x"]], r"stops\[1\] must be str or bytes, got list")):
        for _ in range(2):
            with pytest.raises(TypeError, match=message):
                StopMatcher(bad)
