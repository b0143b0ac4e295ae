"""Every request field is honoured or refused (the HTTP app in-process, the real model, the openai client).

Sampling fields reach llama.cpp's samplers (checked by what they do to a greedy reply); response_format
constrains the reply through the grammar sampler; anything chatcli cannot do is a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from starlette.testclient import TestClient  # noqa: E402

from chatcli.server.app import create_app  # noqa: E402
from chatcli.server.service import ChatService  # noqa: E402
from chatcli.session import Session  # noqa: E402
from tests.drive import isolated_session, rebind  # noqa: E402


@pytest.fixture(scope="module")
def module_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    s = isolated_session(tmp_path_factory.mktemp("fields-home"), max_tokens=16)
    yield s
    s.close()


@pytest.fixture
def http(module_session: Session, tmp_path: Any) -> Iterator[TestClient]:
    s = rebind(module_session)
    s.engine.clear()
    svc = ChatService(s, parallel=1, index_path=tmp_path / "index.json")
    with TestClient(create_app(svc)) as client:
        yield client
    svc.close()


def client(http: TestClient) -> Any:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def ask(http: TestClient, content: str, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 16)
    return client(http).chat.completions.create(
        model="any", messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}],
        **kw)


def post(http: TestClient, **body: Any) -> Any:
    body.setdefault("messages", [{"role": "user", "content": "Hi."}])
    return http.post("/v1/chat/completions", json=body)


def tokens(module_session: Session, text: str) -> list[int]:
    return module_session.engine.tokenize(text, add_special=False)


@pytest.mark.parametrize(("field", "value"), [
    ("tool_choice", "auto"), ("functions", [{"name": "f"}]), ("function_call", "auto"), ("top_logprobs", 2),
    ("frobnicate", 1), ("tools", [{"type": "function"}]), ("top_k", 2**32 + 7), ("response_format", {"type": "xml"}),
])
def test_a_field_chatcli_cannot_honour_is_a_400_naming_it(http: TestClient, field: str, value: Any) -> None:
    r = post(http, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert field in err["message"] and err["param"].split(".")[0] == field


def test_caller_description_fields_are_accepted(http: TestClient) -> None:
    r = post(http, user="u1", metadata={"a": "b"}, store=False, tool_choice="none", temperature=0, max_tokens=4)
    assert r.status_code == 200, r.text


def test_logit_bias_bans_the_greedy_first_token(http: TestClient, module_session: Session) -> None:
    plain = ask(http, "Name a fruit.").choices[0].message.content
    first = tokens(module_session, plain)[0]
    biased = ask(http, "Name a fruit.", logit_bias={str(first): -100}).choices[0].message.content
    assert biased and tokens(module_session, biased)[0] != first
    r = post(http, logit_bias={"99999999": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_min_p_one_keeps_only_the_top_token(http: TestClient) -> None:
    """At temperature 2, min_p = 1 leaves only the most likely token: the greedy reply, whatever the seed."""
    greedy = ask(http, "Name a colour.").choices[0].message.content
    hot = [ask(http, "Name a colour.", temperature=2.0, seed=s, extra_body={"min_p": 1.0}).choices[0].message.content
           for s in (1, 2)]
    assert hot == [greedy, greedy]
    wild = ask(http, "Name a colour.", temperature=2.0, seed=1).choices[0].message.content
    assert wild != greedy  # without min_p the same seed strays: the field is what made the difference


def test_frequency_and_presence_penalties_change_a_greedy_reply(http: TestClient) -> None:
    q = "Repeat the word 'dog' ten times."
    base = ask(http, q, max_tokens=24).choices[0].message.content
    assert ask(http, q, max_tokens=24, frequency_penalty=2.0).choices[0].message.content != base
    assert ask(http, q, max_tokens=24, presence_penalty=2.0).choices[0].message.content != base
    assert ask(http, q, max_tokens=24, presence_penalty=0.0).choices[0].message.content == base


def test_response_format_json_object_and_json_schema(http: TestClient) -> None:
    text = ask(http, "Give me a JSON object with the name and colour of a fruit.", max_tokens=64,
               response_format={"type": "json_object"}).choices[0].message.content
    assert set(json.loads(text)) == {"name", "colour"}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}
    out = ask(http, "How old is the cat?", max_tokens=32,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    doc = json.loads(out.choices[0].message.content)
    assert set(doc) == {"age"} and isinstance(doc["age"], int)
    bad = post(http, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/x"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
