"""Every request field is honoured or refused (the HTTP app in-process, the real model, the openai client).

Sampling fields reach llama.cpp's samplers (checked by what they do to a greedy reply); response_format
constrains the reply through the grammar sampler; anything chatcli cannot do is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from chatcli.session import Session  # noqa: E402

# The module's model load and the HTTP app per test: tests/golden.py's base_session and chat_http.
BASE_SESSION = {"threads": 2, "n_ctx": 2048, "max_tokens": 16}


def client(chat_http: TestClient) -> Any:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=chat_http, max_retries=0)


def ask(chat_http: TestClient, content: str, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 16)
    return client(chat_http).chat.completions.create(
        model="any", messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}],
        **kw)


def post(chat_http: TestClient, **body: Any) -> Any:
    body.setdefault("messages", [{"role": "user", "content": "Hi."}])
    return chat_http.post("/v1/chat/completions", json=body)


def tokens(base_session: Session, text: str) -> list[int]:
    return base_session.engine.tokenize(text, add_special=False)


@pytest.mark.parametrize(("field", "value"), [
    ("tool_choice", "auto"), ("functions", [{"name": "f"}]), ("function_call", "auto"), ("top_logprobs", 2),
    ("frobnicate", 1), ("tools", [{"type": "function"}]), ("top_k", 2**32 + 7), ("response_format", {"type": "xml"}),
])
def test_a_field_chatcli_cannot_honour_is_a_400_naming_it(chat_http: TestClient, field: str, value: Any) -> None:
    r = post(chat_http, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert field in err["message"] and err["param"].split(".")[0] == field


def test_caller_description_fields_are_accepted(chat_http: TestClient) -> None:
    r = post(chat_http, user="u1", metadata={"a": "b"}, store=False, tool_choice="none", temperature=0, max_tokens=4)
    assert r.status_code == 200, r.text


def test_logit_bias_bans_the_greedy_first_token(chat_http: TestClient, base_session: Session) -> None:
    plain = ask(chat_http, "Name a fruit.").choices[0].message.content
    first = tokens(base_session, plain)[0]
    biased = ask(chat_http, "Name a fruit.", logit_bias={str(first): -100}).choices[0].message.content
    assert biased and tokens(base_session, biased)[0] != first
    r = post(chat_http, logit_bias={"99999999": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_min_p_one_keeps_only_the_top_token(chat_http: TestClient) -> None:
    """At temperature 2, min_p = 1 leaves only the most likely token: the greedy reply, whatever the seed."""
    greedy = ask(chat_http, "Name a colour.").choices[0].message.content
    hot = [ask(chat_http, "Name a colour.", temperature=2.0, seed=s, extra_body={"min_p": 1.0}).choices[0].message.content
           for s in (1, 2)]
    assert hot == [greedy, greedy]
    wild = ask(chat_http, "Name a colour.", temperature=2.0, seed=1).choices[0].message.content
    assert wild != greedy  # without min_p the same seed strays: the field is what made the difference


def test_frequency_and_presence_penalties_change_a_greedy_reply(chat_http: TestClient) -> None:
    q = "Repeat the word 'dog' ten times."
    base = ask(chat_http, q, max_tokens=24).choices[0].message.content
    assert ask(chat_http, q, max_tokens=24, frequency_penalty=2.0).choices[0].message.content != base
    assert ask(chat_http, q, max_tokens=24, presence_penalty=2.0).choices[0].message.content != base
    assert ask(chat_http, q, max_tokens=24, presence_penalty=0.0).choices[0].message.content == base


def test_response_format_json_object_and_json_schema(chat_http: TestClient) -> None:
    text = ask(chat_http, "Give me a JSON object with the name and colour of a fruit.", max_tokens=64,
               response_format={"type": "json_object"}).choices[0].message.content
    assert set(json.loads(text)) == {"name", "colour"}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}
    out = ask(chat_http, "How old is the cat?", max_tokens=32,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    doc = json.loads(out.choices[0].message.content)
    assert set(doc) == {"age"} and isinstance(doc["age"], int)
    bad = post(chat_http, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/x"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
