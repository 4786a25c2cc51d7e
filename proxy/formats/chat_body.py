"""Parsing and checking a chat completion request body.

Only what memproxy itself relies on is checked; every other field is forwarded untouched
for the upstream to judge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proxy.http.errors import InvalidRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# The body fields litellm receives (the chat completions parameters of OpenAI's API
# reference, https://platform.openai.com/docs/api-reference/chat/create, `model` apart).
# litellm also reads hosts, keys, headers and providers from its keyword arguments
# (base_url, api_key, extra_headers, custom_llm_provider, ...), so nothing else goes. Not
# `metadata`: to litellm it is its own logging metadata.
CHAT_PARAMS = frozenset({
    "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
    "logprobs", "max_completion_tokens", "max_tokens", "modalities", "n",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier",
    "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
})


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body or raise a 400."""
    if not raw.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def parse_model_body(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body that names its model, in OpenAI's words, or raise a 400
    (chat completions and Responses)."""
    body = parse_json_object(raw)
    model = body.get("model")
    if model is None:
        raise InvalidRequest("you must provide a model parameter", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string", param="model")
    return body


def parse_chat_body(raw: bytes) -> dict[str, Any]:
    """Decode and check a /v1/chat/completions body."""
    body = parse_model_body(raw)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("you must provide a messages parameter", param="messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        _check_message(i, message)
    check_types(body, {"stream": (bool, "bool"), "n": (int, "int"), "user": (str, "str"),
                       "metadata": (dict, "dict"), "stream_options": (dict, "dict")})
    return body


def _check_message(i: int, message: Any) -> None:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or object role is unhashable
        raise InvalidRequest(
            f"{param}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}",
            param=f"{param}.role",
        )
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise InvalidRequest(
            f"{param}.content must be a string or an array of content parts",
            param=f"{param}.content",
        )
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidRequest(
                    f"{param}.content[{j}] must be an object with a string type",
                    param=f"{param}.content[{j}]",
                )
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"{param}.name must be a string", param=f"{param}.name")


def check_types(
    body: dict[str, Any], types: Mapping[str, tuple[type, str]],
    message: str = "{key} must be of type {name}",
) -> None:
    """A 400 for the first of these fields that is set (not null) to a value of another type
    than its own (`name` is the type as the format's errors say it)."""
    for key, (kind, name) in types.items():
        value = body.get(key)
        # bool is an int in Python; `n: true` is still the wrong type.
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise InvalidRequest(message.format(key=key, name=name), param=key)
