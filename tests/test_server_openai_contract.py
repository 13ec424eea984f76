"""OpenAI's routes against what its clients rely on: a refusal that names
the message a chat client sent (not the engine's ``prompt``), answer ids
that no other server or restart repeats, ``GET /v1/models/{model}``, the
event stream's framing and its last events, and a streaming client that
leaves mid-answer."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from server_support import fake_engine, serving
from small_tokenizer import small_bpe_tokenizer

from bubblefree import Engine
from bubblefree.core import Engine as CoreEngine
from bubblefree.fake_backend import FakeBackend, FakeModel
from bubblefree.skills import HFTokenizer, SkillSet

CHAT = {"messages": [{"role": "user", "content": "what"}]}
ANSWER_TEXT = "the cat sits on the mat ."


def serves_on(url: str) -> None:
    reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=20)
    assert reply.status_code == 200, reply.text


def bpe_engine(chat_template: str | None = None) -> Engine:
    """A text engine whose tokenizer is a real one, with special tokens a
    message may spell (and ``chat_template`` if given)."""
    hf = small_bpe_tokenizer()
    if chat_template is not None:
        hf.chat_template = chat_template
    tokenizer = HFTokenizer.wrap(hf)
    core = CoreEngine(FakeBackend(model=FakeModel(vocab_size=len(tokenizer), eos_id=tokenizer.eos_id),
                                  num_pages=64, max_rows=4, images=False, values=False))
    return Engine(core, SkillSet(tokenizer, core.register_mask, codec=None).compile_all())


@pytest.fixture(scope="module")
def bpe():
    engine = bpe_engine()
    yield engine
    engine.close()


@pytest.mark.parametrize("messages,field", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a <|endoftext|> b"}],
     "messages[1].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b <|endoftext|>"}]}],
     "messages[0].content"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_message_spelling_a_special_token_is_refused_naming_that_message(bpe, messages, field, stream):
    """The tokenizer's refusal named ``prompt``, a field no chat client
    sends; a too-long conversation already named ``messages``."""
    with serving(bpe) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=20,
                           json={"messages": messages, "max_tokens": 4, "stream": stream})
        assert reply.status_code == 422, reply.text
        error = reply.json()["error"]
        assert error["param"] == field, error
        assert error["message"].startswith(f"{field}: spells the model's special token '<|endoftext|>'"), error
        serves_on(url)


def _answer_ids(url: str) -> list[str]:
    chat = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=20).json()
    text = httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, timeout=20).json()
    return [chat["id"], text["id"]]


def test_answer_ids_are_not_repeated_by_another_server_or_a_restart():
    """The engine's request ids restart at 0 with every engine: two
    replicas behind one address (or a server restarted) gave different
    answers the same id."""
    seen = []
    for _ in range(2):
        engine = fake_engine()
        try:
            with serving(engine) as url:
                seen += _answer_ids(url)
        finally:
            engine.close()
    assert len(set(seen)) == len(seen), seen
    assert all(i.startswith("chatcmpl-") for i in seen[::2]) and all(i.startswith("cmpl-") for i in seen[1::2])


@pytest.fixture(scope="module")
def url():
    engine = fake_engine()
    with serving(engine, model_name="org/model-1") as base:
        yield base
    engine.close()


def test_a_model_is_retrieved_by_its_name_and_another_name_is_a_404_naming_model(url):
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)
    model = oa.models.retrieve("org/model-1")
    assert (model.id, model.object, model.owned_by) == ("org/model-1", "model", "bubblefree")
    assert httpx.get(f"{url}/v1/models/org/model-1").json() == httpx.get(f"{url}/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as caught:
        oa.models.retrieve("gpt-4")
    assert caught.value.body["param"] == "model"
    assert caught.value.body["message"] == "model: no model 'gpt-4'; this server serves 'org/model-1'"
    serves_on(url)


def events(reply: httpx.Response) -> list[str]:
    """The stream's events' data, once each is checked to be one ``data:``
    line closed by a blank line."""
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.text.endswith("\n\n")
    blocks = reply.text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    return [b.removeprefix("data: ") for b in blocks]


@pytest.mark.parametrize("route,body,kind", [
    ("/v1/chat/completions", CHAT, "chat.completion.chunk"),
    ("/v1/completions", {"prompt": "a"}, "text_completion"),
])
def test_a_stream_is_framed_ends_with_usage_then_done_and_agrees_with_the_whole_answer(url, route, body, kind):
    whole = httpx.post(url + route, json=body, timeout=20).json()
    data = events(httpx.post(url + route, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                             timeout=20))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"] != whole["id"]
    assert {(c["object"], c["model"]) for c in chunks} == {(kind, "org/model-1")}
    *answer, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    choices = [c["choices"][0] for c in answer]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["stop"]
    if kind == "chat.completion.chunk":
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert choices[-1]["delta"] == {}  # OpenAI's last chunk: its finish_reason, nothing said
        text = "".join(c["delta"].get("content", "") for c in choices)
    else:
        text = "".join(c["text"] for c in choices)
    assert text == ANSWER_TEXT == (whole["choices"][0].get("text") or whole["choices"][0]["message"]["content"])


def test_a_chat_stream_whose_client_leaves_is_cancelled_and_the_server_serves_on():
    engine = fake_engine(script=("cat",), endless=True, delay_s=0.01)
    try:
        with serving(engine) as base:
            def stats() -> dict:
                return httpx.get(f"{base}/v1/stats", timeout=10).json()

            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=20,
                              json={**CHAT, "max_tokens": 200, "stream": True}) as reply:
                lines = reply.iter_lines()
                assert next(lines).startswith("data: ")
                assert stats()["live_requests"] == 1
            deadline = time.monotonic() + 5  # far less than 200 tokens' 2 s
            while stats()["live_requests"] or stats()["kv_pages"]["free"] != stats()["kv_pages"]["total"]:
                assert time.monotonic() < deadline, stats()
                time.sleep(0.02)
            reply = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=20)
            assert reply.json()["choices"][0]["message"]["content"] == "cat cat"
    finally:
        engine.close()


@pytest.mark.parametrize("delay_s", [0.0, 0.01])
@pytest.mark.parametrize("stream", [False, True])
def test_usage_after_a_stop_string_counts_the_tokens_read_up_to_it(delay_s, stream):
    """The tokens sampled after a stop string, until its cancel lands, never
    reach the client. Usage counted them too: 7 tokens for a text of 3, more
    or fewer as the decode thread ran ahead of the reader."""
    engine = fake_engine(delay_s=delay_s)
    try:
        with serving(engine) as base:
            body = {"prompt": "a", "stop": "sits", "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=20)
            if stream:
                chunks = [json.loads(d) for d in events(reply)[:-1]]
                text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
                usage = chunks[-1]["usage"]
            else:
                text, usage = reply.json()["choices"][0]["text"], reply.json()["usage"]
            assert text == "the cat "
            # One token a word: "the", "cat" and "sits", whose text the stop held back.
            assert usage["completion_tokens"] == 3, usage
            assert usage["total_tokens"] == usage["prompt_tokens"] + 3
            serves_on(base)
    finally:
        engine.close()


def test_a_message_s_text_parts_are_one_text_a_line_apart(bpe):
    """Parts were joined with nothing between them: ["what is", "the sky"]
    reached the model as "what isthe sky". They are joined as vLLM joins
    them, a newline apart: the same prompt and answer as that string."""
    def answer(content) -> tuple[int, str]:
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=20, json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"], reply.json()["choices"][0]["message"]["content"]

    with serving(bpe) as url:
        parts = answer([{"type": "text", "text": "what is"}, {"type": "text", "text": "the sky"}])
        assert parts == answer("what is\nthe sky")
        assert parts[0] != answer("what isthe sky")[0]  # the join is seen in the prompt
        assert answer([{"type": "text", "text": "what is the sky"}]) == answer("what is the sky")


def test_a_developer_message_is_the_system_turn(url):
    """Newer OpenAI clients send their instructions as ``developer``; it was
    refused as an unknown role."""
    def prompt_tokens(role: str) -> int:
        messages = [{"role": role, "content": "answer briefly"}, *CHAT["messages"]]
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages}, timeout=20)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]
    assert prompt_tokens("developer") == prompt_tokens("system")


@pytest.mark.parametrize("route,fields", [
    ("/v1/chat/completions", {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False}),
    ("/v1/chat/completions", {"presence_penalty": None, "logprobs": None}),
    ("/v1/completions", {"frequency_penalty": 0, "logprobs": 0}),
    ("/v1/chat/completions", {"top_logprobs": 0, "response_format": {"type": "text"}, "store": False,
                              "metadata": {}, "parallel_tool_calls": True}),
    ("/v1/completions", {"echo": False, "suffix": "", "best_of": 1}),
    ("/v1/chat/completions", {"reasoning": False}),  # Moondream's client, chat(reasoning=False)
    ("/v1/completions", {"echo": None, "suffix": None, "best_of": None, "store": None, "metadata": None}),
])
def test_fields_clients_send_at_values_that_change_nothing_are_taken(url, route, fields):
    body = CHAT if route == "/v1/chat/completions" else {"prompt": "a"}
    reply = httpx.post(url + route, json={**body, **fields}, timeout=20)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("field,value,says", [
    ("presence_penalty", 0.5, "this server applies no penalty: only 0, got 0.5"),
    ("frequency_penalty", "0", "this server applies no penalty: only 0, got '0'"),
    ("presence_penalty", False, "this server applies no penalty: only 0, got False"),
    ("logprobs", True, "this server gives no log probabilities"),
    ("logprobs", 2, "this server gives no log probabilities"),
    ("top_logprobs", 3, "this server gives no log probabilities: only 0, got 3"),
    ("response_format", {"type": "json_object"}, 'this server answers in text: only {"type": "text"}'),
    ("store", True, "this server stores no answers: only false, got True"),
    ("metadata", {"a": "b"}, "this server stores no answers: only an empty object"),
    ("parallel_tool_calls", "yes", "only true or false (this server calls no tools), got 'yes'"),
    ("echo", True, "this server does not echo the prompt: only false, got True"),
    ("suffix", "after", "this server takes no suffix: only an empty one, got 'after'"),
    ("best_of", 2, "this server gives one choice a request: only 1, got 2"),
    ("reasoning", True, "not supported by this model: only false, got True"),
])
def test_those_fields_at_any_other_value_are_refused_naming_them(url, field, value, says):
    reply = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, field: value}, timeout=20)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: {says}"), error
    serves_on(url)


# Gemma's way with a system turn, and Mistral's with turns that do not
# alternate: the template itself raises (``raise_exception``).
STRICT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_conversation_the_chat_template_refuses_is_a_422_naming_messages(stream):
    """It was a 500 (``TemplateError``), counted as the server's bug, its
    connection closed: the conversation is the client's to change."""
    engine = bpe_engine(STRICT_TEMPLATE)
    try:
        with serving(engine) as url:
            for messages, says in (
                    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "what"}],
                     "System role not supported"),
                    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                     "Conversation roles must alternate user/assistant/user/assistant/...")):
                reply = httpx.post(f"{url}/v1/chat/completions", timeout=20,
                                   json={"messages": messages, "max_tokens": 3, "stream": stream})
                assert reply.status_code == 422, reply.text
                assert reply.json()["error"] == {
                    "message": f"messages: the model's chat template refuses this conversation: {says}",
                    "type": "invalid_request_error", "param": "messages", "code": 422}
            ok = httpx.post(f"{url}/v1/chat/completions", timeout=20,
                            json={"messages": [{"role": "user", "content": "what"}], "max_tokens": 3})
            assert ok.status_code == 200, ok.text
            assert httpx.get(f"{url}/v1/stats").json()["requests_by_status"] == {"200": 1, "422": 2}
    finally:
        engine.close()


def test_a_refusal_quotes_at_most_500_characters_and_names_at_most_100(url):
    """A refusal quotes what the client sent: a megabyte role came back
    whole, and an unknown field's name as its ``param``."""
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=20,
                       json={"messages": [{"role": "r" * 1_000_000, "content": "x"}]})
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert error["param"] == "messages[0].role"
    assert len(error["message"]) == 500 and error["message"].endswith("rrr\u2026")
    assert error["message"].startswith("messages[0].role: must be one of system, developer, user, assistant, got")
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=20, json={**CHAT, "f" * 10_000: 1})
    error = reply.json()["error"]
    assert reply.status_code == 422 and error["param"] == "f" * 99 + "\u2026", error["param"][:120]
    assert len(error["message"]) == 500
    reply = httpx.post(f"{url}/v1/completions", timeout=20, json={"prompt": "a", "seed": 10**4000})
    assert reply.status_code == 422 and len(reply.json()["error"]["message"]) <= 500
    serves_on(url)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_refusal_of_max_completion_tokens_names_it(url, route):
    """The newer field was refused as ``max_tokens``, a field the client
    never sent."""
    body = CHAT if route == "/v1/chat/completions" else {"prompt": "a"}
    reply = httpx.post(url + route, json={**body, "max_completion_tokens": 10**6}, timeout=20)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["param"] == "max_completion_tokens"
    assert error["message"].startswith("max_completion_tokens: 1000000 after a "), error
    reply = httpx.post(url + route, json={**body, "max_tokens": 10**6}, timeout=20)
    assert reply.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_top_k_and_min_p_from_the_clients_extra_body_reach_the_draw(url, route):
    """vLLM's sampling extras, as the OpenAI client sends them: one token
    left (top_k 1, or min_p 1) is the greedy answer at any temperature and
    seed; top_k -1 is no limit, as vLLM spells it."""
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)

    def text(**extra) -> str:
        if route == "/v1/chat/completions":
            reply = oa.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=8, **extra)
            return reply.choices[0].message.content
        return oa.completions.create(model="m", prompt="a", max_tokens=8, **extra).choices[0].text
    greedy = text()
    drawn = {text(temperature=2.0, seed=s, extra_body={"top_k": -1}) for s in range(4)}
    assert drawn - {greedy}  # unlimited, the draws leave the greedy answer
    for s in range(4):
        assert text(temperature=2.0, seed=s, extra_body={"top_k": 1}) == greedy
        assert text(temperature=2.0, seed=s, extra_body={"min_p": 1.0, "top_k": 0}) == greedy
    # moondream's settings take them too
    answer = httpx.post(f"{url}/v1/query", json={"question": "what", "settings": {
        "temperature": 2.0, "seed": 3, "top_k": 1}}, timeout=20).json()["answer"]
    assert answer == httpx.post(f"{url}/v1/query", json={"question": "what"}, timeout=20).json()["answer"]


def test_drawn_answers_without_a_seed_differ_and_a_seed_repeats_its_answer(url):
    """As OpenAI's: a drawn request without ``seed`` takes a fresh one, so
    the same request asked again draws anew; with ``seed`` it answers alike."""
    def text(**extra) -> str:
        body = {"prompt": "a", "max_tokens": 12, "temperature": 1.5, **extra}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=20)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    assert len({text() for _ in range(4)}) > 1
    assert len({text(seed=9) for _ in range(3)}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_completions_prompt_of_token_ids_answers_as_its_text_does(stream):
    """OpenAI's (and vLLM's) prompt as an array of token ids, or a batch of
    one such array: the ids go to the engine as they are."""
    engine = fake_engine()
    with serving(engine) as base:
        ids = engine.skills.tokenizer.encode("what is it")

        def answer(prompt) -> str:
            body = {"prompt": prompt, "max_tokens": 8, "stream": stream}
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=20)
            assert reply.status_code == 200, reply.text
            if not stream:
                return reply.json()["choices"][0]["text"]
            return "".join(json.loads(d)["choices"][0]["text"] for d in events(reply)[:-1])
        text = answer("what is it")
        assert answer(ids) == answer([ids]) == text != ""
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": [ids, ids]}, timeout=20)
        assert reply.status_code == 422 and reply.json()["error"]["param"] == "prompt"
        serves_on(base)
    engine.close()
