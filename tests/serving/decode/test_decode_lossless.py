"""Lossless greedy tree decoding: the engine's output equals HF `generate(do_sample=False)`.

Each tiny target (Llama, Qwen2) is checked on NUM_PROMPTS random prompts with: no heads
(plain greedy through the same cache code), random Medusa heads (almost never accepted),
oracle heads that always match (multi-token acceptance), and oracle heads with some
depths corrupted (acceptance through non-top-1 branches, and rejections). EOS and
max_new_tokens are placed so they fall inside accepted paths, and the tests check that
this really happened.

The oracle is a stateless nn.Module, like real heads: it maps an input hidden state to
its position by nearest neighbour against the target's precomputed greedy trajectory and
returns one-hot logits for the greedy tokens at offsets +2..+K+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from torch import nn
from transformers import DynamicCache

from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.generate import generate
from specheads.serving.decode.stats import DecodeStats
from dynamic_cache_reference import commit_path
from specheads.serving.decode.trees import DraftTree

NUM_PROMPTS = 20
NUM_NEW = 16
NUM_HEADS = 4
NUM_LONG = NUM_NEW + NUM_HEADS + 1  # trajectory long enough for the oracle's last targets
# Branches at ranks 0 and 1 so a corrupted top-1 can be rescued by a rank-1 sibling.
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]]


def hf_greedy(target: TargetAdapter, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class OracleHeads(nn.Module):
    """Stateless stub heads that know the target's greedy continuation of one prompt.

    corrupt(depth, position) -> None (correct top-1), "rank1" (a wrong top-1, the right
    token at rank 1) or "wrong" (the right token nowhere near the top).
    """

    def __init__(self, hidden_NH: torch.Tensor, tokens_N: torch.Tensor, first_position: int,
                 num_heads: int, vocab_size: int, corrupt=None):
        super().__init__()
        self.num_heads = num_heads
        self.vocab_size = vocab_size
        self.register_buffer("hidden_NH", hidden_NH)  # final hidden state at positions first_position..
        self.register_buffer("tokens_N", tokens_N)  # whole sequence, prompt + continuation
        self.first_position = first_position
        self.corrupt = corrupt

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        batch, num_positions, _ = hidden_BTH.shape
        flat = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
        positions = torch.cdist(flat, self.hidden_NH).argmin(dim=1) + self.first_position
        logits = torch.zeros(self.num_heads, flat.shape[0], self.vocab_size)
        last = self.tokens_N.shape[0] - 1
        for row, position in enumerate(positions.tolist()):
            for head in range(self.num_heads):
                token = int(self.tokens_N[min(position + head + 2, last)])
                mode = self.corrupt(head + 1, position) if self.corrupt else None
                wrong = (token + 1 + head) % self.vocab_size
                if mode is None:
                    logits[head, row, token] = 10.0
                elif mode == "rank1":
                    logits[head, row, wrong] = 10.0
                    logits[head, row, token] = 5.0
                else:
                    logits[head, row, wrong] = 10.0
                    logits[head, row, (wrong + 1) % self.vocab_size] = 5.0
        return logits.reshape(self.num_heads, batch, num_positions, self.vocab_size)


@dataclass
class Case:
    prompt: list[int]
    reference: list[int]  # HF greedy, NUM_NEW tokens, no EOS
    long_reference: list[int]  # HF greedy, NUM_LONG tokens, no EOS
    hidden_NH: torch.Tensor  # final hidden at positions len(prompt)-1 ..
    tokens_N: torch.Tensor  # prompt + long_reference

    def oracle(self, target: TargetAdapter, corrupt=None) -> OracleHeads:
        return OracleHeads(self.hidden_NH, self.tokens_N, len(self.prompt) - 1, NUM_HEADS,
                           target.vocab_size, corrupt)


def build_cases(target: TargetAdapter, seed: int) -> list[Case]:
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for index in range(NUM_PROMPTS):
        length = 1 + (index * 7) % 29
        prompt = torch.randint(3, target.vocab_size, (length,), generator=generator).tolist()
        long_reference = hf_greedy(target, prompt, NUM_LONG)
        reference = hf_greedy(target, prompt, NUM_NEW)
        assert reference == long_reference[:NUM_NEW]
        tokens = torch.tensor(prompt + long_reference)
        with torch.no_grad():
            hidden = target(tokens[None], [target.num_layers]).taps[0][0]
        cases.append(Case(prompt, reference, long_reference, hidden[length - 1:], tokens))
    return cases


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_setup(request):
    directory = request.getfixturevalue(f"tiny_{request.param}_dir")
    target = TargetAdapter.from_pretrained(directory)
    return target, build_cases(target, seed=1234 + len(request.param))


def capacity(stats: DecodeStats) -> int:
    """Tokens the run produced before stop truncation: 1 from prefill + tau per step."""
    return 1 + stats.steps + stats.accepted_tokens


def test_commit_path_gathers_prefix_and_accepted_nodes():
    cache = DynamicCache()
    keys = torch.arange(2 * 9, dtype=torch.float32).reshape(1, 2, 9, 1).expand(1, 2, 9, 3).contiguous()
    for layer_index in range(2):
        cache.update(keys + 100 * layer_index, -keys, layer_index)
    commit_path(cache, prefix_len=4, accepted_node_indices=torch.tensor([0, 2, 4]))
    assert cache.get_seq_length() == 7
    for layer_index, layer in enumerate(cache.layers):
        assert layer.keys[0, 0, :, 0].tolist() == [p + 100 * layer_index for p in (0, 1, 2, 3, 4, 6, 8)]
        assert layer.values[0, 1, :, 0].tolist() == [-(9 + p) for p in (0, 1, 2, 3, 4, 6, 8)]
    commit_path(cache, prefix_len=5, accepted_node_indices=[0])  # contiguous: a slice
    assert cache.get_seq_length() == 6


def test_plain_engine_matches_hf_generate(arch_setup):
    target, cases = arch_setup
    decoder = SpeculativeDecoder(target)
    total = DecodeStats()
    for case in cases:
        result = generate(decoder, case.prompt, NUM_NEW)
        assert result.tokens == case.reference
        assert result.finish_reason == "length"
        assert result.stats.steps == result.stats.plain_steps == NUM_NEW - 1 and result.stats.tau == 0.0  # no drafts
        total = total.merge(result.stats)
    assert total.num_new_tokens == NUM_PROMPTS * NUM_NEW and total.alpha == 0.0


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_random_heads_are_lossless(arch_setup, draft_vocab):
    target, cases = arch_setup
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS, draft_vocab_size=draft_vocab)
    if draft_vocab is not None:  # draft ids 0..63 are target ids 3, 6, 9, ...
        heads.set_draft_vocab(torch.arange(draft_vocab) * 2 + 3)
    heads.init_lm_heads_from(target.lm_head())  # plausible candidates: often the target's own top tokens
    nn.init.normal_(heads.block_weight, std=0.2)
    decoder = SpeculativeDecoder(target, heads, DraftTree.from_paths(TREE_PATHS))
    for case in cases:
        result = generate(decoder, torch.tensor([case.prompt]), NUM_NEW)
        assert result.tokens == case.reference
        assert 0.0 <= result.stats.alpha <= 1.0


def test_heads_with_a_draft_vocab_draft_target_ids(arch_setup):
    """Fresh heads are the target's lm_head on the draft vocab's rows, so the drafter must
    propose the target's best token among them, as a target id (not a draft id)."""
    target, _ = arch_setup
    draft_ids = torch.arange(64) * 2 + 3
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 2, draft_vocab_size=64)
    heads.set_draft_vocab(draft_ids - torch.arange(64))
    heads.init_lm_heads_from(target.lm_head())
    drafter = SpeculativeDecoder(target, heads, DraftTree.chain(2)).drafter
    hidden_BH = torch.randn(3, target.hidden_size)
    tokens_BT, _ = drafter.draft_tokens(hidden_BH, torch.zeros(3, dtype=torch.long))
    best = draft_ids[target.lm_head()(hidden_BH)[:, draft_ids].argmax(-1)]  # [B]
    assert torch.equal(tokens_BT[:, 1], best) and torch.equal(tokens_BT[:, 2], best)


def test_oracle_heads_are_lossless_and_accept_whole_paths(arch_setup):
    target, cases = arch_setup
    tree = DraftTree.from_paths(TREE_PATHS)
    total = DecodeStats()
    for case in cases:
        # fallback=None: the counts below must not depend on how fast the machine measured a step
        result = generate(SpeculativeDecoder(target, case.oracle(target), tree, fallback=None), case.prompt, NUM_NEW)
        assert result.tokens == case.reference
        assert len(result.tokens) == result.stats.num_new_tokens == NUM_NEW
        total = total.merge(result.stats)
    assert total.tau > 2.0 and 0.0 <= total.alpha <= 1.0
    assert total.accepted_per_position == [total.steps] * tree.max_depth  # every step took a whole path
    assert total.drafted_tokens == total.steps * tree.max_depth
    chain = DraftTree.chain(NUM_HEADS)  # verified with the model's own causal mask
    for case in cases[:NUM_PROMPTS // 2]:
        result = generate(SpeculativeDecoder(target, case.oracle(target), chain, fallback=None), case.prompt, NUM_NEW)
        assert result.tokens == case.reference
        assert result.stats.tau > 2.0


def test_sometimes_matching_oracle_is_lossless(arch_setup):
    target, cases = arch_setup
    tree = DraftTree.from_paths(TREE_PATHS)

    def corrupt(depth, position):
        if (depth + position) % 3 == 0:
            return "rank1"
        return "wrong" if depth == 3 and position % 2 else None

    total = DecodeStats()
    for case in cases:
        result = generate(SpeculativeDecoder(target, case.oracle(target, corrupt), tree), case.prompt, NUM_NEW)
        assert result.tokens == case.reference
        total = total.merge(result.stats)
    assert 1.0 < total.tau and 0.0 < total.alpha < 1.0
    assert total.accepted_per_position[2] < total.accepted_per_position[1]


def test_eos_inside_an_accepted_path(arch_setup):
    target, cases = arch_setup
    tree = DraftTree.from_paths(TREE_PATHS)
    num_truncated = 0
    for index, case in enumerate(cases):
        eos = case.long_reference[2 + index % 9]
        eos_ids = [eos] if index % 2 else eos  # both accepted forms
        expected = hf_greedy(target, case.prompt, NUM_NEW, eos_token_id=eos)
        assert expected[-1] == eos and eos not in expected[:-1]
        result = generate(SpeculativeDecoder(target, case.oracle(target), tree), case.prompt, NUM_NEW, eos_ids)
        assert result.tokens == expected
        assert result.finish_reason == "stop"
        num_truncated += capacity(result.stats) > len(result.tokens)
    assert num_truncated >= NUM_PROMPTS // 2  # EOS really fell inside accepted paths


def test_max_new_tokens_inside_an_accepted_path(arch_setup):
    target, cases = arch_setup
    tree = DraftTree.from_paths(TREE_PATHS)
    num_truncated = 0
    for index, case in enumerate(cases):
        max_new_tokens = 1 + index % 11
        result = generate(SpeculativeDecoder(target, case.oracle(target), tree), case.prompt, max_new_tokens)
        assert result.tokens == case.reference[:max_new_tokens]
        assert result.finish_reason == "length"
        num_truncated += capacity(result.stats) > len(result.tokens)
    assert hf_greedy(target, cases[5].prompt, 6) == cases[5].reference[:6]
    assert num_truncated >= NUM_PROMPTS // 3  # the limit really fell inside accepted paths


def test_eos_from_prefill_and_bad_arguments(arch_setup):
    target, cases = arch_setup
    case = cases[0]
    first = case.reference[0]
    result = generate(SpeculativeDecoder(target), case.prompt, NUM_NEW, eos_token_id=first)
    assert result.tokens == [first] and result.finish_reason == "stop" and result.stats.steps == 0
    with pytest.raises(ValueError):
        generate(SpeculativeDecoder(target), case.prompt, 0)
    with pytest.raises(ValueError):
        SpeculativeDecoder(target, None, DraftTree.chain(2))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_tree_attention_kernel_path_is_lossless(arch_setup, impl, tiny_llama_dir, tiny_qwen2_dir):
    """attn_impl="tree": verify passes tree_mask=/prefix_len= to the registered tree attention
    instead of a 4-D mask; the output is still the target's greedy decoding."""
    target, cases = arch_setup
    directory = tiny_llama_dir if target.identity.model_type == "llama" else tiny_qwen2_dir
    tree_target = TargetAdapter.from_pretrained(directory)  # its own model: the decoder switches its attention
    tree = DraftTree.from_paths(TREE_PATHS)

    def corrupt(depth, position):
        return "rank1" if (depth + position) % 3 == 0 else None

    total = DecodeStats()
    for case in cases[:3]:
        decoder = SpeculativeDecoder(tree_target, case.oracle(tree_target, corrupt), tree, attn_impl="tree",
                                     tree_attention_impl=impl)
        result = generate(decoder, case.prompt, NUM_NEW)
        assert result.tokens == case.reference
        total = total.merge(result.stats)
    assert tree_target.model.config._attn_implementation == "specheads_tree"
    assert total.tau > 1.5
    with pytest.raises(ValueError):
        SpeculativeDecoder(tree_target, attn_impl="flash")
