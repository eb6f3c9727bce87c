"""Structured outputs and tool calls through the server, with the clients people use:
the `openai` client's `parse` with a pydantic model, LangChain's
`with_structured_output`, tool calls whole and streamed; and the parsing of Hermes-style
tool calls, alone."""

import json

import jsonschema
import pydantic
import pytest
from test_server import OPTIONS, Server

from nanopaged.serving import tool_calls

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    colour: str = pydantic.Field(pattern="^(red|green|blue)$")


@pytest.fixture(scope="module")
def server(qwen3_path):
    # a random-weight model loops on JSON's whitespace: compact JSON ends
    server = Server(
        qwen3_path,
        *OPTIONS,
        "--structured-outputs-config",
        '{"disable_any_whitespace": true}',
    )
    yield server
    server.stop()


def test_the_openai_client_parses_a_pydantic_model(server):
    for seed in range(4):
        result = server.client.beta.chat.completions.parse(
            model="tiny",
            messages=ASK,
            response_format=Person,
            seed=seed,
            temperature=1.0,
        )
        person = result.choices[0].message.parsed
        assert isinstance(person, Person) and 0 <= person.age <= 120


def test_langchain_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        model="tiny",
        base_url=server.url + "/v1",
        api_key="none",
        temperature=0.7,
        max_retries=0,
    )
    for method in ("json_schema", "function_calling"):
        person = model.with_structured_output(Person, method=method).invoke(
            "Name a person"
        )
        assert isinstance(person, Person), method


@pytest.mark.parametrize(
    "fields, check",
    [
        (
            {"response_format": {"type": "json_object"}, "max_tokens": 300},
            lambda text: isinstance(json.loads(text), dict),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "weather",
                        "schema": WEATHER["function"]["parameters"],
                    },
                }
            },
            lambda text: (
                jsonschema.validate(json.loads(text), WEATHER["function"]["parameters"])
                or True
            ),
        ),
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"guided_regex": "[0-9]{4}"}, lambda text: len(text) == 4 and text.isdigit()),
        (
            {"structured_outputs": {"choice": ["left", "right"]}},
            lambda text: text in ("left", "right"),
        ),
        (
            {
                "guided_json": WEATHER["function"]["parameters"],
                "guided_decoding_backend": "xgrammar",
            },
            lambda text: json.loads(text)["unit"] in ("celsius", "fahrenheit"),
        ),
    ],
)
def test_response_format_and_vllms_guided_fields(server, fields, check):
    for seed in range(3):
        result = server.client.chat.completions.create(
            model="tiny",
            messages=ASK,
            temperature=1.0,
            seed=seed,
            extra_body={k: v for k, v in fields.items() if k != "response_format"},
            **(
                {"response_format": fields["response_format"]}
                if "response_format" in fields
                else {}
            ),
        )
        choice = result.choices[0]
        if choice.finish_reason == "stop" or "json_object" not in str(fields):
            assert choice.finish_reason == "stop" and check(choice.message.content)


@pytest.mark.parametrize(
    "tool_choice, parallel",
    [
        ("required", None),
        ("required", False),
        ({"type": "function", "function": {"name": "get_weather"}}, None),
    ],
)
def test_forced_tool_calls_follow_the_functions_schemas(server, tool_choice, parallel):
    options = {} if parallel is None else {"parallel_tool_calls": parallel}
    for seed in range(3):
        result = server.client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=tool_choice,
            temperature=1.0,
            seed=seed,
            **options,
        )
        message = result.choices[0].message
        assert message.tool_calls and message.content in (None, "")
        if parallel is False or isinstance(tool_choice, dict):
            assert len(message.tool_calls) == 1
        for call in message.tool_calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(
                json.loads(call.function.arguments), schema["function"]["parameters"]
            )
            assert call.id.startswith("call_") and call.type == "function"
        assert result.choices[0].finish_reason == (
            "tool_calls" if tool_choice == "required" else "stop"
        )


def test_streamed_tool_calls_add_up_to_the_whole_ones(server):
    for tool_choice in (
        "required",
        {"type": "function", "function": {"name": "get_weather"}},
    ):
        kwargs = dict(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=tool_choice,
            temperature=0,
        )
        whole = (
            server.client.chat.completions.create(**kwargs)
            .choices[0]
            .message.tool_calls
        )
        calls: dict[int, dict] = {}
        for chunk in server.client.chat.completions.create(stream=True, **kwargs):
            for delta in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in whole
        ]


@pytest.mark.parametrize("cut", [{"max_tokens": 6}, {"stop": ["name"]}])
def test_required_calls_cut_short_end_as_their_finish_reason(server, cut):
    """max_tokens or a stop string cuts the calls' JSON short: the text comes back as
    content, with finish_reason "length" or "stop", whole or streamed to its [DONE]."""
    import httpx

    body = dict(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        **cut,
    )
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    reason = "length" if "max_tokens" in cut else "stop"
    assert choice["finish_reason"] == reason and not choice["message"].get("tool_calls")
    assert choice["message"]["content"]
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json=dict(body, stream=True),
        timeout=60,
    ) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == reason
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == choice["message"]["content"]


def test_auto_tool_choice_parses_hermes_tool_calls(server):
    hermes = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    body = dict(
        model="tiny",
        messages=ASK,
        tools=[TIME],
        tool_choice="auto",
        extra_body={
            "guided_regex": "Let me check\\. "
            + hermes.replace("{", "\\{").replace("}", "\\}")
        },
    )
    result = server.client.chat.completions.create(**body)
    message = result.choices[0].message
    assert (
        message.content == "Let me check."
        and result.choices[0].finish_reason == "tool_calls"
    )
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "utc"},
    )
    streamed_content, streamed_calls = "", []
    for chunk in server.client.chat.completions.create(stream=True, **body):
        delta = chunk.choices[0].delta
        streamed_content += delta.content or ""
        streamed_calls += [
            (c.function.name, c.function.arguments) for c in delta.tool_calls or ()
        ]
    assert streamed_content.strip() == "Let me check."
    assert streamed_calls == [("get_time", call.function.arguments)]
    plain = server.client.chat.completions.create(
        model="tiny", messages=ASK, tools=[TIME], max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None  # text without calls stays text


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "objekt"}},
                }
            },
            "invalid json",
        ),
        ({"response_format": {"type": "xml"}}, "response_format must be"),
        (
            {"guided_regex": "a(", "response_format": {"type": "json_object"}},
            "give one of",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "names the function 'nope', which is not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
        ({"tools": [{"type": "function"}]}, "tools must be a list of"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": "get_weather"},
            },
            "tool_choice must be",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": 7}},
            "tool_choice must be",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": "weather"}},
            "response_format must be",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"$ref": "#"}},
                }
            },
            "nothing satisfies it",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(server, fields, message):
    import httpx

    response = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": ASK, **fields},
    )
    assert (
        response.status_code == 400 and message in response.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>',
            "Sure.",
            [("a", {"x": 1})],
        ),
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": '
            '"b", "arguments": {"y": "z"}}</tool_call>',
            None,
            [("a", {}), ("b", {"y": "z"})],
        ),
        ("No calls here", "No calls here", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ],
)
def test_hermes_parsing_whole_and_streamed(text, content, calls):
    got_content, got_calls = tool_calls.parse(text, "auto", None)
    assert got_content == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in got_calls
    ] == calls
    for step in (1, 3, 7):  # the text arriving a few characters at a time
        stream, deltas = tool_calls.ToolCallStream("auto", None), []
        for end in list(range(step, len(text), step)) + [len(text)]:
            deltas += stream.deltas(text[:end], end == len(text))
        streamed = "".join(d.get("content", "") for d in deltas)
        names = [
            d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d
        ]
        assert streamed.strip() == (content or "") and names == [
            name for name, _ in calls
        ]
