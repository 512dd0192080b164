"""generate_many (serving/decode/generate.py): many prompts through one continuous batch, as
offline data generation runs them. Each prompt gets what it would alone (greedy, or sampled
with its own seed); a conversation's next turn continues its row's cached context; with
prefill_group > 1 (a GPU's default) new rows wait for a group and prefill together in one
left-padded forward. The prompts, references and decoders are test_batch.py's.
"""

from __future__ import annotations

import pytest

from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.generate import generate
from specheads.serving.decode.trees import DraftTree

from test_batch import (MAX_NEW, PROMPT_LENGTHS, TREE_PATHS, MultiOracle, decoders, hf_greedy,  # noqa: F401
                        setup)


def test_generate_many_gives_each_prompt_its_own_greedy_output_in_order(setup):
    from specheads.serving.decode.generate import generate_many

    target, prompts, references, _ = setup
    finished = []
    results = generate_many(SpeculativeDecoder(target), prompts, max(MAX_NEW), max_batch_size=4,
                            on_result=lambda index, result: finished.append(index))
    assert sorted(finished) == list(range(len(prompts)))
    for prompt, reference, result, max_new in zip(prompts, references, results, MAX_NEW):
        assert result.tokens[:max_new] == reference  # the same greedy run, only longer
        assert len(result.tokens) == max(MAX_NEW) and result.finish_reason == "length"
    # EOS ends a sequence early, and its row takes the next prompt at once.
    eos = references[0][2]
    results = generate_many(SpeculativeDecoder(target), prompts[:1] * 3, 10, eos, max_batch_size=2)
    assert all(r.tokens == references[0][:3] and r.finish_reason == "stop" for r in results)
    assert generate_many(SpeculativeDecoder(target), [], 4) == []
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        generate_many(SpeculativeDecoder(target), prompts, 4, max_batch_size=0)


def test_generate_many_samples_a_prompt_as_it_would_alone(setup):
    """sampling[i] decodes prompt i as `generate` samples it alone with the same seed; None is greedy."""
    from specheads.serving.decode.generate import generate_many
    from specheads.serving.decode.sampling import SamplingParams

    target, prompts, references, _ = setup
    decoder = SpeculativeDecoder(target)
    sampling = [SamplingParams(temperature=1.0, seed=11), None, SamplingParams(temperature=1.0, seed=12)]
    results = generate_many(decoder, prompts[:3], 8, max_batch_size=2, sampling=sampling)
    assert results[1].tokens == references[1][:8]  # greedy
    for i in (0, 2):
        assert results[i].tokens == generate(decoder, prompts[i], 8, sampling=sampling[i]).tokens
    assert results[0].tokens != generate_many(decoder, prompts[:1], 8, sampling=[
        SamplingParams(temperature=1.0, seed=13)])[0].tokens  # another seed, another draw
    with pytest.raises(ValueError, match="one SamplingParams \\(or None\\) per prompt: 1 for 3 prompts"):
        generate_many(decoder, prompts[:3], 4, sampling=sampling[:1])


def test_generate_many_continues_a_conversation_in_its_row(setup):
    """A follow-up that repeats its turn's context prefills only what it adds, and decodes
    what it would alone; one that departs from the context early keeps only what they share."""
    from specheads.serving.decode.generate import generate_many

    target, prompts, _, _ = setup
    firsts, follow_ups = prompts[:3], {}

    def next_turn(index, result):
        if index >= len(firsts):
            return None
        context = firsts[index] + result.tokens
        prompt = [context[0] + 1] + context[1:] + [5, 6] if index == 1 else context + [5, 6, 9][:index + 1]
        follow_ups[len(firsts) + len(follow_ups)] = (prompt, len(context) - 1 if index != 1 else 0)
        return prompt

    results = generate_many(SpeculativeDecoder(target), firsts, 6, max_batch_size=2, on_result=next_turn,
                            max_prompt_len=64)
    assert len(results) == 2 * len(firsts)
    for index, (prompt, reused) in follow_ups.items():
        assert results[index].tokens == hf_greedy(target, prompt, 6)
        assert results[index].stats.prefill_reused_tokens == reused
    assert all(result.stats.prefill_reused_tokens == 0 for result in results[:len(firsts)])


def test_a_medusa_conversation_continues_after_a_step_cut_by_max_new_tokens(setup):
    """Heads that always match accept three tokens a step, so max_new_tokens (4: the prefill's
    token, then a step of 4) cuts accepted tokens whose entries the row already holds; the next
    turn keeps exactly the context it repeats and decodes what it would alone."""
    from specheads.serving.decode.generate import generate_many

    target, prompts, _, long = setup
    decoder = SpeculativeDecoder(target, MultiOracle(target, long, PROMPT_LENGTHS), DraftTree.from_paths(TREE_PATHS))
    follow_ups = {}

    def next_turn(index, result):
        if index >= 2:
            return None
        context = prompts[index] + result.tokens
        follow_ups[2 + len(follow_ups)] = (context + [5, 6], len(context))
        return context + [5, 6]

    results = generate_many(decoder, prompts[:2], 4, max_batch_size=2, on_result=next_turn, max_prompt_len=64)
    assert all(result.stats.accepted_tokens >= 3 for result in results[:2])  # the cut happened
    for index, (prompt, context_len) in follow_ups.items():
        assert results[index].stats.prefill_reused_tokens == context_len  # every token it emitted has its entry
        assert results[index].tokens == hf_greedy(target, prompt, 4)


def test_an_eagle_conversation_continues_its_row_with_the_head_cache_it_would_build(setup):
    """An EAGLE drafter keeps the head's own cache over every committed position, so a next
    turn that continues the row keeps the head's rows of the context it repeats: after its
    prefill the head's cache and feature equal the head run over the whole new prompt at once
    (where the context changes right after the kept prefix, one more position is rerun: the
    head's row there read the token after it); and it decodes what it would alone."""
    import torch

    from specheads.serving.decode.engine import BatchEngine
    from specheads.serving.decode.sequence import SequenceRequest
    from specheads.serving.decode.steps import Prefilled

    target, prompts, _, long = setup
    decoder = decoders(target, prompts, long)["eagle3-static"]
    engine = BatchEngine(decoder, max_batch_size=2, max_cache_len=96)
    for changed in (False, True):
        first = engine.check(SequenceRequest(prompts[0], 6))
        engine.add(first)
        while first.finish_reason is None:
            engine.step()
        context = prompts[0] + first.tokens
        prompt = context[:-2] + [context[-2] + 1, 7] if changed else context + [5, 6]
        turn = engine.check(SequenceRequest(prompt, 4))
        reused = engine.reusable_prefix(first, turn)
        assert reused == (len(context) - 3 if changed else len(context) - 1)
        engine.add(turn, continues=first)
        assert turn.stats.prefill_reused_tokens == reused
        drafter, row = engine.device_step.heads, engine.rows.index(turn)
        kept = drafter.kv_BHMD[:, :, row, :, :len(prompt)].clone(), drafter.feature_BH[row].clone()
        with torch.inference_mode():
            taps = torch.cat(target(torch.tensor([prompt]), decoder.tap_layers).taps, dim=-1)[0]
            drafter.start(1 - row, Prefilled(prompt_P=torch.tensor(prompt), start=0, root=torch.tensor(turn.tokens),
                                             taps=taps, logits=None))  # the whole prompt, in the other row
        torch.testing.assert_close(kept[0], drafter.kv_BHMD[:, :, 1 - row, :, :len(prompt)], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kept[1], drafter.feature_BH[1 - row], atol=1e-3, rtol=1e-3)
        while turn.finish_reason is None:
            engine.step()
        assert turn.tokens == generate(decoder, prompt, 4).tokens
        engine.remove(turn)


@pytest.mark.parametrize("kind", ["plain", "medusa-oracle", "eagle3-dynamic"])
def test_grouped_prefills_give_each_prompt_and_follow_up_its_own_output(setup, kind, monkeypatch):
    """prefill_group > 1 (a GPU's default): new prompts and follow-ups wait for that many free
    rows, then prefill together in one left-padded forward; a follow-up prefills its whole
    context in a new row. Every output is still the target's greedy output for it alone."""
    import specheads.serving.decode.engine as engine_module
    from specheads.serving.decode.generate import generate_many

    target, prompts, references, long = setup
    groups = []

    def spy(target, group, *args):
        groups.append([int(prompt.shape[1]) for prompt in group])
        return prefill_many(target, group, *args)

    prefill_many = engine_module.prefill_many
    monkeypatch.setattr(engine_module, "prefill_many", spy)
    follow_ups = {}

    def next_turn(index, result):
        if index >= len(prompts) or index % 2:
            return None
        follow_ups[len(prompts) + len(follow_ups)] = prompts[index] + result.tokens + [5, 6]
        return follow_ups[len(prompts) + len(follow_ups) - 1]

    results = generate_many(decoders(target, prompts, long)[kind], prompts, 5, max_batch_size=4,
                            on_result=next_turn, max_prompt_len=64, prefill_group=2)
    assert [result.tokens for result in results[:len(prompts)]] == [reference[:5] for reference in references]
    assert len(follow_ups) == 3 and len(results) == len(prompts) + 3
    for index, prompt in follow_ups.items():
        assert results[index].tokens == hf_greedy(target, prompt, 5)
        assert results[index].stats.prefill_reused_tokens == 0
    # The first four rows in one forward (left-padded to 17); then two follow-ups first, with the
    # last two prompts; the last follow-up, alone at the end, in a prefill of its own.
    assert groups == [PROMPT_LENGTHS[:4], [10, 15] + PROMPT_LENGTHS[4:]]


def test_grouped_prefills_sample_as_alone_and_refuse_a_bad_group_size(setup):
    from specheads.serving.decode.generate import generate_many
    from specheads.serving.decode.sampling import SamplingParams

    target, prompts, references, _ = setup
    decoder = SpeculativeDecoder(target)
    sampling = [SamplingParams(temperature=1.0, seed=11), None, SamplingParams(temperature=1.0, seed=12)]
    # Also through the static-shape verify that CUDA graphs capture (self-instruct's path on a GPU).
    for grouped in (decoder, SpeculativeDecoder(target, cuda_graphs="eager", attn_impl="tree")):
        results = generate_many(grouped, prompts[:3], 8, max_batch_size=3, sampling=sampling, prefill_group=3)
        assert results[1].tokens == references[1][:8]
        for i in (0, 2):
            assert results[i].tokens == generate(decoder, prompts[i], 8, sampling=sampling[i]).tokens
    with pytest.raises(ValueError, match="prefill_group must be in \\[1, max_batch_size=3\\], got 4"):
        generate_many(decoder, prompts[:3], 4, max_batch_size=3, prefill_group=4)
