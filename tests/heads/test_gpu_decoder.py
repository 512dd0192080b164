"""The GPU decoder (heads/target/gpu_decoder.py) computes what the model's own forward computes, eager
and compiled (torch.compile runs on the CPU too): logits, taps and cache with and without a
cache, padding masks, logits_to_keep and a tree verify over the engine's static-shape
TreeStaticCache (a 4-D mask, or the tree attention with device prefix lengths, as a CUDA-graph
verify passes them), for Llama, Qwen2 (biases) and Qwen3 (q/k norms). The compiled forward
compiles once for every token count > 1; the engine with it on everything is lossless.
The adapter builds it only where asked; models it cannot run keep their own forward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from specheads.heads.target import gpu_decoder
from specheads.heads.target.gpu_decoder import GpuDecoder, unsupported_reason
from specheads.heads.target.adapter import GPU_DECODER_ENV, TargetAdapter, gpu_decoder_mode
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.kernels.tree_attention import pack_tree_mask, use_tree_attention

from conftest import make_tiny_model
from test_cpu_decoder import assert_within_rounding


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    directory = make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), seed=2)
    model = AutoModelForCausalLM.from_pretrained(directory)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # q and k norms start at ones: make them matter
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return directory


def _compare(model_dir, dtype, mode: str, case) -> None:
    """`case(target)` -> tensors, on the model's own forward in fp32 and in `dtype` and on the
    GPU decoder in `dtype`, held to test_cpu_decoder's tolerances."""
    reference = case(TargetAdapter.from_pretrained(model_dir, dtype=torch.float32))
    own = case(TargetAdapter.from_pretrained(model_dir, dtype=dtype))
    fused_target = TargetAdapter.from_pretrained(model_dir, dtype=dtype, gpu_decoder=mode)
    assert fused_target.gpu is not None and fused_target.layout == f"fused-{mode}"
    assert_within_rounding(reference, own, case(fused_target), dtype)


def _prompt_cases(target):
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    taps = [0, 1, target.num_layers]
    with torch.inference_mode():
        whole = target(ids, taps)  # the whole prompt, no cache
        cache = DynamicCache(config=target.config)  # prefill, then two tokens keeping one logit row
        target(ids[:, :20], [], past_key_values=cache, use_cache=True)
        cached = target(ids[:, 20:22], [target.num_layers], past_key_values=cache, use_cache=True, logits_to_keep=1)
        assert cached.logits.shape == (2, 1, 256) and cached.past_key_values is cache
        mask = torch.ones_like(ids)  # left padding: a 2-D mask
        mask[1, :5] = 0
        padded = target(ids, [], attention_mask=mask).logits
    return [whole.logits, *whole.taps, cached.logits, cached.taps[0], cache.layers[0].keys, padded[0], padded[1, 5:]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_forward_matches_the_model(arch, dtype, request):
    _compare(request.getfixturevalue(f"tiny_{arch}_dir"), dtype, "eager", _prompt_cases)


TREE_MASK_TT = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


def _tree_cases(target, attention: str):
    """A verify step as serving/decode/graphs.py runs it: a static-shape TreeStaticCache of two
    rows of unequal lengths, explicit positions, and either the 4-D mask or the tree attention
    with device prefix lengths and their bound (no host sync)."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (1, n), generator=generator) for n in (12, 7)]
    tree_ids = torch.randint(3, 256, (2, 4), generator=generator)
    with torch.inference_mode():
        cache = TreeStaticCache(target.config, max_cache_len=32, batch_size=2, static_shape=True)
        for row, prompt in enumerate(prompts):
            cache.set_rows(row, row + 1)
            target(prompt, [], past_key_values=cache, use_cache=True)
            cache.commit()
        cache.set_rows(0, 2)
        positions = cache.position_ids(TREE_MASK_TT.sum(dim=1) - 1)
        if attention == "tree":
            use_tree_attention(target.model)
            kwargs = dict(tree_mask=pack_tree_mask(TREE_MASK_TT), prefix_len=cache.lengths.active_device,
                          max_prefix_len=cache.max_cache_len - 4)
        else:
            kwargs = dict(attention_mask=cache.attention_mask(TREE_MASK_TT))
        out = target(tree_ids, [1, 2], position_ids=positions, past_key_values=cache, use_cache=True, **kwargs)
    return [out.logits, *out.taps]


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("attention", ["sdpa", "tree"])
def test_tree_verify_in_the_static_cache_matches_the_model(mode, attention, tiny_llama_dir):
    _compare(tiny_llama_dir, torch.float32, mode, lambda target: _tree_cases(target, attention))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_compiled_forward_matches_the_model(arch, request):
    _compare(request.getfixturevalue(f"tiny_{arch}_dir"), torch.float32, "compile", _prompt_cases)


def test_compiled_forward_compiles_once_for_every_token_count(tiny_llama_dir):
    """One graph per function for one token, one (dynamic) for every other count: the engine's
    tree-size buckets and batch sizes reuse it, and each layer calls the same graphs."""
    import torch._dynamo

    torch._dynamo.reset()
    target = TargetAdapter.from_pretrained(tiny_llama_dir, gpu_decoder="compile")
    cache = TreeStaticCache(target.config, max_cache_len=96, batch_size=1, static_shape=True)
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        target(ids[:, :16], [1], past_key_values=cache, use_cache=True)
        cache.commit()
        first = list(target.gpu.compiles)
        assert len(first) == 1 and first[0]["graphs"] == len(gpu_decoder.FUNCTIONS) and first[0]["seconds"] > 0
        for num_new in (2, 4, 8, 32):  # other token counts: no new graph
            target(ids[:, 16:16 + num_new], [], past_key_values=cache, use_cache=True)
        assert target.gpu.compiles == first
        target(ids[:, 16:17], [], past_key_values=cache, use_cache=True)  # one token: its own graphs, once
        target(ids[:, 17:18], [], past_key_values=cache, use_cache=True)
    assert len(target.gpu.compiles) == 2 and target.gpu.compiles[1]["tokens"] == 1
    assert target.gpu.compile_seconds == pytest.approx(sum(c["seconds"] for c in target.gpu.compiles))


def test_weights_are_held_once_and_plain_weights_runs_the_model(tiny_llama_dir, monkeypatch):
    plain = TargetAdapter.from_pretrained(tiny_llama_dir)
    fused = TargetAdapter.from_pretrained(tiny_llama_dir, gpu_decoder="eager")
    attention, mlp = fused.model.model.layers[0].self_attn, fused.model.model.layers[0].mlp
    qkv, gate_up = fused.gpu.layers[0].head[1], fused.gpu.layers[0].tail[3]
    assert qkv.shape == (attention.q_proj.out_features + 2 * attention.k_proj.out_features,
                         attention.q_proj.in_features)
    for module, fused_weight in [(attention.q_proj, qkv), (attention.k_proj, qkv), (attention.v_proj, qkv),
                                 (mlp.gate_proj, gate_up), (mlp.up_proj, gate_up)]:
        assert module.weight.untyped_storage().data_ptr() == fused_weight.untyped_storage().data_ptr()
    for name, tensor in plain.model.state_dict().items():  # the model's own weights are unchanged
        torch.testing.assert_close(fused.model.state_dict()[name], tensor, atol=0, rtol=0)
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = fused(ids, [2]).logits
        monkeypatch.setattr(GpuDecoder, "forward", lambda *a, **k: pytest.fail("plain_weights() ran the GPU decoder"))
        with fused.plain_weights():
            torch.testing.assert_close(fused(ids, [2]).logits, want, atol=1e-5, rtol=1e-5)
    assert fused.gpu.active


def test_weights_moved_after_the_build_fail_clearly(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir, gpu_decoder="eager")
    target.model.to(torch.float64)
    with pytest.raises(RuntimeError, match="build the TargetAdapter after moving the model"):
        target(torch.tensor([[3, 4, 5]]), [])


def test_models_it_cannot_run_keep_their_own_forward(tiny_llama_dir):
    mistral = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mistral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16))
    assert unsupported_reason(mistral) == "it uses sliding-window attention"
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2,
                                                                  vocab_size=64))
    assert "GPT2LMHeadModel is not one of" in unsupported_reason(gpt2)
    target = TargetAdapter.from_pretrained(tiny_llama_dir)

    class Wrapped(nn.Linear):  # what a quantized or adapter-wrapped layer looks like
        pass

    layer = target.model.model.layers[1].mlp
    layer.down_proj = Wrapped(layer.down_proj.in_features, layer.down_proj.out_features, bias=False)
    assert unsupported_reason(target.model) == \
        "layer 1 has a Wrapped, not a plain nn.Linear (PEFT-wrapped or quantized)"
    assert TargetAdapter(target.model, gpu_decoder="compile").gpu is None


def test_the_adapter_builds_it_where_asked(tiny_llama_dir, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert gpu_decoder_mode(None, "auto", cpu) == "off"  # a CPU target packs instead
    assert gpu_decoder_mode(None, False, cuda) == "off"  # training: the model's own forward
    assert gpu_decoder_mode(None, "auto", cuda) == "compile"  # inference on a GPU: on by default
    monkeypatch.setenv(GPU_DECODER_ENV, "off")
    assert gpu_decoder_mode(None, "auto", cuda) == "off"
    monkeypatch.setenv(GPU_DECODER_ENV, "fast")
    with pytest.raises(ValueError, match="SPECHEADS_GPU_DECODER must be one of"):
        gpu_decoder_mode(None, True, cuda)
    assert gpu_decoder_mode("eager", False, cpu) == "eager"
    with pytest.raises(ValueError, match="gpu_decoder must be one of"):
        gpu_decoder_mode("cuda-graphs", False, cpu)
    assert TargetAdapter.from_pretrained(tiny_llama_dir, pack_weights="auto").gpu is None
    with pytest.raises(ValueError, match="needs an unpacked target"):
        TargetAdapter.from_pretrained(tiny_llama_dir, pack_weights=True, gpu_decoder="eager")


def test_engine_with_the_compiled_forward_is_lossless(tiny_llama_dir):
    """fp32 greedy through the engine with everything on: the compiled forward, the tree
    attention kernel (interpreted) and the static-shape verify that CUDA graphs capture (run
    eagerly here), a batch of unequal prompts with oracle heads: equal to HF greedy per prompt."""
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.trees import DraftTree

    from test_batch import NUM_HEADS, MultiOracle, TREE_PATHS, greedy_requests, hf_greedy, run_session

    target = TargetAdapter.from_pretrained(tiny_llama_dir, gpu_decoder="compile")
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 13, 9)]
    max_new = [12, 9, 14]
    with target.plain_weights():
        references = [hf_greedy(target, p, m) for p, m in zip(prompts, max_new)]
        long = [p + hf_greedy(target, p, m + NUM_HEADS + 2) for p, m in zip(prompts, max_new)]
    oracle = MultiOracle(target, long, [len(p) for p in prompts])
    decoder = SpeculativeDecoder(target, oracle, DraftTree.from_paths(TREE_PATHS), fallback=None, attn_impl="tree",
                                 cuda_graphs="eager")
    tokens, results, batched_steps = run_session(decoder, greedy_requests(prompts, max_new), max_batch_size=3)
    assert tokens == references and batched_steps > 0
    assert sum(result.stats.accepted_tokens for result in results) > 0  # multi-token paths were verified
