"""Windows into batches: the padding bound, the plan's guarantees, real text."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embgeom_ray.inputs.demo_corpus import python_docs_documents, python_docs_topics
from embgeom_ray.inputs.windows import (
    MAX_PADDING,
    MIN_BATCH_POSITIONS,
    POOL_BATCHES,
    Window,
    make_batches,
    plan_batches,
    pools,
    tokenize_windows,
)


def padding(lengths: list[int], plan: list[list[int]]) -> int:
    """Padded positions of a plan: Σ rows × longest − real, computed from scratch."""
    return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in plan)


def test_plan_by_hand():
    # batch_tokens 12: rows per batch 6 (length 2), 4 (length 3), 3 (length 4), 2 (length 6)
    lengths = [3, 3, 3, 3, 3, 4, 4, 6, 2]
    exact = plan_batches(lengths, batch_tokens=12, max_padding=0.0, min_positions=0)
    assert exact == [
        [8],  # width 2
        [0, 1, 2, 3],  # a full batch of length 3 (4 × 3 = 12)
        [4],  # length 3's leftover
        [5, 6],
        [7],
    ]
    # budget 0.1 × 31 = 3.1 positions. Leftover merges on offer: {8}+{4} (2 rows × 3, cost 1),
    # {4}+{5, 6} (3 rows × 4 = 12, cost 1); {5, 6}+{7} does not fit (3 × 6 > 12). The tie goes
    # to the narrower pair; after it {8, 4}+{5, 6} no longer fits (4 × 4 > 12).
    plan = plan_batches(lengths, batch_tokens=12, max_padding=0.1, min_positions=0)
    assert plan == [[0, 1, 2, 3], [8, 4], [5, 6], [7]]
    assert padding(lengths, plan) == 1
    # a budget below one position allows no merge at all
    assert plan_batches(lengths, batch_tokens=12, max_padding=0.03, min_positions=0) == exact
    # then batches under 7 positions merge into the cheaper neighbour past the budget: {8}
    # (2 positions) into {4} (cost 1) -> {8, 4} (6 positions) into {5, 6} does not fit;
    # {8, 4} is left alone; {7} (6 positions): {5, 6} into it would cost 2 × 2 and not fit
    plan = plan_batches(lengths, batch_tokens=12, max_padding=0.0, min_positions=7)
    assert plan == [[0, 1, 2, 3], [8, 4], [5, 6], [7]]
    # a single small batch among wider ones: {0} (4 positions) joins {1, 2} (cost 1 × 1)
    assert plan_batches([4, 5, 5], batch_tokens=64, max_padding=0.0, min_positions=8) == [[0, 1, 2]]
    # unless that costs min_positions or more
    assert plan_batches([1, 9, 9], batch_tokens=64, max_padding=0.0, min_positions=8) == [
        [0],
        [1, 2],
    ]


def test_plan_single_window_longer_than_a_batch_and_empty_input():
    assert plan_batches([50, 3, 50], batch_tokens=16, max_padding=0.5) == [[1], [0], [2]]
    assert plan_batches([], batch_tokens=16) == []
    with pytest.raises(ValueError, match="max_padding"):
        plan_batches([3], batch_tokens=16, max_padding=-0.1)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), max_size=400),
    batch_tokens=st.integers(16, 700),
    max_padding=st.sampled_from([0.0, 0.01, 0.02, 0.05, 0.3, 10.0]),
    min_positions=st.sampled_from([0, 16, 64]),
)
def test_plan_guarantees(lengths, batch_tokens, max_padding, min_positions):
    plan = plan_batches(
        lengths, batch_tokens=batch_tokens, max_padding=max_padding, min_positions=min_positions
    )
    # a partition of the windows
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for b in plan:
        assert b == sorted(b, key=lambda i: (lengths[i], i))
        width = lengths[b[-1]]
        assert len(b) * width <= batch_tokens or len(b) == 1
        if max_padding == 0 and min_positions == 0:
            assert {lengths[i] for i in b} == {width}
    # the padding budget, for the whole pool; small batches' merges add < min_positions each
    extra = min_positions * (len(set(lengths)) - 1) if lengths else 0
    assert padding(lengths, plan) <= max_padding * sum(lengths) + max(extra, 0) + 1e-9
    if min_positions == 0:
        assert padding(lengths, plan) <= max_padding * sum(lengths) + 1e-9
    # ordered by width, then first index; deterministic
    keys = [(lengths[b[-1]], b[0]) for b in plan]
    assert keys == sorted(keys)
    assert plan == plan_batches(
        lengths, batch_tokens=batch_tokens, max_padding=max_padding, min_positions=min_positions
    )
    # full batches of one length, plus at most one more batch per distinct length
    full = sum(c // max(1, batch_tokens // n) for n, c in Counter(lengths).items())
    assert len(plan) <= full + len(set(lengths))


def test_pools_regroup_in_order_and_bound_their_size():
    def w(doc: int, n: int) -> Window:
        return Window(doc, 0, [1] * n)

    chunks = [[w(0, 5), w(1, 5)], [w(2, 4)], [w(3, 30)], [w(4, 1), w(5, 2)], [w(6, 3)]]
    got = list(pools(iter(chunks), pool_tokens=12))
    assert [[x.doc_id for x in p] for p in got] == [[0, 1, 2], [3], [4, 5, 6]]
    # a pool closes at the first chunk that takes it to pool_tokens: < pool_tokens + 1 chunk
    assert [sum(len(x.input_ids) for x in p) for p in got] == [14, 30, 6]
    assert list(pools(iter([]), 12)) == []


def test_make_batches_rows_are_the_windows(minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    texts = ["word " * n for n in (1, 3, 3, 7, 20, 2, 5, 40)] + ["", "[SEP] [CLS]"]
    windows = tokenize_windows(tok, list(range(len(texts))), texts, max_length=16)
    batches = list(
        make_batches(
            windows, batch_tokens=48, pad_id=0, special_ids=tok.all_special_ids, keep_special=False
        )
    )
    specials = set(tok.all_special_ids)
    seen = {}
    for b in batches:
        assert b.input_ids.shape[0] * b.input_ids.shape[1] <= 48
        for r in range(b.input_ids.shape[0]):
            key = (int(b.doc_ids[r]), int(b.window_index[r]))
            seen[key] = b.input_ids[r][b.attention_mask[r].bool()].tolist()
            assert not b.input_ids[r][~b.attention_mask[r].bool()].any()  # right-padded with 0
            assert b.keep[r].tolist() == [
                bool(m) and int(i) not in specials
                for i, m in zip(b.input_ids[r], b.attention_mask[r], strict=True)
            ]
    # every window with a counted token, exactly once and unchanged; the empty document has no
    # window, and the one made only of special tokens is never run
    counted = {(w.doc_id, w.index): w.input_ids for w in windows if set(w.input_ids) - specials}
    assert seen == counted
    assert {8, 9} & {d for d, _ in seen} == set()
    assert 8 not in {w.doc_id for w in windows}
    # keeping special tokens keeps the window of special tokens alone
    kept = make_batches(
        windows, batch_tokens=48, pad_id=0, special_ids=tok.all_special_ids, keep_special=True
    )
    assert sum(int(b.input_ids.shape[0]) for b in kept) == len(windows)
    assert [w.input_ids for w in windows if w.doc_id == 9] == [[101, 102, 101, 102]]


def extractor_padding(tokenizer, texts: list[str], *, batch_tokens=8192, docs_per_chunk=512):
    """(padded positions, real positions, batches, pools, smallest batch's positions)."""
    chunks = (
        tokenize_windows(
            tokenizer,
            list(range(s, s + len(texts[s : s + docs_per_chunk]))),
            texts[s : s + docs_per_chunk],
            max_length=128,
        )
        for s in range(0, len(texts), docs_per_chunk)
    )
    padded = real = n = n_pools = 0
    smallest = batch_tokens
    for pool in pools(chunks, POOL_BATCHES * batch_tokens):
        n_pools += 1
        for b in make_batches(
            pool,
            batch_tokens=batch_tokens,
            pad_id=tokenizer.pad_token_id,
            special_ids=tokenizer.all_special_ids,
            keep_special=False,
        ):
            padded += b.input_ids.numel()
            real += b.num_positions
            n += 1
            smallest = min(smallest, b.input_ids.numel())
    return padded, real, n, n_pools, smallest


def test_padding_on_real_text(minilm_dir):
    """The Language Reference's prose, as whole topics (windows mostly full: 79 documents) and
    as paragraphs (1,474 documents of 8 to ~230 tokens, like a corpus of short texts, where the
    earlier greedy packing ran 1.25 positions per real one)."""
    from transformers import AutoTokenizer

    from embgeom_ray.inputs.demo_corpus import topic_paragraphs

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    from pydoc_data.topics import topics

    paragraphs = [p for name in sorted(topics) for p in topic_paragraphs(topics[name])]
    assert len(python_docs_topics()) < 100 < len(paragraphs)
    for texts in (python_docs_documents(), paragraphs):
        padded, real, n, n_pools, smallest = extractor_padding(tok, texts)
        assert real <= padded <= (1 + MAX_PADDING) * real
        assert smallest >= MIN_BATCH_POSITIONS  # and no batch too small to run well
        assert MAX_PADDING <= 0.05
        # at most one batch more than full ones per window length (1..128) and pool
        assert n_pools == 1
        assert n <= -(-padded // 8192) + 128


def test_padding_bound_is_the_option(minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    texts = python_docs_documents()
    windows = tokenize_windows(tok, list(range(len(texts))), texts, max_length=64)
    for max_padding in (0.0, 0.005, 0.1):
        batches = list(
            make_batches(
                windows,
                batch_tokens=1024,
                pad_id=0,
                special_ids=tok.all_special_ids,
                keep_special=False,
                max_padding=max_padding,
                min_positions=0,
            )
        )
        padded = sum(b.input_ids.numel() for b in batches)
        real = sum(b.num_positions for b in batches)
        assert real == sum(len(w.input_ids) for w in windows)
        assert padded <= (1 + max_padding) * real
        if max_padding == 0:
            assert all(bool(b.attention_mask.all()) for b in batches)
    # rows carry their own ids: the same windows, whatever the batching
    rows = {
        (int(d), int(k)): ids[m.bool()].tolist()
        for b in batches
        for d, k, ids, m in zip(
            b.doc_ids, b.window_index, b.input_ids, b.attention_mask, strict=True
        )
    }
    assert rows == {(w.doc_id, w.index): w.input_ids for w in windows}


@pytest.fixture(scope="module")
def four_tokenizers(minilm_dir, tmp_path_factory):
    """BERT ([CLS] … [SEP]), GPT-2 (none), Llama (BOS only), RoBERTa (<s> … </s>)."""
    from transformers import AutoTokenizer

    from tests.tiny_models import make_tiny_gpt2, make_tiny_llama, make_tiny_roberta

    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {
        "bert": minilm_dir,
        "gpt2": make_tiny_gpt2(root / "gpt2"),
        "llama": make_tiny_llama(root / "llama"),
        "roberta": make_tiny_roberta(root / "roberta"),
    }
    return {name: AutoTokenizer.from_pretrained(d) for name, d in dirs.items()}


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "roberta"])
def test_windows_partition_a_long_document_as_the_overflow_does(four_tokenizers, name):
    """Every content token of real prose lands in exactly one window, in order, each window
    wrapped in the tokenizer's own special tokens; and the windows are the ones the fast
    tokenizer's overflow gives where it works (transformers 5.17.0's lost 85% of them)."""
    from embgeom_ray.inputs.windows import special_tokens_around

    tok = four_tokenizers[name]
    texts = [*python_docs_documents()[:6], "", "short"]
    before, after = special_tokens_around(tok)
    assert (len(before), len(after)) == {
        "bert": (1, 1), "gpt2": (0, 0), "llama": (1, 0), "roberta": (1, 1)
    }[name]  # fmt: skip
    windows = tokenize_windows(tok, list(range(10, 18)), texts, max_length=64)
    for doc, text in zip(range(10, 18), texts, strict=True):
        mine = [w for w in windows if w.doc_id == doc]
        assert [w.index for w in mine] == list(range(len(mine)))
        assert all(len(w.input_ids) <= 64 for w in mine)
        assert all(len(w.input_ids) == 64 for w in mine[:-1])  # all full but the last
        assert bool(mine) == bool(text)  # the empty text: no window
        content = [i for w in mine for i in w.input_ids[len(before) : len(w.input_ids) - len(after)]]
        assert content == tok(text, add_special_tokens=False)["input_ids"]
        assert all(w.input_ids[: len(before)] == before for w in mine)
        assert all(w.input_ids[len(w.input_ids) - len(after) :] == after for w in mine)
    assert sum(len(w.input_ids) for w in windows) > 6 * 64  # long documents: many windows
    overflow = tok(
        texts, add_special_tokens=True, truncation=True, max_length=64,
        return_overflowing_tokens=True, stride=0,
    )  # fmt: skip
    import transformers

    if transformers.__version__ != "5.17.0":  # elsewhere the overflow works: the same windows,
        # but for the empty text's window of special tokens alone (it has none)
        of = list(zip(overflow["overflow_to_sample_mapping"], overflow["input_ids"], strict=True))
        assert [list(x) for d, x in of if d == 6] == [before + after]
        others = [list(x) for d, x in of if d != 6]
        assert [w.input_ids for w in windows] == others


def test_windows_refuse_a_length_with_no_room_for_a_token(minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    with pytest.raises(ValueError, match="max_length 2 leaves no room"):
        tokenize_windows(tok, [0], ["some text"], max_length=2)
    assert [w.input_ids for w in tokenize_windows(tok, [0], ["some text"], max_length=3)] == [
        [101, 2070, 102],
        [101, 3793, 102],
    ]


def test_windows_refuse_a_tokenizer_whose_special_tokens_cannot_be_found():
    """The probe's special tokens must agree with the tokenizer's own count, and surround it."""
    from embgeom_ray.inputs.windows import special_tokens_around

    class Probe:
        def __init__(self, wrapped: list[int], count: int) -> None:
            self.wrapped, self.count = wrapped, count

        def __call__(self, text, add_special_tokens=True, **_):
            return {"input_ids": self.wrapped if add_special_tokens else [7]}

        def num_special_tokens_to_add(self, pair=False):
            return self.count

    assert special_tokens_around(Probe([1, 7, 2], 2)) == ([1], [2])
    with pytest.raises(ValueError, match="adds 3 special tokens to a text, but 'a' gains 2"):
        special_tokens_around(Probe([1, 7, 2], 3))
    with pytest.raises(ValueError, match="do not surround a text's own tokens"):
        special_tokens_around(Probe([1, 8, 2], 2))
