"""What `mtbert serve`'s OpenAPI document (GET /openapi.json) says of each route: the /predict body as JSON
Schema, built from the model's tasks and the server's limits, and every response a route can give, errors
included, each with its body's schema. FastAPI assembles the document from these (mtbert/deploy/api.py);
a client can generate its code from it, and `python -m bench.fuzz` (schemathesis) generates requests from it
and checks each answer against it.

/predict's body is read by hand (api.py's `read_body`, `parse_request`: 413 before a large body is read
whole, one-line errors), so its schema is given to the document rather than taken from a pydantic model.
"""

from __future__ import annotations

ERROR_BODY = {"type": "object", "required": ["error"], "additionalProperties": False,
              "properties": {"error": {"type": "string", "description": "one line naming what was refused"}}}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before sending the request again",
                               "schema": {"type": "string"}}}

ERRORS = {  # status -> what it means, as the server answers it
    400: "the body is not JSON",
    401: "a missing or wrong bearer token (`--api-key`)",
    404: "an unknown task",
    408: "the body was not received within `--read-timeout`",
    413: "a body over `--max-body-bytes`, over `--max-texts` texts, or a text over `--max-chars` characters",
    422: "a body of the wrong shape, an empty text, a pair with a side missing, or text that is not valid "
         "Unicode",
    429: "the server is full: send it again after Retry-After",
    499: "never sent: the client hung up (how /metrics counts it)",
    500: "the engine failed on this request; the log has the details under its request id",
    503: "not answered within `--request-timeout`, or the server is shutting down",
}
RETRY_AFTER_STATUSES = (429, 503)  # the answers that say when to send the request again
# A text of only spaces, control, format, private-use or unassigned characters (Unicode's Z and C, after NFKC)
# is refused: the tokenizer would see nothing in it. JSON Schema has no pattern for Unicode categories that
# every validator reads alike, so the document names the rule as a format of its own.
VISIBLE_TEXT = "visible-text"


def error(status: int) -> dict:
    response = {"description": ERRORS[status], "content": {"application/json": {"schema": ERROR_BODY}}}
    if status in RETRY_AFTER_STATUSES:
        response["headers"] = RETRY_AFTER
    return response


def json_response(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def predict_body(tasks: dict[str, int], max_texts: int, max_chars: int) -> dict:
    """/predict's request body: for each task (name -> how many sentences a row has), its name and a list of
    rows, a row being a text (one sentence) or a list of its texts (a pair)."""
    text = {"type": "string", "minLength": 1, "maxLength": max_chars, "format": VISIBLE_TEXT,
            "description": "a text with at least one character that shows (mtbert.inputs.has_visible_text)"}

    def request(task: str, sentences: int) -> dict:
        row = text if sentences == 1 else {"type": "array", "items": text, "minItems": sentences,
                                           "maxItems": sentences}
        return {"type": "object", "required": ["task", "texts"], "additionalProperties": False,
                "properties": {"task": {"type": "string", "enum": [task]},
                               "texts": {"type": "array", "items": row, "minItems": 1, "maxItems": max_texts}}}

    schema = {"oneOf": [request(task, sentences) for task, sentences in tasks.items()]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


PREDICTION = {"type": "object", "required": ["task", "results"], "additionalProperties": False,
              "properties": {"task": {"type": "string"},
                             "results": {"type": "array", "items": {
                                 "type": "object", "required": ["label"],
                                 "additionalProperties": {"type": "number"}}}}}
PREDICT = {200: json_response("each text's result columns and label, in the order sent", PREDICTION),
           **{status: error(status) for status in (400, 401, 404, 408, 413, 422, 429, 499, 500, 503)}}

TASKS = {200: json_response("each task's kind, text columns and result columns", {
    "type": "object", "required": ["tasks"],
    "properties": {"tasks": {"type": "object", "additionalProperties": {
        "type": "object", "required": ["kind", "text", "results"],
        "properties": {"kind": {"type": "string"}, "text": {"type": "array", "items": {"type": "string"}},
                       "results": {"type": "array", "items": {"type": "string"}}}}}}})}

HEALTH_BODY = {"type": "object", "required": ["status", "tasks", "requests", "engine_calls", "draining"],
               "properties": {"status": {"enum": ["ok", "unhealthy"]}, "tasks": {"type": "array"},
                              "requests": {"type": "integer"}, "engine_calls": {"type": "integer"},
                              "draining": {"type": "boolean"}, "error": {"type": "string"}}}
HEALTH = {200: json_response("the engine completes its calls (liveness)", HEALTH_BODY),
          503: json_response("an engine call ran past --request-timeout, or the batching loop stopped",
                             HEALTH_BODY)}

READY = {200: json_response("the model is loaded and the server takes work (readiness)", {
    "type": "object", "required": ["status"], "properties": {"status": {"enum": ["ready"]}}}),
         503: error(503)}

BEARER = {"bearer": {"type": "http", "scheme": "bearer", "description": "the server's --api-key"}}


def with_bearer(document: dict, guarded: tuple[str, ...]) -> dict:
    """`document` saying that the `guarded` paths ask for the bearer token, as a server with --api-key does:
    a client (or schemathesis' `ignored_auth` check) then knows to send it, and that a 200 without it is
    wrong."""
    document.setdefault("components", {})["securitySchemes"] = BEARER
    for path in guarded:
        for operation in document["paths"][path].values():
            operation["security"] = [{"bearer": []}]
    return document


METRICS = {200: {"description": "Prometheus metrics, in the text exposition format",
                 "content": {"text/plain": {"schema": {"type": "string"}}}},
           401: error(401)}
