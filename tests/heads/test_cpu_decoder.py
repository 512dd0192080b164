"""The fused CPU forward (heads/target/cpu_decoder.py) computes what the model's own forward computes:
logits, taps and cache, with and without a cache, padding masks, tree masks and
logits_to_keep, for Llama, Qwen2 (biases) and Qwen3 (q/k norms), with its C kernels and with their
fallbacks (oneDNN for the linear layers, torch for the elementwise ops); its kernels round as
transformers' ops do; models it cannot run keep their own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from specheads.heads.target import cpu_attention, cpu_decoder, cpu_gemm, cpu_gemv, cpu_layout
from specheads.heads.target.cpu_decoder import FusedDecoder, unsupported_reason
from specheads.heads.target.cpu_layout import pack_linears
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.cache import TreeStaticCache

from conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
# fp32: max |difference| from the model's own forward, relative to the largest |value| (sums
# in another order). bf16: no worse than the model's own bf16 forward, both measured against
# its fp32 forward (each rounds differently: the fused projections, the attention kernel), up
# to BF16_SLACK of the largest |value|.
FP32_TOLERANCE = 1e-5
BF16_SLACK = 1e-2


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 whose q and k norms have distinct, non-unit weights (they start at ones)."""
    directory = make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), seed=2)
    model = AutoModelForCausalLM.from_pretrained(directory)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(params=["kernels", "kernel-ops", "onednn", "torch"])
def ops(request, monkeypatch):
    """The ways the fused forward computes: its C kernels where they build (the elementwise ops,
    and a C kernel's linear layers in bf16: heads/target/cpu_gemv.py's for a few rows on a CPU with
    AVX512-BF16, else heads/target/cpu_gemm.py's for every forward, each layer in two C calls
    around its attention); the same with cpu_gemm's ops one by one; the C elementwise kernels with
    every linear layer through oneDNN (where no row kernel is built; not in bf16 on a CPU where
    oneDNN cannot lay bf16 out); transformers' torch formulas and oneDNN."""
    if request.param != "torch" and cpu_decoder._library() is None:
        pytest.skip("no C compiler on this machine")
    if request.param == "kernel-ops":
        monkeypatch.setattr(cpu_decoder.FusedDecoder, "layer_halves", False)
    if request.param in ("onednn", "torch"):
        monkeypatch.setattr(cpu_gemv, "available", lambda: False)
        monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    if request.param == "torch":
        monkeypatch.setattr(cpu_decoder, "_library", lambda: None)
    return request.param


def _compare(model_dir, dtype, case) -> None:
    """`case(target)` -> tensors, run on the model's own forward in fp32 and in `dtype` and on
    the fused forward in `dtype`; see the tolerances above."""
    reference = case(TargetAdapter.from_pretrained(model_dir, dtype=torch.float32))
    own = case(TargetAdapter.from_pretrained(model_dir, dtype=dtype))
    fused_target = TargetAdapter.from_pretrained(model_dir, dtype=dtype, pack_weights=True)
    if fused_target.fused is None and dtype == torch.bfloat16 and not cpu_layout.reorders(dtype):
        pytest.skip("oneDNN cannot lay bf16 weights out on this CPU and no row kernel is built")
    assert fused_target.fused is not None
    assert_within_rounding(reference, own, case(fused_target), dtype)


def assert_within_rounding(reference, own, fused, dtype) -> None:
    """Each fused output against the model's own fp32 one: within FP32_TOLERANCE in fp32; in
    bf16, no worse than the model's own bf16 output (`own`) plus BF16_SLACK."""
    for want, plain, got in zip(reference, own, fused, strict=True):
        assert got.shape == want.shape
        scale = want.float().abs().max()
        error = (got.float() - want.float()).abs().max()
        if dtype == torch.float32:
            assert error <= FP32_TOLERANCE * scale
        else:
            assert error <= 1.5 * (plain.float() - want.float()).abs().max() + BF16_SLACK * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_forward_matches_the_model(arch, dtype, ops, request):
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(3))

    def case(target):
        taps = [0, 1, target.num_layers]
        with torch.inference_mode():
            whole = target(ids, taps)  # the whole prompt, no cache
            cache = DynamicCache(config=target.config)  # a cache: prefill, then two tokens keeping one logit row
            target(ids[:, :20], [], past_key_values=cache, use_cache=True)
            cached = target(ids[:, 20:22], [target.num_layers], past_key_values=cache, use_cache=True,
                            logits_to_keep=1)
            assert cached.logits.shape == (2, 1, 256) and cached.past_key_values is cache
            mask = torch.ones_like(ids)  # left padding: a 2-D mask
            mask[1, :5] = 0
            padded = target(ids, [], attention_mask=mask).logits
        return [whole.logits, *whole.taps, cached.logits, cached.taps[0], cache.layers[0].keys,
                padded[0], padded[1, 5:]]

    _compare(request.getfixturevalue(f"tiny_{arch}_dir"), dtype, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_verifies_a_tree_in_the_static_cache(dtype, ops, tiny_llama_dir):
    """What a verify step passes: a TreeStaticCache, explicit positions and a 4-D tree mask."""
    prompt = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    tree_ids = torch.randint(3, 256, (1, 4), generator=torch.Generator().manual_seed(6))
    tree_mask_TT = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    positions = torch.tensor([[12, 13, 13, 14]])

    def case(target):
        with torch.inference_mode():
            cache = TreeStaticCache(target.config, max_cache_len=32, batch_size=1)
            target(prompt, [], past_key_values=cache, use_cache=True)
            cache.commit()
            out = target(tree_ids, [1, 2], attention_mask=cache.attention_mask(tree_mask_TT), position_ids=positions,
                         past_key_values=cache, use_cache=True)
        return [out.logits, *out.taps]

    _compare(tiny_llama_dir, dtype, case)


@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_forward_writes_the_static_caches_rows_as_its_update_does(dtype, tiny_llama_dir, monkeypatch):
    """The fused forward writes its keys and values into a TreeStaticCache itself (`direct_writes`,
    one C call a layer): the same logits and the same cache, bit for bit, as through the cache's
    `update`, for active rows that do not start at row 0 and hold unequal lengths."""
    target = TargetAdapter.from_pretrained(tiny_llama_dir, dtype=dtype, pack_weights=True)
    assert target.fused is not None
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (1, n), generator=generator) for n in (9, 5)]
    tree_ids = torch.randint(3, 256, (2, 4), generator=generator)
    tree_mask_TT = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)

    def run():
        with torch.inference_mode():
            cache = TreeStaticCache(target.config, max_cache_len=24, batch_size=3)
            for row, prompt in zip((1, 2), prompts):
                cache.set_rows(row, row + 1)
                target(prompt, [], past_key_values=cache, use_cache=True)
                cache.commit()
            cache.set_rows(1, 3)
            tree = target(tree_ids, [1], attention_mask=cache.attention_mask(tree_mask_TT.expand(2, 4, 4)),
                          position_ids=cache.position_ids(torch.tensor([[0, 1, 1, 2]] * 2)), past_key_values=cache,
                          use_cache=True)
            assert cache.num_pending == 4
            cache.commit([0, 1, 3])
        return [tree.logits, *tree.taps, cache.storage.buffer.clone()]

    calls = []
    direct_writes = TreeStaticCache.direct_writes

    def recorded(self, num_new):
        writes = direct_writes(self, num_new)
        calls.append((num_new, writes is not None))
        return writes

    monkeypatch.setattr(TreeStaticCache, "direct_writes", recorded)
    direct = run()
    assert calls == [(9, False), (5, True), (4, True)]  # the first forward allocates the buffer through `update`
    monkeypatch.setattr(TreeStaticCache, "direct_writes", lambda self, n: None)
    for got, want in zip(direct, run(), strict=True):
        assert torch.equal(got, want)
    with torch.inference_mode():  # past max_cache_len it refuses, as `update` does
        cache = TreeStaticCache(target.config, max_cache_len=24, batch_size=1)
        target(prompts[0], [], past_key_values=cache, use_cache=True)
        cache.commit()
        with pytest.raises(ValueError, match="overflow: 25 positions needed"):
            direct_writes(cache, 16)


@pytest.mark.skipif(cpu_decoder._library() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 200])  # 200 x 128 values: the kernels' OpenMP path
def test_kernels_round_as_transformers_ops_do(dtype, rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(rows)
    library = cpu_decoder._library()
    suffix = cpu_decoder.DTYPES[dtype]
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)

    x = (torch.randn(rows, 128, generator=generator) * 3).to(dtype)
    norm = LlamaRMSNorm(128, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(128, generator=generator).to(dtype)
    out = torch.empty_like(x)
    getattr(library, f"rms_norm_{suffix}")(x.data_ptr(), norm.weight.data_ptr(), rows, 128, 1e-5, out.data_ptr())
    torch.testing.assert_close(out, norm(x).detach(), **exact)

    qkv = (torch.randn(rows, 6 * 16, generator=generator) * 3).to(dtype)  # Qwen3's q/k norms, in place
    head_norm = LlamaRMSNorm(16, eps=1e-6).to(dtype)
    head_norm.weight.data = torch.randn(16, generator=generator).to(dtype)
    want = qkv.clone()
    want[:, :64] = head_norm(qkv[:, :64].view(rows, 4, 16)).detach().view(rows, 64)
    getattr(library, f"head_rms_norm_{suffix}")(qkv.data_ptr(), head_norm.weight.data_ptr(), rows, 96, 4, 16, 1e-6)
    torch.testing.assert_close(qkv, want, **exact)  # the rest of the row is left alone

    gate_up = (torch.randn(rows, 256, generator=generator) * 4).to(dtype)
    out = torch.empty(rows, 128, dtype=dtype)
    getattr(library, f"silu_mul_{suffix}")(gate_up.data_ptr(), rows, 128, out.data_ptr())
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :128]) * gate_up[:, 128:], **exact)

    batch, tokens, q_heads, k_heads, dim = 2, rows, 4, 2, 16
    qkv = torch.randn(batch, tokens, (q_heads + 2 * k_heads) * dim, generator=generator).to(dtype)
    angles = torch.randn(1, tokens, dim // 2, generator=generator).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype).expand(batch, -1, -1), angles.sin().to(dtype).expand(batch, -1, -1)
    q = qkv[..., :q_heads * dim].view(batch, tokens, q_heads, dim)
    k = qkv[..., q_heads * dim:(q_heads + k_heads) * dim].view(batch, tokens, k_heads, dim)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    before_v = qkv[..., (q_heads + k_heads) * dim:].clone()
    getattr(library, f"rope_{suffix}")(q.data_ptr(), k.data_ptr(), qkv.stride(0), qkv.stride(1), q_heads, k_heads,
                                        cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.stride(1), batch,
                                        tokens, dim)
    torch.testing.assert_close(q.transpose(1, 2), want_q, **exact)
    torch.testing.assert_close(k.transpose(1, 2), want_k, **exact)
    assert torch.equal(qkv[..., (q_heads + k_heads) * dim:], before_v)  # v is left alone


@pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler, or this CPU has no AVX512-BF16")
def test_few_bf16_rows_run_the_row_kernel_and_many_run_onednn(tiny_llama_dir, monkeypatch):
    """A decode step and a small verify go through heads/target/cpu_gemv.py, a prefill through oneDNN."""
    target = TargetAdapter.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, pack_weights=True)
    assert all(layer.rows is not None for layer in target.fused.layers) and target.fused.lm_head_rows is not None
    calls = []
    row_call = cpu_gemv.RowLinear.__call__
    monkeypatch.setattr(cpu_gemv.RowLinear, "__call__", lambda op, x, *a: calls.append(x.shape) or row_call(op, x, *a))
    few = cpu_decoder.ROW_KERNEL_MAX_ROWS
    ids = torch.randint(3, 256, (1, few + 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(ids[:, :11], [], past_key_values=cache, use_cache=True)  # 11 rows: oneDNN
        assert calls == []
        target(ids[:, 11:11 + few], [], past_key_values=cache, use_cache=True)
        target(ids[:, -1:], [], past_key_values=cache, use_cache=True)
    per_forward = 4 * target.num_layers + 1  # qkv, o, gate/up, down per layer, and the LM head
    assert [shape[0] * shape[1] for shape in calls] == [few] * per_forward + [1] * per_forward


@pytest.mark.skipif(not cpu_gemm.available() or cpu_gemv.available() or cpu_decoder._library() is None,
                    reason="needs heads/target/cpu_gemm.py's kernel as this CPU's bf16 kernel")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layer_halves_compute_the_ops_one_by_one_bit_for_bit(arch, request, monkeypatch):
    """Each layer's two C calls (cpu_gemm_layer.PackedBf16Layer), with the cache write and the
    attention read in place between them (cpu_attention.RowWriter, AttentionCall), give exactly what
    its ops give one by one: a prefill of two rows, then a tree verify in the static cache (logits
    and every tap)."""
    target = TargetAdapter.from_pretrained(request.getfixturevalue(f"tiny_{arch}_dir"), dtype=torch.bfloat16,
                                           pack_weights=True)
    assert all(layer.halves is not None for layer in target.fused.layers)
    prompt = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(5))
    tree_ids = torch.randint(3, 256, (2, 4), generator=torch.Generator().manual_seed(6))
    tree_mask_TT = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)

    def run():
        with torch.inference_mode():
            cache = TreeStaticCache(target.config, max_cache_len=32, batch_size=2)
            first = target(prompt, [0, 1, target.num_layers], past_key_values=cache, use_cache=True)
            cache.commit()
            tree = target(tree_ids, [1, 2], attention_mask=cache.attention_mask(tree_mask_TT.expand(2, 4, 4)),
                          position_ids=cache.position_ids(torch.tensor([[0, 1, 1, 2]] * 2)), past_key_values=cache,
                          use_cache=True)
        return [first.logits, *first.taps, tree.logits, *tree.taps]

    calls = []
    over_qkv = cpu_attention.AttentionCall.over_qkv

    def counted(*args):  # the forward's in-place attention, its calls counted
        call = over_qkv(*args)
        return None if call is None else lambda *pointers: calls.append(1) or call(*pointers)

    monkeypatch.setattr(cpu_attention.AttentionCall, "over_qkv", counted)
    halves = run()
    # the tree verify (after the first forward, which allocates the cache) attends in place, from
    # q/k/v rows, where the AVX2 attention takes the head size
    in_place = target.fused.head_dim % 32 == 0
    assert len(calls) == target.num_layers * in_place
    for layer in target.fused.layers:
        monkeypatch.setattr(layer, "halves", None)
    for got, want in zip(halves, run(), strict=True):
        assert torch.equal(got, want)
    assert len(calls) == target.num_layers * in_place


def test_fused_layers_hold_one_packed_copy_and_plain_weights_runs_the_model(tiny_llama_dir, monkeypatch):
    from torch import nn

    plain = TargetAdapter.from_pretrained(tiny_llama_dir)
    fused = TargetAdapter.from_pretrained(tiny_llama_dir, pack_weights=True)
    num_linears = sum(type(m) is nn.Linear for m in plain.model.modules())
    assert fused.packed.num_packed + fused.fused.num_fused == num_linears
    attention = fused.model.model.layers[0].self_attn
    assert type(attention.q_proj) is nn.Linear  # its packed copy is the fused one
    assert set(fused.model.state_dict()) == set(plain.model.state_dict())
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = fused(ids, [2]).logits
        monkeypatch.setattr(FusedDecoder, "forward", lambda *a, **k: pytest.fail("plain() ran the fused forward"))
        with fused.plain_weights():  # the model's own forward, as transformers runs it
            torch.testing.assert_close(fused(ids, [2]).logits, want, atol=1e-4, rtol=1e-4)


def test_models_it_cannot_run_keep_their_own_forward(tiny_llama_dir):
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mistral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16))
    model.requires_grad_(False)
    assert unsupported_reason(model, pack_linears(model)) == "it uses sliding-window attention"
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2,
                                                                  vocab_size=64))
    assert "GPT2LMHeadModel is not one of" in unsupported_reason(gpt2, None)
    unpacked = TargetAdapter.from_pretrained(tiny_llama_dir)
    assert unsupported_reason(unpacked.model, None) == "its linear layers are not packed"
    assert unpacked.fused is None


def test_a_model_with_forward_hooks_runs_its_own_forward(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir, pack_weights=True)
    calls = []
    handle = target.model.register_forward_hook(lambda module, args, output: calls.append(output.logits.shape))
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        hooked = target(ids, [1]).logits
        handle.remove()
        fused = target(ids, [1]).logits
    assert calls == [(1, 5, 256)]  # the hook saw the first call, the fused forward ran the second
    torch.testing.assert_close(fused, hooked, atol=1e-4, rtol=1e-4)
