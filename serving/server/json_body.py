"""A request's raw body to a JSON object, or a 400 that says what is wrong with it (not UTF-8,
not JSON, nested too deep, text that is not valid Unicode), before serving/server/schema.py
validates its fields."""

from __future__ import annotations

import json

from specheads.serving.server.schema import APIError


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json_body(raw: bytes) -> dict:
    """Bytes -> a JSON object, or a 400 saying what is wrong with it: not UTF-8, not JSON,
    nested deeper than MAX_JSON_DEPTH, or holding a string that is not valid Unicode (a lone
    UTF-16 surrogate escape such as "\\ud800", which no tokenizer can encode)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not UTF-8: {err}", code="invalid_json") from err
    except ValueError as err:  # JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from err
    except RecursionError as err:  # the parser recursed past Python's limit: far too deep
        field = _deep_field(raw.decode("utf-8", errors="replace"))
        raise _too_deep(field) from err
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    _check_values(body)
    return body


MAX_JSON_DEPTH = 32  # containers inside containers; an OpenAI request needs 5 (messages[i].content[j])


def _too_deep(field: str | None) -> APIError:
    where = f"field {field!r}" if field else "the request body"
    return APIError(400, f"{where} is nested deeper than {MAX_JSON_DEPTH} levels of lists and objects",
                    param=field, code="invalid_json")


def _check_values(body: dict) -> None:
    """Walk the parsed body without recursion: depth and unencodable strings (see parse_json_body)."""
    stack: list[tuple[object, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                raise APIError(400, f"field {path!r} holds text that is not valid Unicode (a lone UTF-16 "
                                    "surrogate escape); send UTF-8 text", param=path, code="invalid_value")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep(path.split(".")[0].split("[")[0] or None)
        if isinstance(value, dict):
            for key, item in value.items():
                if not _is_unicode(key):
                    raise APIError(400, f"a field name inside {path or 'the request body'!r} is not valid "
                                        "Unicode (a lone UTF-16 surrogate escape)", param=path or None,
                                   code="invalid_value")
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        else:  # only what can hold text: a long token-id prompt costs one isinstance per id
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _deep_field(text: str) -> str | None:
    """The top-level field whose value nests past MAX_JSON_DEPTH in a body the parser could not
    read (a scan of brackets outside strings); None if none is found."""
    depth, key, in_string, escaped, start = 0, None, False, False, 0
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 1:
                    key = text[start:i]
        elif char == '"':
            in_string, start = True, i + 1
        elif char in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH + 1:
                return key if _is_unicode(key or "") else None
        elif char in "]}":
            depth -= 1
    return None
