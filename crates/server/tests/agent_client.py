"""A tool loop through the official `openai` client against a metrale server.

Run by crates/server/tests/server/chat_agent.rs on a random-weight model
whose chat template renders tools and thinking (Qwen3.5's); a forced call
(`tool_choice: "required"`, or a named function) makes the reply's shape
certain:

    python3 agent_client.py SPEC.json

Checks: a forced call, non-streamed and streamed (the deltas joined equal
the whole reply for the same seed), its arguments valid under the tool's
parameters schema (`jsonschema`), `parallel_tool_calls: false` with a
named function, the tool's result sent back and a final answer with
`tool_choice: "none"`, and bad tools refused. Every check runs; the script
exits 1 if any failed.
"""

import json
import sys

import jsonschema
import openai
from openai import OpenAI
from client_checks import check, report, section

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def schemas(spec):
    return {t["function"]["name"]: t["function"].get("parameters", {}) for t in spec["tools"]}


def check_calls(calls, spec, what):
    """Each call names a tool and has arguments valid under its schema."""
    by_name = schemas(spec)
    check(calls, f"{what}: no tool calls")
    for c in calls or []:
        check(c.type == "function" and c.id.startswith("call_"), f"{what}: call {c}")
        check(c.function.name in by_name, f"{what}: unknown function {c.function.name}")
        try:
            args = json.loads(c.function.arguments)
            jsonschema.validate(args, by_name.get(c.function.name, {}))
        except Exception as e:  # noqa: BLE001
            check(False, f"{what}: arguments {c.function.arguments!r}: {e}")


def streamed_calls(chunks):
    """The calls of a stream's `delta.tool_calls`, joined by index."""
    calls = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    check(d.id and d.id.startswith("call_") and d.type == "function",
                          f"the first delta of call {d.index} has its id and type: {d}")
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


@section
def forced_call(client, spec):
    model, tools = spec["model"], spec["tools"]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model=model, messages=messages, tools=tools, tool_choice="required",
               max_tokens=200, seed=11, extra_body=NO_THINKING)
    r = client.chat.completions.create(**ask)
    choice = r.choices[0]
    check(choice.finish_reason == "tool_calls", f"required: finish_reason {choice.finish_reason}")
    check(choice.message.content is None, f"required: content {choice.message.content!r}")
    check_calls(choice.message.tool_calls, spec, "required")
    whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]

    chunks = list(client.chat.completions.create(**ask, stream=True))
    check(streamed_calls(chunks) == whole,
          f"streamed calls {streamed_calls(chunks)} != the whole reply's {whole}")
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check(reasons == ["tool_calls"], f"streamed finish_reason {reasons}")

    # A named function, one call only.
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**{**ask, "tool_choice": named,
                                          "parallel_tool_calls": False, "seed": 5})
    calls = r.choices[0].message.tool_calls or []
    check(len(calls) == 1 and calls[0].function.name == "get_weather",
          f"named: {len(calls)} calls {calls}")
    check_calls(calls, spec, "named")

    # The tool's result goes back; the final answer is text.
    call = calls[0] if calls else choice.message.tool_calls[0]
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "{\"temperature\": 21}"},
    ]
    r = client.chat.completions.create(model=model, messages=history, tools=tools,
                                       tool_choice="none", max_tokens=8, seed=2,
                                       extra_body=NO_THINKING)
    final = r.choices[0]
    check(final.finish_reason in ("stop", "length"), f"final finish_reason {final.finish_reason}")
    check(not final.message.tool_calls, f"tool_choice none: calls {final.message.tool_calls}")
    check(isinstance(final.message.content, str), f"final content {final.message.content!r}")
    check(r.usage.prompt_tokens > 0, "final usage")


@section
def bad_tools(client, spec):
    messages = [{"role": "user", "content": "hi"}]
    for tools, choice, named in [
        ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools[0].function.name"),
        (spec["tools"], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (spec["tools"], "sometimes", "tool_choice"),
    ]:
        try:
            client.chat.completions.create(model=spec["model"], messages=messages,
                                           tools=tools, tool_choice=choice, max_tokens=4)
            check(False, f"{named}: no error")
        except openai.BadRequestError as e:
            check(named in str(e), f"{named}: the error does not name it: {e}")


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print(f"openai {openai.__version__} against {spec['base_url']}", flush=True)
    client = OpenAI(base_url=spec["base_url"], api_key="unused", max_retries=0, timeout=300)
    forced_call(client, spec)
    bad_tools(client, spec)
    report()


if __name__ == "__main__":
    main()
