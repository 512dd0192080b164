"""What the server's routes share: its configuration (`ServeConfig`) and state
(`ServerState`: the model, loaded in a background thread, and the engine worker).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Callable

from specheads.serving.server.metrics import ServerMetrics
from specheads.serving.server.reasoning import PARSERS as REASONING_PARSERS
from specheads.serving.server.worker import Engine, Event, Job

log = logging.getLogger("specheads.serve")


@dataclass
class ServeConfig:
    model_name: str
    model_root: str | None = None  # what /v1/models names as the model's `root` (the target; default: model_name)
    api_key: str | None = None
    max_concurrency: int = 8  # sequences decoded together
    max_queue: int = 64  # requests waiting for admission before 503
    max_model_len: int | None = None  # default: the target's max_position_embeddings
    max_body_bytes: int = 1 << 20
    request_timeout_s: float | None = 600.0
    public_metrics: bool = False  # /metrics without the API key
    chat_template: str | None = None  # overrides the tokenizer's
    reasoning_parser: str | None = None  # chat replies: split reasoning_content off (serving/server/reasoning.py)
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("max_concurrency", "max_body_bytes", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {self.request_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to serve without auth)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")  # what a request's unset fields take from the target
NOT_APPLIED = ("repetition_penalty", "min_p")  # what vLLM takes too, and this engine does not implement


def default_sampling(generation_config) -> dict:
    """The sampling fields a request leaves unset, as vLLM fills them by default
    (`--generation-config auto`): the values the target's generation_config.json sets away from
    transformers' defaults (its to_diff_dict), e.g. temperature 0.6 and top_p 0.9 for Llama 3.1.
    Its repetition_penalty and min_p, which vLLM applies too, are not implemented here: logged."""
    if generation_config is None:
        return {}
    diff = generation_config.to_diff_dict()
    skipped = {name: diff[name] for name in NOT_APPLIED if name in diff and diff[name] not in (1.0, 0.0, None)}
    if skipped:
        log.warning("the target's generation_config sets %s, which vLLM applies by default; this server does not "
                    "implement them, so requests sample without", skipped)
    return {name: diff[name] for name in SAMPLING_DEFAULTS if diff.get(name) is not None}


@dataclass
class ServerState:
    """Everything the routes share. `status`: "loading" | "ready" | "failed"."""
    config: ServeConfig
    loader: Callable[[], tuple]  # -> (SpeculativeDecoder, tokenizer)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    status: str = "loading"
    error: str | None = None
    draining: bool = False
    engine: Engine | None = None
    tokenizer: object = None
    max_model_len: int = 0
    vocab_size: int = 0
    eos_token_id: int | None = None
    default_sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k from the generation_config
    # requests being answered (event-loop side; weak: a response that never started leaves none behind)
    jobs: weakref.WeakSet[Job] = field(default_factory=weakref.WeakSet)
    cut_off: bool = False  # the shutdown's grace period has ended: requests still running get a 503
    on_failed: Callable[[], None] | None = None  # called when loading fails (serve: stop the server)

    def load(self) -> None:
        """Load the model and start the engine (runs in a background thread). A failure is
        logged in one line (its traceback at debug level), reported by /health, and handed to
        `on_failed`: `specheads serve` then stops and exits non-zero, as vLLM does."""
        try:
            decoder, tokenizer = self.loader()
            limit = int(getattr(decoder.target.config, "max_position_embeddings", 0) or 0)
            wanted = self.config.max_model_len
            if wanted is not None and limit and wanted > limit:
                raise ValueError(f"--max-model-len {wanted} exceeds the target's max_position_embeddings ({limit})")
            self.max_model_len = wanted or limit or 2048
            self.vocab_size = int(decoder.target.config.vocab_size)
            self.eos_token_id = tokenizer.eos_token_id
            self.default_sampling = default_sampling(getattr(decoder.target.model, "generation_config", None))
            if self.config.chat_template is not None:
                tokenizer.chat_template = self.config.chat_template
            self.tokenizer = tokenizer
            engine = Engine(decoder, tokenizer, self.metrics, self.config.max_concurrency, self.config.max_queue)
            engine.start()
            self.engine = engine
            self.status = "ready"
            log.info("model %s ready (max_model_len %d)", self.config.model_name, self.max_model_len)
        except Exception as err:  # noqa: BLE001 - reported through /health and on_failed, never raised into uvicorn
            self.error = f"{type(err).__name__}: {err}"
            self.status = "failed"
            log.error("loading the model failed: %s", self.error)
            log.debug("loading the model failed", exc_info=True)
            if self.on_failed is not None:
                self.on_failed()

    def cut_off_in_flight(self) -> int:
        """The grace period is over: answer every request still running with a 503 and drop its
        work (event-loop thread) -> how many there were."""
        self.cut_off = True
        jobs = [job for job in self.jobs if not job.done]
        for job in jobs:
            job.cancel("shutting_down")
            job.events.put_nowait(Event("error", status=503, code="shutting_down",
                                        message="the server shut down before this request finished "
                                                "(its shutdown grace period ended); retry on another replica"))
        return len(jobs)

    @property
    def healthy(self) -> bool:
        return self.status == "ready" and self.engine is not None and self.engine.healthy and not self.draining
