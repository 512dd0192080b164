"""Serving: speculative decoding with trained heads, and an OpenAI-compatible server for it.

Three parts; imports go one way, server -> decode -> kernels (tests/serving/test_layout.py):

decode/    the decode loop and its parts. A single request is a batch of one.
    config.py     SpeculativeDecoder: validated, typed configuration (target, drafter, tree,
                  attention, fallback policy, lookup, reply store); runs nothing. The parser of a heads
                  directory's `tree` field (TreeSpec)
    engine.py     BatchEngine: one step = draft -> verify -> accept -> commit -> record over
                  every sequence, one target forward; fault isolation per sequence
    sequence.py   SequenceRequest and Sequence: a request and its state inside the engine
    generate.py   generate / stream: one request through the engine
    scheduler.py  Scheduler: admits, reports and retires requests around the engine (a server's worker)
    steps.py      prefill, verify, accept, emit: each step written once, batched
    medusa.py     Medusa drafting (one head call per batch) with AdaEDL's depth cut
    eagle.py      EAGLE drafting, static and EAGLE-2 dynamic trees through one level loop
    lookup.py     n-gram lookup drafts from the sequence's own context; the chain-source interface
    store.py      drafts from a store of the target's own replies (heads/artefacts/reply_store.py)
    trees.py      DraftTree and every constructor, TreePlan (with the greedy accept test),
                  Draft, the accepted-path rule, DynamicTreeConfig
    cache.py      TreeStaticCache: the target's preallocated KV cache, commit in place
    sampling.py   tree rejection sampling (lossless, temperature > 0), typical acceptance,
                  AdaEDL's bound
    fallback.py   FallbackPolicy, StepCosts and the decisions, each sequence's SpeculationWindow
    stats.py      DecodeStats, GenerationResult, and the one definition of alpha and tau
    faults.py     which errors end one sequence and which break the engine
kernels/   tree attention: the Triton kernels and their launch plan (triton_kernel.py), the
           custom operator torch.compile sees (custom_op.py), the PyTorch references and
           the transformers attention function (tree_attention.py)
server/    the HTTP server: app.py (FastAPI routes), state.py (its config and shared state),
           worker.py (the engine thread), json_body.py (the raw body to JSON), schema.py
           (request validation), responses.py (OpenAI response bodies), metrics.py
           (Prometheus), detokenize.py (token deltas to text), text_stream.py (one request's text deltas), server.py (uvicorn, shutdown),
           reasoning.py (a reply's reasoning split off, --reasoning-parser)
"""
