"""The fake engines' routes that need no PD, in each engine's wire format: ``POST /tokenize`` and
``/detokenize`` (vLLM 0.32 ``vllm/entrypoints/serve/tokenize``: ``{count, max_model_len, tokens,
token_strs}`` and ``{prompt}``; SGLang 0.5.23 ``http_server.py``, also at ``/v1/tokenize`` and
``/v1/detokenize``: ``{tokens, count, max_model_len}`` and ``{text}``), and ``/v1/embeddings``
(OpenAI's list of embeddings), which a generation model does not serve: a 404 as FastAPI's
(``{"detail": "Not Found"}``) unless ``FakeConfig.serves_embeddings``. With ``fail_status`` set
every route answers it with a plain-text body. The fake tokenizer: one token per character (its
code point). A ``model`` other than the engine's own is a 404, as vLLM answers it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from testkit.fake_base import FakeConfig, Reply, RouteFn, RouteRequest, Routes

__all__ = ["MAX_MODEL_LEN", "passthrough_routes"]

MAX_MODEL_LEN = 4096
_EMBEDDING_SIZE = 8


def _not_served(body: dict[str, Any], served: str) -> Reply | None:
    """vLLM's ``_check_model``: a 404 for a model the engine does not serve."""
    model = body.get("model")
    if model is None or model == served:
        return None
    return Reply(404, {"error": {"message": f"The model `{model}` does not exist.", "code": 404}})


def passthrough_routes(protocol: str, config: Callable[[], FakeConfig], calls: list[str]) -> Routes:
    """The routes; each call's path is appended to ``calls``."""
    sglang = protocol == "sglang"

    def counted(path: str, fn: Callable[[dict[str, Any]], Reply]) -> RouteFn:
        async def route(request: RouteRequest) -> Reply:
            calls.append(path)
            failing = config().fail_status
            if failing is not None:  # the engine fails every request (FastAPI's plain 500 body)
                return Reply(failing, b"Internal Server Error")
            body = request.json()
            return _not_served(body, config().model) or fn(body)

        return route

    def tokenize(body: dict[str, Any]) -> Reply:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return Reply(400, {"error": {"message": "prompt must be a string", "code": 400}})
        tokens = [ord(char) for char in prompt]
        answer = {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}
        if sglang:
            return Reply(200, answer)
        strs = list(prompt) if body.get("return_token_strs") else None
        return Reply(200, {**answer, "token_strs": strs})

    def detokenize(body: dict[str, Any]) -> Reply:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and 0 <= t < 0x110000 for t in tokens
        ):
            return Reply(400, {"error": {"message": "tokens must be token ids", "code": 400}})
        text = "".join(chr(token) for token in tokens)
        return Reply(200, {"text": text} if sglang else {"prompt": text})

    def embeddings(body: dict[str, Any]) -> Reply:
        if not config().serves_embeddings:
            return Reply(404, {"detail": "Not Found"})
        given = body.get("input", "")
        inputs = [given] if isinstance(given, str) else list(given)
        vectors = [[len(str(text)) / 10] * _EMBEDDING_SIZE for text in inputs]
        data = [
            {"object": "embedding", "index": i, "embedding": vector}
            for i, vector in enumerate(vectors)
        ]
        used = sum(len(str(text)) for text in inputs)
        usage = {"prompt_tokens": used, "total_tokens": used}
        return Reply(200, {"object": "list", "data": data, "model": config().model, "usage": usage})

    routes: Routes = {
        "/tokenize": {"POST": counted("/tokenize", tokenize)},
        "/detokenize": {"POST": counted("/detokenize", detokenize)},
        "/v1/embeddings": {"POST": counted("/v1/embeddings", embeddings)},
    }
    if sglang:
        routes["/v1/tokenize"] = {"POST": counted("/v1/tokenize", tokenize)}
        routes["/v1/detokenize"] = {"POST": counted("/v1/detokenize", detokenize)}
    return routes
