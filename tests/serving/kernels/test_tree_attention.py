"""Tree attention: packed masks, the PyTorch reference, Triton parity, the transformers hook.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it
before anything imports triton). Errors are relative: ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import math

import torch

import pytest

from specheads.serving.kernels.tree_attention import (
    pack_tree_mask,
    register_tree_attention,
    tree_attention,
    tree_attention_reference,
    unpack_tree_mask,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def random_tree_mask(num_tree: int, generator: torch.Generator) -> torch.Tensor:
    """[T, T] bool ancestor mask (self included) of a random tree; node 0 is the root."""
    parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, num_tree)]
    mask = torch.zeros(num_tree, num_tree, dtype=torch.bool)
    for node in range(num_tree):
        ancestor = node
        while ancestor >= 0:
            mask[node, ancestor] = True
            ancestor = parents[ancestor]
    return mask


def make_inputs(batch, num_kv_heads, group, num_tree, prefix_len, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # q as a transposed view of [B, T, Hq, D], the layout transformers hands over.
    q = torch.randn(batch, num_tree, num_kv_heads * group, head_dim, generator=generator).transpose(1, 2)
    k = torch.randn(batch, num_kv_heads, prefix_len + num_tree, head_dim, generator=generator)
    v = torch.randn(batch, num_kv_heads, prefix_len + num_tree, head_dim, generator=generator)
    tree_mask = random_tree_mask(num_tree, generator)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), tree_mask.to(DEVICE)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_triton(q, k, v, prefix_len, tree_mask, **kwargs) -> torch.Tensor:
    """Triton path into a NaN-poisoned output, so an unwritten element fails the test."""
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    result = tree_attention(q, k, v, prefix_len, tree_mask, impl="triton", out=out, **kwargs)
    assert result is out
    assert torch.isfinite(out).all(), "kernel left elements unwritten"
    return out


def brute_force(q, k, v, prefix_len, tree_mask, scale):
    """One query at a time, softmax over the keys it sees, in float64."""
    batch, num_q_heads, num_tree, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.zeros(batch, num_q_heads, num_tree, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(num_q_heads):
            for t in range(num_tree):
                seen = list(range(prefix_len)) + [prefix_len + j for j in range(num_tree) if tree_mask[t, j]]
                keys = k[b, h // group, seen].double()
                weights = torch.softmax(keys @ q[b, h, t].double() * scale, dim=0)
                out[b, h, t] = weights @ v[b, h // group, seen].double()
    return out


# --- packed masks ---------------------------------------------------------------------

@pytest.mark.parametrize("num_tree", [1, 3, 31, 32, 33, 64, 65, 128])
def test_pack_roundtrip_and_bit_layout(num_tree):
    generator = torch.Generator().manual_seed(num_tree)
    mask = torch.rand(2, num_tree, num_tree, generator=generator) < 0.5
    packed = pack_tree_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (2, num_tree, math.ceil(num_tree / 32))
    assert torch.equal(unpack_tree_mask(packed, num_tree), mask)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    for t in range(num_tree):
        for j in range(num_tree):
            assert bool((int(words[1, t, j // 32]) >> (j % 32)) & 1) == bool(mask[1, t, j])


def test_packed_and_bool_masks_give_the_same_output():
    q, k, v, tree_mask = make_inputs(1, 2, 2, 33, 5, 16, torch.float32, seed=3)
    from_bool = run_triton(q, k, v, 5, tree_mask)
    from_packed = run_triton(q, k, v, 5, pack_tree_mask(tree_mask))
    assert torch.equal(from_bool, from_packed)
    assert torch.equal(tree_attention_reference(q, k, v, 5, tree_mask),
                       tree_attention_reference(q, k, v, 5, pack_tree_mask(tree_mask)))


# --- reference ------------------------------------------------------------------------

@pytest.mark.parametrize("num_tree,prefix_len,group", [(1, 0, 1), (3, 1, 2), (17, 5, 4), (6, 37, 2)])
def test_reference_matches_brute_force(num_tree, prefix_len, group):
    q, k, v, tree_mask = make_inputs(2, 2, group, num_tree, prefix_len, 16, torch.float32, seed=num_tree)
    scale = 0.3
    ref = tree_attention_reference(q, k, v, prefix_len, tree_mask, scale)
    expected = brute_force(q.cpu(), k.cpu(), v.cpu(), prefix_len, tree_mask.cpu(), scale)
    assert relative_error(ref.cpu(), expected) < 1e-6


# --- Triton parity --------------------------------------------------------------------

# (batch, num_kv_heads, group, T, S, D): every T, S, group and D value at least once.
PARITY_CASES = [
    (1, 1, 1, 1, 0, 16),
    (1, 2, 1, 1, 37, 32),
    (2, 1, 2, 3, 0, 64),
    (1, 2, 4, 3, 1, 16),
    (1, 1, 4, 17, 5, 32),
    (2, 2, 2, 17, 37, 16),
    (1, 1, 1, 33, 1, 64),
    (1, 2, 2, 33, 5, 16),
    (1, 1, 2, 33, 37, 32),
    (1, 1, 2, 128, 40, 16),  # the largest tree: 4 mask words, 8 row blocks
]


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: "B{}Hkv{}g{}T{}S{}D{}".format(*c))
def test_triton_matches_reference_fp32(case):
    batch, num_kv_heads, group, num_tree, prefix_len, head_dim = case
    q, k, v, tree_mask = make_inputs(*case, torch.float32, seed=sum(case))
    out = run_triton(q, k, v, prefix_len, tree_mask)
    ref = tree_attention_reference(q, k, v, prefix_len, tree_mask)
    assert relative_error(out, ref) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("split_size", [None, 32, 64, 1000])
def test_long_prefix_is_split_and_merged(split_size):
    # S = 300: 10 prefix splits for 32, 5 for 64, 1 for 1000, plus the tree split; None is the
    # default rule (triton_kernel.prefix_splits, for the interpreter's stand-in SMs).
    q, k, v, tree_mask = make_inputs(1, 2, 2, 17, 300, 32, torch.float32, seed=7)
    out = run_triton(q, k, v, 300, tree_mask, split_size=split_size)
    ref = tree_attention_reference(q, k, v, 300, tree_mask)
    assert relative_error(out, ref) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [(1, 2, 2, 17, 37, 32), (2, 1, 4, 3, 300, 16), (1, 2, 1, 33, 5, 64)],
                         ids=lambda c: "B{}Hkv{}g{}T{}S{}D{}".format(*c))
def test_triton_matches_reference_half(case, dtype):
    batch, num_kv_heads, group, num_tree, prefix_len, head_dim = case
    q, k, v, tree_mask = make_inputs(*case, dtype, seed=sum(case))
    out = run_triton(q, k, v, prefix_len, tree_mask, split_size=64)
    assert out.dtype == dtype
    ref = tree_attention_reference(q.float(), k.float(), v.float(), prefix_len, tree_mask)
    assert relative_error(out, ref) <= TOLERANCE[dtype]


def test_per_sequence_masks_and_longer_key_buffer():
    # Each sequence has its own tree; keys beyond S+T (a preallocated cache) are ignored.
    q, k, v, _ = make_inputs(2, 1, 2, 9, 5, 16, torch.float32, seed=11)
    generator = torch.Generator().manual_seed(12)
    masks = torch.stack([random_tree_mask(9, generator) for _ in range(2)]).to(DEVICE)
    k = torch.cat([k, torch.randn_like(k[:, :, :4])], dim=2)
    v = torch.cat([v, torch.randn_like(v[:, :, :4])], dim=2)
    out = run_triton(q, k, v, 5, pack_tree_mask(masks))
    ref = tree_attention_reference(q, k, v, 5, masks)
    assert relative_error(out, ref) <= TOLERANCE[torch.float32]
    expected = brute_force(q.cpu(), k.cpu(), v.cpu(), 5, masks[1].cpu(), 16 ** -0.5)[1:]
    assert relative_error(ref[1:].cpu(), expected) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sequence_prefix_lengths(dtype):
    # A preallocated cache at batch 3: sequence b's tree keys sit at S_b .. S_b+T-1, and each
    # spreads its key blocks over the 5 prefix splits: none, 3 of them (some see no key), all.
    prefix_lens = [0, 70, 300]
    q, k, v, _ = make_inputs(3, 2, 2, 9, 300, 16, dtype, seed=13)
    generator = torch.Generator().manual_seed(14)
    masks = torch.stack([random_tree_mask(9, generator) for _ in range(3)]).to(DEVICE)
    out = run_triton(q, k, v, torch.tensor(prefix_lens), masks, split_size=64)
    ref = tree_attention_reference(q.float(), k.float(), v.float(), prefix_lens, masks)
    assert relative_error(out, ref) <= TOLERANCE[dtype]
    for b, prefix_len in enumerate(prefix_lens):
        expected = brute_force(q[b:b + 1].float().cpu(), k[b:b + 1].float().cpu(), v[b:b + 1].float().cpu(),
                               prefix_len, masks[b].cpu(), 16 ** -0.5)
        assert relative_error(ref[b:b + 1].cpu(), expected) < 1e-6


def test_rejects_bad_arguments(monkeypatch):
    q, k, v, tree_mask = make_inputs(1, 1, 1, 3, 2, 16, torch.float32)
    if DEVICE == "cpu":
        with monkeypatch.context() as patch:
            patch.setenv("TRITON_INTERPRET", "0")
            with pytest.raises(ValueError, match="impl='torch'"):
                tree_attention(q, k, v, 2, tree_mask, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        tree_attention(q, k, v, 2, tree_mask, impl="cuda")
    with pytest.raises(ValueError, match="prefix_len"):
        tree_attention(q, k, v, 3, tree_mask, impl="torch")
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention(q, k, v, 2, tree_mask[:2], impl="torch")
    with pytest.raises(ValueError, match="one length per sequence"):
        tree_attention(q, k, v, [1, 2], tree_mask, impl="torch")
    with pytest.raises(TypeError, match="int32"):
        tree_attention(q, k, v, 2, pack_tree_mask(tree_mask).long(), impl="triton")
    with pytest.raises(TypeError, match="integers"):
        tree_attention(q, k, v, torch.tensor([2.0]), tree_mask, impl="triton", max_prefix_len=2)
    with pytest.raises(ValueError, match="split_size"):
        tree_attention(q, k, v, 2, tree_mask, impl="triton", split_size=0)


# --- transformers attention function ----------------------------------------------------

def _tiny_llama(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    if attn_implementation != "sdpa":
        model.set_attn_implementation(attn_implementation)
    return model


def _prefilled(model, prompt_1S):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(prompt_1S, past_key_values=cache, use_cache=True)
    return out.logits, out.past_key_values


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_registered_attention_matches_sdpa_tree_verify(impl, monkeypatch):
    from specheads.serving.kernels import tree_attention as module

    calls = []
    monkeypatch.setattr(module, "tree_attention", lambda *args, **kwargs: calls.append(kwargs["impl"])
                        or tree_attention(*args, **kwargs))
    name = register_tree_attention()
    sdpa_model = _tiny_llama("sdpa")
    tree_model = _tiny_llama(name)
    assert tree_model.config._attn_implementation == name
    generator = torch.Generator().manual_seed(5)
    prompt_1S = torch.randint(0, 128, (1, 7), generator=generator)
    tree_mask = random_tree_mask(11, generator)
    depths = tree_mask.sum(dim=1) - 1  # [T]
    tree_tokens_1T = torch.randint(0, 128, (1, 11), generator=generator)
    prefix_len = prompt_1S.shape[1]
    position_ids = (prefix_len + depths)[None]

    with torch.no_grad():
        sdpa_prefill, sdpa_cache = _prefilled(sdpa_model, prompt_1S)
        tree_prefill, tree_cache = _prefilled(tree_model, prompt_1S)
        # Without tree kwargs the function is SDPA: prefill logits agree exactly.
        assert torch.equal(sdpa_prefill, tree_prefill)
        mask = torch.ones(1, 1, 11, prefix_len + 11, dtype=torch.bool)
        mask[0, 0, :, prefix_len:] = tree_mask
        expected = sdpa_model(tree_tokens_1T, attention_mask=mask, position_ids=position_ids,
                              past_key_values=sdpa_cache, use_cache=True).logits
        got = tree_model(tree_tokens_1T, position_ids=position_ids, past_key_values=tree_cache, use_cache=True,
                         tree_mask=pack_tree_mask(tree_mask), prefix_len=prefix_len,
                         tree_attention_impl=impl).logits
    assert relative_error(got, expected) <= 1e-5
    assert calls == [impl] * tree_model.config.num_hidden_layers  # the tree reached every layer
    assert tree_cache.get_seq_length() == prefix_len + 11
    # The plain causal mask gives other logits, so the comparison above tests the tree mask.
    with torch.no_grad():
        _, causal_cache = _prefilled(tree_model, prompt_1S)
        causal = tree_model(tree_tokens_1T, position_ids=position_ids, past_key_values=causal_cache).logits
    assert relative_error(causal, expected) > 1e-2


def test_registered_attention_loads_through_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    _tiny_llama("sdpa").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=register_tree_attention())
    assert model.config._attn_implementation == "specheads_tree"
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    prompt = torch.arange(1, 9)[None]
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, reference(prompt).logits)
