"""The OpenAI-compatible wire as `data regenerate --server` speaks it (data/remote_replies.py):
a --server value's base URL, the model the servers serve (and the target behind that name),
the sampling fields every request carries, a conversation's messages as sent (reasoning under
both of its names), a chat completion's reply and token count, and what a failed response
says (its message, whether the prompt did not fit, its Retry-After)."""

from __future__ import annotations

from specheads.data.chat import split_reasoning
from specheads.data.records import REASONING_KEY
from specheads.data.text import DataError

CONNECT_TIMEOUT_S = 10.0
CHAT_PATH, MODELS_PATH = "/v1/chat/completions", "/v1/models"

# Every sampling field a request could leave to the server, at the value that changes nothing.
# Servers fill an omitted field from the model's generation_config.json (vLLM by default,
# `--generation-config auto`; SGLang with `--sampling-defaults model`): a Qwen2.5 target would
# regenerate with its repetition_penalty 1.05 and a Qwen3 one with its top_k 20, replies the
# target does not give. top_k -1 is "off" for both (vLLM takes 0 or -1, SGLang and older vLLM
# refuse 0; `specheads serve` takes both).
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}


def server_url(url: str) -> str:
    """A --server value -> its base URL (a trailing / or /v1, as OpenAI clients take it, dropped)."""
    import httpx

    base = url.strip().rstrip("/").removesuffix("/v1").rstrip("/")
    try:
        parsed = httpx.URL(base)
    except httpx.InvalidURL as err:
        raise DataError(f"--server {url!r} is not a URL ({err}); expected one like http://127.0.0.1:8000") from err
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise DataError(f"--server {url!r}: expected an http:// or https:// URL such as http://127.0.0.1:8000")
    return base


def served_model(urls: list[str], model: str | None, headers: dict) -> tuple[str, str, list[str]]:
    """Ask each server's GET /v1/models -> (the model to request, the target behind it, the URLs
    that did not answer). --target (model) must be served by every server that answers; without
    it, the one model they serve. The target is the model entry's `root` (vLLM, SGLang and
    `specheads serve` put the served model's path or Hub id there), else its name; servers that
    serve one name from different roots are refused. A refused API key, or no server answering
    at all, is an error naming the URLs."""
    import httpx

    served, roots, down = {}, {}, {}
    with httpx.Client(timeout=CONNECT_TIMEOUT_S, headers=headers) as client:
        for url in urls:
            try:
                response = client.get(url + MODELS_PATH)
            except httpx.RequestError as err:
                down[url] = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                continue
            if response.status_code in (401, 403):
                raise DataError(f"server {url} refused the API key (HTTP {response.status_code} on GET {MODELS_PATH}); "
                                "pass the server's key with --api-key (or OPENAI_API_KEY)")
            if response.status_code != 200:
                down[url] = f"HTTP {response.status_code} on GET {MODELS_PATH}"
                continue
            try:
                entries = response.json()["data"]
                served[url] = [str(entry["id"]) for entry in entries]
                roots[url] = {str(entry["id"]): str(entry.get("root") or entry["id"]) for entry in entries}
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise DataError(f"server {url} is not an OpenAI-compatible server: GET {MODELS_PATH} answered "
                                f"{response.text[:120]!r}") from err
    if not served:
        raise DataError("no --server answered: " + "; ".join(f"{url} ({why})" for url, why in down.items()))
    if model is None:
        first_url, names = next(iter(served.items()))
        if len(names) != 1:
            raise DataError(f"server {first_url} serves {len(names)} models ({', '.join(names) or 'none'}); "
                            "pass --target with the one to use")
        model = names[0]
    for url, names in served.items():
        if model not in names:
            raise DataError(f"server {url} serves {', '.join(names) or 'no model'}, not {model!r}; pass --target "
                            "with the served model name (the server's --served-model-name)")
    targets = {url: names[model] for url, names in roots.items()}
    if len(set(targets.values())) > 1:
        raise DataError(f"the servers serve {model!r} from different models: "
                        + "; ".join(f"{url}: {root}" for url, root in targets.items())
                        + "; give servers of one target")
    return model, next(iter(targets.values())), list(down)


def wire_message(message: dict) -> dict:
    """A conversation's message as sent: an earlier reply's reasoning under both of its names
    (SGLang reads `reasoning_content`, vLLM `reasoning`)."""
    out = {"role": message["role"], "content": message["content"]}
    if message.get(REASONING_KEY):
        out[REASONING_KEY] = out["reasoning"] = message[REASONING_KEY]
    return out


def reply_of(body: dict) -> tuple[dict, int]:
    """A chat completion -> (the reply as an assistant message, its completion tokens); the
    reasoning apart (module doc), both stripped, as data/chat.py's reply_message writes it."""
    message = body["choices"][0]["message"]
    content = message.get("content") or ""
    reasoning = message.get(REASONING_KEY) or message.get("reasoning")
    if not isinstance(content, str) or not isinstance(reasoning, (str, type(None))):
        raise TypeError("content and reasoning must be strings")
    if not reasoning:
        reasoning, content = split_reasoning(content)
    reply = {"role": "assistant", "content": content.strip()}
    if reasoning and reasoning.strip():
        reply[REASONING_KEY] = reasoning.strip()
    usage = body.get("usage") or {}
    return reply, int(usage.get("completion_tokens") or 0)


def error_text(response) -> str:
    """The server's error message (OpenAI's {"error": {"message"}}, vLLM's older {"message"}),
    else the start of the body."""
    try:
        body = response.json()
        error = body.get("error", body)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    except (ValueError, AttributeError):
        return response.text[:300]


def too_long(status: int, text: str) -> bool:
    """A 400 that says the prompt and max_tokens do not fit the model's context."""
    lowered = text.lower()
    return status in (400, 413) and ("context length" in lowered or "context_length" in lowered
                                     or "maximum context" in lowered)


def retry_after(response) -> float | None:
    try:
        return float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
