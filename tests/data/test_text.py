"""Training data from text (data/text.py): documents packed into blocks, records checked and
counted by reason, loading through `datasets`, and the block sampler's order, resume and shards."""

from __future__ import annotations

import pytest

from specheads.data.text import BlockSampler, DataError, build_blocks, extract_documents, load_records, pack_blocks

from test_training import make_tokenizer, write_jsonl


def test_packing_joins_documents_with_eos_and_masks_padding():
    ids, mask = pack_blocks([[5, 6, 7], [8, 9]], seq_len=4, eos_id=2, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 2], [8, 9, 2, 0]]
    assert mask.tolist() == [[True] * 4, [True, True, True, False]]


def test_text_records_are_tokenized_with_the_tokenizer(tmp_path):
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    blocks = build_blocks("mem", [{"text": "def f(x):"}, {"text": "print('hi')"}], "text", 8, str(tokenizer_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = (tokenizer("def f(x):", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                + tokenizer("print('hi')", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    assert blocks.input_ids.flatten()[blocks.loss_mask.flatten()].tolist() == expected
    assert blocks.report.num_tokens == len(expected)


def test_unusable_records_are_counted_by_reason():
    records = [{"text": "a"}, {"content": "b"}, {"text": ""}, {"text": 3}, {"input_ids": [1, 2]},
               {"input_ids": ["x"]}, {"content": "c"}]
    documents, skipped = extract_documents(records, "text")
    assert documents == ["a", [1, 2]]
    assert skipped == {"missing field 'text'": 2, "empty 'text'": 1, "'text' is not a string (int)": 1,
                       "input_ids is not a list of token ids": 1}
    blocks = build_blocks("mem", records[4:5], "text", 4, None, eos_token_id=2)
    assert "1/1 records used" in blocks.report.summary()


def test_empty_sources_fail_naming_the_source(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert load_records(str(empty)) == []
    with pytest.raises(DataError, match="empty.jsonl' is empty"):
        build_blocks(str(empty), [], "text", 8, None)
    with pytest.raises(DataError, match=r"is empty.*missing field 'text': 2"):
        build_blocks("src", [{"body": "x"}, {"body": "y"}], "text", 8, None)
    with pytest.raises(DataError, match="does not exist"):
        load_records(str(tmp_path / "missing.jsonl"))


def test_jsonl_with_mixed_records_loads_through_datasets(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a b"}, {"title": "no text"}, {"text": "c"}])
    documents, skipped = extract_documents(load_records(str(path)), "text")
    assert documents == ["a b", "c"]
    assert skipped == {"missing field 'text'": 1}


def test_token_ids_beyond_the_vocab_are_rejected():
    with pytest.raises(DataError, match="token id 300"):
        build_blocks("src", [{"input_ids": [1, 300]}], "text", 4, None, eos_token_id=2, vocab_size=256)


# ---------------------------------------------------------------------------- sampler

def drain(sampler: BlockSampler, steps: int) -> list[int]:
    return [i for _ in range(steps) for i in sampler.next_indices()]


def test_sampler_is_deterministic_and_covers_each_epoch():
    first = drain(BlockSampler(10, 5, seed=3), 4)
    assert first == drain(BlockSampler(10, 5, seed=3), 4)
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:]) == list(range(10))
    assert first != drain(BlockSampler(10, 5, seed=4), 4)


def test_sampler_resumes_at_the_exact_position():
    sampler = BlockSampler(7, 3, seed=0)
    full = drain(sampler, 6)
    resumed = BlockSampler(7, 3, seed=0)
    drain(resumed, 2)
    state = resumed.state_dict()
    fresh = BlockSampler(7, 3, seed=0)
    fresh.load_state_dict(state)
    assert drain(fresh, 4) == full[6:]
    with pytest.raises(DataError, match="data or recipe changed"):
        BlockSampler(8, 3, seed=0).load_state_dict(state)


def test_sampler_shards_the_single_rank_stream_across_ranks():
    single = drain(BlockSampler(20, 2, seed=1, world_size=1), 10)  # 20 blocks
    ranks = [BlockSampler(20, 2, seed=1, rank=r, world_size=2) for r in range(2)]
    interleaved = []
    for _ in range(5):
        for sampler in ranks:
            interleaved.extend(sampler.next_indices())
    assert interleaved == single
    assert ranks[0].position == ranks[1].position == 20
    per_rank = [set(interleaved[i:i + 2]) for i in range(0, 20, 2)]
    assert set().union(*per_rank[0::2]).isdisjoint(set().union(*per_rank[1::2]))


# ---------------------------------------------------------------------------- training runs
