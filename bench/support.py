"""Small helpers the bench's parts share (the bench itself, the GPU suite in bench/gpu/, the
tools in bench/tools/): wall-clock and CUDA-event timers, a free local port for the servers a
bench starts, the samples of a server's Prometheus /metrics text, and random draft trees."""

from __future__ import annotations

import socket
import statistics
import time

import torch


def wall_s(fn, device: torch.device):
    """(fn(), wall seconds with the device synchronised on both sides)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    begin = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - begin


def time_ms(fn, device: torch.device, warmup: int, repeats: int, inner: int = 1) -> float:
    """Median milliseconds per fn() call over `repeats` runs of `inner` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type != "cuda":
            samples.append(wall_s(lambda: [fn() for _ in range(inner)], device)[1] * 1e3 / inner)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the servers the bench starts bind it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus exposition text (a server's
    /metrics), read by prometheus_client's own parser; counters keep their `_total` names."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text) for sample in family.samples]


def random_tree_mask(num_tree: int, generator: torch.Generator) -> torch.Tensor:
    """[T, T] bool ancestor mask (self included) of a random tree; node 0 is the root."""
    parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, num_tree)]
    mask = torch.eye(num_tree, dtype=torch.bool)
    for node in range(1, num_tree):  # a parent comes before its children
        mask[node] |= mask[parents[node]]
    return mask


def weight_read_bytes(model) -> int:
    """Bytes a forward reads in weights: every parameter but the input embedding (one row per token)."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()) - embedding.numel() * embedding.element_size()


def kv_read_bytes(config, batch: int, keys: int, element_size: int = 2) -> int:
    """Bytes of K and V a forward reads over `keys` positions in each of `batch` rows."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * batch * config.num_hidden_layers * config.num_key_value_heads * head_dim * keys * element_size
