"""`specheads serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    specheads serve --target T [--heads H] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                    [--max-concurrency N] [--max-queue N] [--max-model-len N] [--lookup-num-tokens N] [--store DIR]
                    [--device auto|cpu|cuda[:N]] [--enforce-eager]

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics (Prometheus).
The server starts listening at once and loads the model in the background (/health
answers 503 until it is ready). Ctrl-C / SIGTERM drains: new requests get 503, in-flight
ones finish for up to --graceful-timeout seconds, and those still running then get a 503
with an OpenAI error body (a stream: an error event, then `data: [DONE]`). The process then
exits 0; a second Ctrl-C stops without waiting. How requests are validated, scheduled and
answered: serving/server/app.py. On a CUDA device (the default when torch sees a GPU) every
verify forward replays a CUDA graph with the tree-attention kernel, unless --enforce-eager.
"""

from __future__ import annotations

import os
from pathlib import Path

from specheads.errors import UserError
from specheads.options import add_device_options, add_lookup_option, add_store_option, apply_device_options
from specheads.runner import DTYPE_HELP, HEADS_HELP, TARGET_HELP


def add_parser(subparsers) -> None:
    from specheads.serving.server.reasoning import PARSERS as REASONING_PARSERS  # imports nothing heavy

    p = subparsers.add_parser("serve", help="serve the target (+ heads) over an OpenAI-compatible HTTP API")
    p.add_argument("--target", required=True,
                   help=TARGET_HELP)
    p.add_argument("--heads", help=HEADS_HELP + "; omit to serve with plain decoding")
    add_lookup_option(p, old="--lookup")
    add_store_option(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $SPECHEADS_API_KEY, else no auth)")
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--max-concurrency", type=int, default=8, help="sequences decoded together (the batch)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a batch slot before 503")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens limit (default: the target's max_position_embeddings)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request gets 504")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/Ctrl-C; those still running "
                        "then get a 503 (streams: an error event, then [DONE]); the exit status is 0")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --target)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (default: the tokenizer's; without one, specheads' documented fallback)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a chat reply's <think>...</think> into message.reasoning_content (a stream's "
                        "delta.reasoning_content), as vLLM's and SGLang's parsers of these names do: qwen3 (a reply "
                        "that opens with <think>) or deepseek_r1 (the template opened it); default: no split")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    add_device_options(p)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's); 1 avoids oversubscription on a shared machine")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's and the server's log level")


def run(args) -> int:
    from specheads.heads.artefacts.heads_dir import read_heads_config
    from specheads.runner import check_target_name, load_decoder
    from specheads.serving.server.server import serve
    from specheads.serving.server.state import ServeConfig

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.graceful_timeout <= 0:
        raise UserError(f"--graceful-timeout must be > 0 seconds, got {args.graceful_timeout}")
    chat_template = None
    if args.chat_template is not None:
        if not os.path.isfile(args.chat_template):
            raise UserError(f"--chat-template {args.chat_template!r} is not a file")
        with open(args.chat_template, encoding="utf-8") as handle:
            chat_template = handle.read()
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECHEADS_API_KEY") or None
    for flag, value, minimum in (("--max-concurrency", args.max_concurrency, 1), ("--max-queue", args.max_queue, 0),
                                 ("--max-model-len", args.max_model_len, 2), ("--max-body-bytes", args.max_body_bytes, 1),
                                 ("--lookup-num-tokens", args.lookup_num_tokens, 0)):
        if value is not None and value < minimum:
            raise UserError(f"{flag} must be >= {minimum}, got {value}")
    apply_device_options(args)
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise UserError(f"--torch-threads must be >= 1, got {args.torch_threads}")
        import torch

        torch.set_num_threads(args.torch_threads)
    if args.request_timeout <= 0:
        raise UserError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.heads is not None:  # a directory or a Hub id (fetched into the Hub cache)
        try:
            read_heads_config(args.heads)
        except (FileNotFoundError, ValueError) as err:
            raise UserError(f"--heads: {err}") from err
    check_target_name(args.target)  # before the server listens: a bad --target exits 2, as a bad --heads does
    root = str(Path(args.target).resolve()) if Path(args.target).exists() else args.target  # as regenerate records it
    config = ServeConfig(model_name=args.served_model_name or args.target, model_root=root, api_key=api_key,
                         max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                         max_model_len=args.max_model_len, max_body_bytes=args.max_body_bytes,
                         request_timeout_s=args.request_timeout, public_metrics=args.public_metrics,
                         chat_template=chat_template, reasoning_parser=args.reasoning_parser)

    def loader():
        decoder, tokenizer = load_decoder(args.target, args.heads, dtype=args.dtype, device=args.device,
                                          trust_remote_code=args.trust_remote_code, progress=False,
                                          lookup_num_tokens=args.lookup_num_tokens, cuda_graphs=args.cuda_graphs,
                                          store=args.store)
        if chat_template is None:
            # The same documented fallback that training renders chats with (data/chat.py),
            # so chat requests to a template-less target see the format the heads were trained on.
            from specheads.data.chat import ensure_chat_template

            ensure_chat_template(tokenizer)
        return decoder, tokenizer

    state = serve(config, loader, host=args.host, port=args.port, graceful_timeout_s=args.graceful_timeout,
                  log_level=args.log_level)
    if state.status == "failed":  # the server stopped itself; vLLM exits non-zero here too
        raise UserError(f"the model did not load, so the server stopped: {state.error}")
    return 0
