"""TreeStaticCache: tree verify + in-place commit equals DynamicCache + commit_path, equals a
no-cache forward, never reallocates, and its static-shape mode gives the same logits."""

from __future__ import annotations

import pytest
import torch

from specheads.heads.target.adapter import TargetAdapter
from dynamic_cache_reference import commit_path, new_cache
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.decode.trees import DraftTree

# Node order: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0).
TREE = DraftTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
# Accepted paths per step: a non-prefix path, the full top-1 chain, the root alone, a side branch.
PATHS = [[0, 2, 5], [0, 1, 3, 6], [0], [0, 1, 4]]
PROMPT_LEN = 9
ATOL = 1e-4  # fp32; logits of the 0.3-std tiny models are O(10)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request, tiny_llama_dir, tiny_qwen2_dir) -> TargetAdapter:
    directory = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    return TargetAdapter.from_pretrained(directory)


def _random_tokens(num_tokens: int, seed: int, vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(seed))


def _decode_mask(prefix_len: int) -> torch.Tensor:
    """serving.decode.steps's verify mask [1, 1, T, S+T]."""
    num_nodes = TREE.num_nodes
    mask = torch.ones(1, 1, num_nodes, prefix_len + num_nodes, dtype=torch.bool)
    mask[0, 0, :, prefix_len:] = TREE.tree_mask
    return mask


@torch.inference_mode()
def _run_dynamic(target: TargetAdapter, prompt_1P: torch.Tensor, trees: list[torch.Tensor]):
    """The reference: DynamicCache + commit_path. -> prefill logits [P, V], verify logits [T, V] per step."""
    cache = new_cache(target.config)
    prefill_logits = target(prompt_1P, [], past_key_values=cache, use_cache=True).logits[0]
    prefix_len, step_logits = prompt_1P.shape[1], []
    for tree_tokens_1T, path in zip(trees, PATHS):
        out = target(tree_tokens_1T, [], attention_mask=_decode_mask(prefix_len),
                     position_ids=(TREE.position_offsets + prefix_len)[None], past_key_values=cache, use_cache=True)
        step_logits.append(out.logits[0])
        commit_path(cache, prefix_len, path)
        prefix_len += len(path)
        assert cache.get_seq_length() == prefix_len
    return prefill_logits, step_logits


@torch.inference_mode()
def _run_static(target: TargetAdapter, prompt_1P: torch.Tensor, trees: list[torch.Tensor], static_shape: bool,
                max_cache_len: int = 64):
    """The same steps on a TreeStaticCache. -> prefill logits, verify logits per step, buffer pointers per step."""
    cache = TreeStaticCache(target.config, max_cache_len=max_cache_len, static_shape=static_shape)
    prefill_logits = target(prompt_1P, [], past_key_values=cache, use_cache=True).logits[0]
    assert cache.get_seq_length() == 0 and cache.num_pending == prompt_1P.shape[1]
    cache.commit()
    pointers = [[(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]]
    prefix_len, step_logits = prompt_1P.shape[1], []
    for tree_tokens_1T, path in zip(trees, PATHS):
        mask = cache.attention_mask(TREE.tree_mask)
        if not static_shape:
            assert torch.equal(mask, _decode_mask(prefix_len))
        else:
            assert mask.shape == (1, 1, TREE.num_nodes, max_cache_len)
        position_ids = cache.position_ids(TREE.position_offsets)
        assert torch.equal(position_ids, (TREE.position_offsets + prefix_len)[None])
        out = target(tree_tokens_1T, [], attention_mask=mask, position_ids=position_ids,
                     past_key_values=cache, use_cache=True)
        step_logits.append(out.logits[0])
        # Before commit, the tree entries are pending: get_seq_length is the committed length.
        assert cache.get_seq_length() == prefix_len and cache.num_pending == TREE.num_nodes
        cache.commit(torch.tensor(path))
        prefix_len += len(path)
        assert cache.get_seq_length() == prefix_len and cache.seq_lens == [prefix_len]
        pointers.append([(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers])
    return prefill_logits, step_logits, pointers


def _verify_tree(target: TargetAdapter, cache: TreeStaticCache, tree_tokens_BT: torch.Tensor) -> torch.Tensor:
    """One tree forward with the cache's own mask and positions. -> logits [B, T, V]."""
    return target(tree_tokens_BT, [], attention_mask=cache.attention_mask(TREE.tree_mask),
                  position_ids=cache.position_ids(TREE.position_offsets), past_key_values=cache, use_cache=True).logits


def _trees(target: TargetAdapter) -> list[torch.Tensor]:
    return [_random_tokens(TREE.num_nodes, seed, target.vocab_size) for seed in range(1, len(PATHS) + 1)]


@pytest.mark.parametrize("static_shape", [False, True], ids=["dynamic-shape", "static-shape"])
def test_tree_steps_match_dynamic_cache_and_no_cache(target, static_shape):
    prompt_1P, trees = _random_tokens(PROMPT_LEN, 0, target.vocab_size), _trees(target)
    ref_prefill, ref_steps = _run_dynamic(target, prompt_1P, trees)
    prefill, steps, _ = _run_static(target, prompt_1P, trees, static_shape)
    torch.testing.assert_close(prefill, ref_prefill, atol=ATOL, rtol=1e-5)
    for logits, ref_logits in zip(steps, ref_steps):
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-5)

    # A no-cache forward over the committed tokens gives the accepted nodes' logits.
    committed = torch.cat([prompt_1P[0]] + [tree[0, path] for tree, path in zip(trees, PATHS)])
    with torch.inference_mode():
        full = target(committed[None], []).logits[0]
    torch.testing.assert_close(prefill, full[:PROMPT_LEN], atol=ATOL, rtol=1e-5)
    start = PROMPT_LEN
    for logits, path in zip(steps, PATHS):
        torch.testing.assert_close(logits[path], full[start:start + len(path)], atol=ATOL, rtol=1e-5)
        start += len(path)


def test_no_reallocation_across_steps(target):
    prompt_1P, trees = _random_tokens(PROMPT_LEN, 0, target.vocab_size), _trees(target)
    for static_shape in (False, True):
        _, _, pointers = _run_static(target, prompt_1P, trees, static_shape)
        assert all(step == pointers[0] for step in pointers)


def test_static_shape_matches_dynamic_shape(target):
    prompt_1P, trees = _random_tokens(PROMPT_LEN, 0, target.vocab_size), _trees(target)
    dynamic_prefill, dynamic_steps, _ = _run_static(target, prompt_1P, trees, static_shape=False)
    static_prefill, static_steps, _ = _run_static(target, prompt_1P, trees, static_shape=True)
    torch.testing.assert_close(static_prefill, dynamic_prefill, atol=1e-5, rtol=1e-6)
    for static_logits, dynamic_logits in zip(static_steps, dynamic_steps):
        torch.testing.assert_close(static_logits, dynamic_logits, atol=1e-5, rtol=1e-6)


@torch.inference_mode()
def test_overflow_names_both_numbers(target):
    cache = TreeStaticCache(target.config, max_cache_len=PROMPT_LEN + 3)
    target(_random_tokens(PROMPT_LEN, 0, target.vocab_size), [], past_key_values=cache, use_cache=True)
    cache.commit()
    needed, capacity = PROMPT_LEN + TREE.num_nodes, PROMPT_LEN + 3
    with pytest.raises(ValueError, match=rf"{needed} positions needed.*max_cache_len is {capacity}"):
        _verify_tree(target, cache, _random_tokens(TREE.num_nodes, 1, target.vocab_size))


@pytest.mark.parametrize("static_shape", [False, True], ids=["dynamic-shape", "static-shape"])
@torch.inference_mode()
def test_greedy_loop_equals_generate(target, static_shape):
    """Prefill, then one-token steps with no mask and no positions: transformers derives both
    from get_seq_length (the committed length) and get_mask_sizes."""
    prompt_1P, num_new = _random_tokens(PROMPT_LEN, 5, target.vocab_size), 12
    expected = target.model.generate(prompt_1P, attention_mask=torch.ones_like(prompt_1P), do_sample=False,
                                     max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=0)
    cache = TreeStaticCache(target.config, max_cache_len=PROMPT_LEN + num_new, static_shape=static_shape)
    logits = target(prompt_1P, [], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    cache.commit()
    tokens, step_logits = [int(logits[0, -1].argmax())], [logits[0, -1]]
    while len(tokens) < num_new:
        logits = target(torch.tensor([[tokens[-1]]]), [], past_key_values=cache, use_cache=True).logits
        cache.commit()
        tokens.append(int(logits[0, -1].argmax()))
        step_logits.append(logits[0, -1])
    assert tokens == expected[0, PROMPT_LEN:].tolist()
    # Greedy tokens can agree through small errors (e.g. attending to the zero tail): compare logits too.
    full = target(expected[:, :-1], []).logits[0, PROMPT_LEN - 1:]
    torch.testing.assert_close(torch.stack(step_logits), full, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("static_shape", [False, True], ids=["dynamic-shape", "static-shape"])
@torch.inference_mode()
def test_batch_of_two_with_different_paths(target, static_shape):
    """B = 2: each sequence accepts its own path, so the committed lengths diverge; each row's
    logits equal that sequence decoded alone (B = 1)."""
    prompts_2P = torch.cat([_random_tokens(PROMPT_LEN, 0, target.vocab_size),
                            _random_tokens(PROMPT_LEN, 7, target.vocab_size)])
    trees = [torch.cat([tree, tree.flip(-1)]) for tree in _trees(target)]  # [2, T] per step
    paths_per_sequence = [PATHS, PATHS[::-1]]
    cache = TreeStaticCache(target.config, max_cache_len=64, batch_size=2, static_shape=static_shape)
    target(prompts_2P, [], past_key_values=cache, use_cache=True)
    cache.commit()
    batch_steps = []
    for step, tree_tokens_2T in enumerate(trees):
        batch_steps.append(_verify_tree(target, cache, tree_tokens_2T))
        cache.commit([torch.tensor(paths[step]) for paths in paths_per_sequence])
    assert cache.seq_lens == [PROMPT_LEN + sum(map(len, paths)) for paths in paths_per_sequence]

    for row, paths in enumerate(paths_per_sequence):
        single = TreeStaticCache(target.config, max_cache_len=64, static_shape=static_shape)
        target(prompts_2P[row:row + 1], [], past_key_values=single, use_cache=True)
        single.commit()
        for step, tree_tokens_2T in enumerate(trees):
            logits = _verify_tree(target, single, tree_tokens_2T[row:row + 1])[0]
            torch.testing.assert_close(batch_steps[step][row], logits, atol=ATOL, rtol=1e-5)
            single.commit(torch.tensor(paths[step]))


@pytest.mark.parametrize("static_shape", [False, True], ids=["dynamic-shape", "static-shape"])
@torch.inference_mode()
def test_crop_and_uncommitted_forward_is_dropped(target, static_shape):
    """Also a chain step the way serving.decode.steps runs one: no mask, transformers builds it."""
    prompt_1P = _random_tokens(PROMPT_LEN, 0, target.vocab_size)
    cache = TreeStaticCache(target.config, max_cache_len=32, static_shape=static_shape)
    target(prompt_1P, [], past_key_values=cache, use_cache=True)
    cache.commit()
    # A verify that is never committed leaves the committed length alone; the next forward overwrites it.
    _verify_tree(target, cache, _random_tokens(TREE.num_nodes, 1, target.vocab_size))
    assert cache.get_seq_length() == PROMPT_LEN
    cache.crop(PROMPT_LEN - 2)
    assert cache.get_seq_length() == PROMPT_LEN - 2 and cache.num_pending == 0
    cache.crop(-1)
    assert cache.get_seq_length() == PROMPT_LEN - 3
    logits = target(prompt_1P[:, PROMPT_LEN - 3:], [], past_key_values=cache, use_cache=True).logits[0]
    full = target(prompt_1P, []).logits[0]
    torch.testing.assert_close(logits, full[PROMPT_LEN - 3:], atol=ATOL, rtol=1e-5)


def test_refuses_sliding_window_layers(tiny_qwen2_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_qwen2_dir)
    config.layer_types = ["sliding_attention"] + ["full_attention"] * (config.num_hidden_layers - 1)
    with pytest.raises(NotImplementedError, match="layer 0 is a 'sliding_attention' layer"):
        TreeStaticCache(config, max_cache_len=16)


@torch.inference_mode()
def test_kept_rows_stay_and_moved_rows_match_explicit_paths(target):
    """commit with None and num_kept for some rows keeps their first pending entries where they
    are; the other rows' paths move in one gather. The buffers equal a twin cache's that
    committed every row's path explicitly."""
    prompts_3P = torch.cat([_random_tokens(PROMPT_LEN, seed, target.vocab_size) for seed in (0, 7, 9)])
    tree_tokens_3T = torch.cat([_random_tokens(TREE.num_nodes, seed, target.vocab_size) for seed in (1, 2, 3)])
    caches = []
    for paths, num_kept in (([None, torch.tensor([0, 2, 5]), None], [3, 1, 1]),
                            ([torch.tensor([0, 1, 2]), torch.tensor([0, 2, 5]), torch.tensor([0])], None)):
        cache = TreeStaticCache(target.config, max_cache_len=32, batch_size=3)
        target(prompts_3P, [], past_key_values=cache, use_cache=True)
        cache.commit()
        _verify_tree(target, cache, tree_tokens_3T)
        cache.commit(paths, num_kept=num_kept)
        caches.append(cache)
    assert caches[0].seq_lens == caches[1].seq_lens == [PROMPT_LEN + 3, PROMPT_LEN + 3, PROMPT_LEN + 1]
    for mine, twin in zip(caches[0].layers, caches[1].layers):
        for row, length in enumerate(caches[1].seq_lens):
            torch.testing.assert_close(mine.keys[row, :, :length], twin.keys[row, :, :length], rtol=0, atol=0)
            torch.testing.assert_close(mine.values[row, :, :length], twin.values[row, :, :length], rtol=0, atol=0)
    with pytest.raises(ValueError, match="3 accepted paths and 2 kept counts for batch size 3"):
        caches[0].commit([None] * 3, num_kept=[1, 1])


@torch.inference_mode()
def test_the_device_commit_equals_the_host_commit_and_rows_move_with_their_followers(target):
    """commit_accepted (a decode step's: device paths padded to one width, device counts) keeps
    what commit(paths) keeps, and advances the device lengths alone until count_committed; then
    a row swap and a row move carry a per-row follower tensor along with the keys and values."""
    prompts_3P = torch.cat([_random_tokens(PROMPT_LEN, seed, target.vocab_size) for seed in (0, 7, 9)])
    tree_tokens_3T = torch.cat([_random_tokens(TREE.num_nodes, seed, target.vocab_size) for seed in (1, 2, 3)])
    paths = [[0, 2, 5], [0, 1, 3, 6], [0]]
    caches = []
    for device_commit in (False, True):
        cache = TreeStaticCache(target.config, max_cache_len=32, batch_size=3)
        target(prompts_3P, [], past_key_values=cache, use_cache=True)
        cache.commit()
        _verify_tree(target, cache, tree_tokens_3T)
        if device_commit:
            padded = torch.tensor([path + [0] * (4 - len(path)) for path in paths])  # past a row's count: anything
            cache.commit_accepted(padded, torch.tensor([len(path) for path in paths]))
            assert cache.seq_lens == [PROMPT_LEN] * 3  # the host lengths wait for the read
            cache.count_committed([len(path) for path in paths])
        else:
            cache.commit([torch.tensor(path) for path in paths])
        caches.append(cache)
    host, device = caches
    assert device.seq_lens == host.seq_lens and device.lengths.device_lens.tolist() == host.seq_lens
    for mine, twin in zip(device.layers, host.layers):
        for row, length in enumerate(host.seq_lens):
            torch.testing.assert_close(mine.keys[row, :, :length], twin.keys[row, :, :length], rtol=0, atol=0)
            torch.testing.assert_close(mine.values[row, :, :length], twin.values[row, :, :length], rtol=0, atol=0)
    follower = torch.arange(3)[:, None] * 10 + torch.arange(2)  # [3, 2]: row r holds (10r, 10r + 1)
    device.follow(follower, dim=0)
    keys_row0 = device.layers[0].keys[0, :, :host.seq_lens[0]].clone()
    device.swap_rows(0, 2)
    device.move_row(2, 1)  # row 2 (the first sequence, swapped there) replaces row 1
    assert follower.tolist() == [[20, 21], [0, 1], [0, 1]]
    assert device.lengths.device_lens.tolist() == device.seq_lens == [host.seq_lens[2], host.seq_lens[0], 0]
    torch.testing.assert_close(device.layers[0].keys[1, :, :host.seq_lens[0]], keys_row0, rtol=0, atol=0)
