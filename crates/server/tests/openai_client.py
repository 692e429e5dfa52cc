"""Drives a running metrale server with the official `openai` Python client.

Run by crates/server/tests/server/openai_client.rs, which starts the servers,
computes the expected greedy texts with the metrale library and passes
everything in a JSON file:

    python3 openai_client.py SPEC.json

Every check runs (a failure does not stop the others); each failure is
printed, and the script exits 1 if any check failed, 0 otherwise.
"""

import json
import math
import sys

import openai
from openai import OpenAI
from client_checks import check, expect_error, report, section



@section
def models(client, spec):
    ids = [m.id for m in client.models.list().data]
    check(ids == [spec["model"]], f"models.list: {ids}")


@section
def completions(client, spec):
    want = spec["completion"]
    prompt, max_tokens = want["prompt"], want["max_tokens"]
    r = client.completions.create(
        model=spec["model"], prompt=prompt, max_tokens=max_tokens, temperature=0)
    text = r.choices[0].text
    check(text == want["text"],
          f"greedy completion {text!r} != metrale generate's {want['text']!r}")
    check(r.choices[0].finish_reason == want["finish_reason"],
          f"completion finish_reason {r.choices[0].finish_reason}, expected {want['finish_reason']}")
    check(r.object == "text_completion", f"completion object {r.object}")
    u = r.usage
    check(u is not None and u.prompt_tokens == want["prompt_tokens"],
          f"completion usage.prompt_tokens {u and u.prompt_tokens}, expected {want['prompt_tokens']}")
    check(u is not None and u.completion_tokens == want["completion_tokens"],
          f"completion usage.completion_tokens {u and u.completion_tokens}, expected {want['completion_tokens']}")
    check(u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens,
          f"completion usage.total_tokens {u}")

    # Streamed: the chunks add up to the same text; include_usage adds a
    # last chunk with no choices and the usage.
    chunks = list(client.completions.create(
        model=spec["model"], prompt=prompt, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    check(streamed == want["text"],
          f"streamed greedy completion {streamed!r} != {want['text']!r}")
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    check(reasons == [want["finish_reason"]], f"streamed completion finish_reasons {reasons}")
    last = chunks[-1]
    check(last.choices == [] and last.usage is not None
          and last.usage.completion_tokens == want["completion_tokens"]
          and last.usage.prompt_tokens == want["prompt_tokens"],
          f"streamed completion usage chunk {last}")


@section
def chat(client, spec):
    want = spec["chat"]
    r = client.chat.completions.create(
        model=spec["model"], messages=want["messages"], max_tokens=want["max_tokens"],
        temperature=0)
    msg = r.choices[0].message
    check(msg.role == "assistant", f"chat role {msg.role}")
    check(msg.content == want["text"],
          f"greedy chat {msg.content!r} != the library's templated generation {want['text']!r}")
    check(r.choices[0].finish_reason == want["finish_reason"],
          f"chat finish_reason {r.choices[0].finish_reason}, expected {want['finish_reason']}")
    check(r.object == "chat.completion", f"chat object {r.object}")
    check(r.usage.prompt_tokens == want["prompt_tokens"]
          and r.usage.completion_tokens == want["completion_tokens"]
          and r.usage.total_tokens == want["prompt_tokens"] + want["completion_tokens"],
          f"chat usage {r.usage}, expected {want['prompt_tokens']} + {want['completion_tokens']}")

    # max_completion_tokens is the newer spelling of max_tokens.
    r = client.chat.completions.create(
        model=spec["model"], messages=want["messages"],
        max_completion_tokens=want["max_tokens"], temperature=0)
    check(r.choices[0].message.content == want["text"],
          f"chat with max_completion_tokens: {r.choices[0].message.content!r}")

    chunks = list(client.chat.completions.create(
        model=spec["model"], messages=want["messages"], max_tokens=want["max_tokens"],
        temperature=0, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    check(deltas and deltas[0].role == "assistant", f"first chat delta {deltas[:1]}")
    streamed = "".join(d.content or "" for d in deltas)
    check(streamed == want["text"], f"streamed greedy chat {streamed!r} != {want['text']!r}")
    check(all(c.object == "chat.completion.chunk" for c in chunks), "chat chunk objects")
    last = chunks[-1]
    check(last.choices == [] and last.usage is not None
          and last.usage.completion_tokens == want["completion_tokens"],
          f"streamed chat usage chunk {last}")


@section
def stop(client, spec):
    want = spec["completion"]
    text = want["text"]
    if len(text) < 6:
        check(False, f"the greedy text {text!r} is too short to cut a stop string from")
        return
    stop = text[3:5]
    expected = text[: text.find(stop)]
    for stops in (stop, [stop, "\u0001never"]):
        r = client.completions.create(
            model=spec["model"], prompt=want["prompt"], max_tokens=want["max_tokens"],
            temperature=0, stop=stops)
        check(r.choices[0].text == expected,
              f"stop {stops!r}: {r.choices[0].text!r}, expected {expected!r}")
        check(r.choices[0].finish_reason == "stop",
              f"stop {stops!r}: finish_reason {r.choices[0].finish_reason}")
    chunks = list(client.completions.create(
        model=spec["model"], prompt=want["prompt"], max_tokens=want["max_tokens"],
        temperature=0, stop=stop, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    check(streamed == expected, f"streamed stop {stop!r}: {streamed!r}, expected {expected!r}")
    # Chat, too.
    chat_text = spec["chat"]["text"]
    if len(chat_text) >= 6:
        cstop = chat_text[3:5]
        r = client.chat.completions.create(
            model=spec["model"], messages=spec["chat"]["messages"],
            max_tokens=spec["chat"]["max_tokens"], temperature=0, stop=[cstop])
        check(r.choices[0].message.content == chat_text[: chat_text.find(cstop)],
              f"chat stop {cstop!r}: {r.choices[0].message.content!r}")
        check(r.choices[0].finish_reason == "stop", "chat stop finish_reason")


@section
def seed(client, spec):
    prompt = spec["completion"]["prompt"]

    def sample(seed):
        r = client.completions.create(
            model=spec["model"], prompt=prompt, max_tokens=12, temperature=1.0,
            seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text

    a, b = sample(7), sample(7)
    check(a == b, f"seed 7 twice gave {a!r} and {b!r}")
    others = [sample(s) for s in (8, 9, 10)]
    check(any(o != a for o in others), f"seeds 8, 9, 10 all gave seed 7's text {a!r}")
    # Chat with a seed.
    msgs = spec["chat"]["messages"]
    ca = client.chat.completions.create(
        model=spec["model"], messages=msgs, max_tokens=8, temperature=1.0, seed=3)
    cb = client.chat.completions.create(
        model=spec["model"], messages=msgs, max_tokens=8, temperature=1.0, seed=3)
    check(ca.choices[0].message.content == cb.choices[0].message.content,
          "chat: the same seed gave different texts")


@section
def n_choices(client, spec):
    want = spec["completion"]
    r = client.completions.create(
        model=spec["model"], prompt=want["prompt"], max_tokens=want["max_tokens"],
        temperature=0, n=3)
    check([c.index for c in r.choices] == [0, 1, 2], f"n=3 indices {[c.index for c in r.choices]}")
    check(all(c.text == want["text"] for c in r.choices),
          f"n=3 greedy choices {[c.text for c in r.choices]}")
    check(r.usage.prompt_tokens == want["prompt_tokens"],
          f"n=3 prompt_tokens {r.usage.prompt_tokens}: the prompt is counted once")
    check(r.usage.completion_tokens == 3 * want["completion_tokens"],
          f"n=3 completion_tokens {r.usage.completion_tokens}")
    # Sampled choices under one seed: reproducible as a set.
    runs = []
    for _ in range(2):
        r = client.chat.completions.create(
            model=spec["model"], messages=spec["chat"]["messages"], max_tokens=6,
            temperature=1.0, seed=11, n=2)
        check(sorted(c.index for c in r.choices) == [0, 1], f"chat n=2 indices {r.choices}")
        runs.append([c.message.content for c in r.choices])
    check(runs[0] == runs[1], f"chat n=2 with a seed: {runs}")
    # Streamed n: every index gets its own finish.
    chunks = list(client.completions.create(
        model=spec["model"], prompt=want["prompt"], max_tokens=4, temperature=0, n=2,
        stream=True))
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    check(finished == [0, 1], f"streamed n=2 finishes {finished}")


@section
def logprobs(client, spec):
    want = spec["completion"]
    r = client.completions.create(
        model=spec["model"], prompt=want["prompt"], max_tokens=want["max_tokens"],
        temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = want["completion_tokens"]
    check(lp is not None and len(lp.tokens) == n and len(lp.token_logprobs) == n,
          f"completion logprobs: {n} tokens expected, got {lp}")
    if lp is not None:
        check(all(x <= 0 and math.isfinite(x) for x in lp.token_logprobs),
              f"token_logprobs {lp.token_logprobs}")
        ref = want["logprobs"]
        check(all(abs(a - b) <= 1e-4 for a, b in zip(lp.token_logprobs, ref)),
              f"token_logprobs {lp.token_logprobs} != the library's {ref}")
        check(lp.top_logprobs is not None and len(lp.top_logprobs) == n,
              f"top_logprobs {lp.top_logprobs}")
        for i, top in enumerate(lp.top_logprobs or []):
            check(1 <= len(top) <= 2, f"top_logprobs[{i}] {top}")
            # Greedy: the sampled token is the most likely one.
            check(abs(max(top.values()) - lp.token_logprobs[i]) <= 1e-6,
                  f"greedy token {i} logprob {lp.token_logprobs[i]} is not the top {top}")
        check(lp.text_offset == sorted(lp.text_offset), f"text_offset {lp.text_offset}")
    # Streamed: one logprob per token across the chunks.
    chunks = list(client.completions.create(
        model=spec["model"], prompt=want["prompt"], max_tokens=want["max_tokens"],
        temperature=0, logprobs=0, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    check(len(streamed) == n and all(abs(a - b) <= 1e-4 for a, b in zip(streamed, want["logprobs"])),
          f"streamed completion logprobs {streamed}")

    cw = spec["chat"]
    r = client.chat.completions.create(
        model=spec["model"], messages=cw["messages"], max_tokens=cw["max_tokens"],
        temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs and r.choices[0].logprobs.content
    check(content is not None and len(content) == cw["completion_tokens"],
          f"chat logprobs.content: {cw['completion_tokens']} entries expected, got {content}")
    for i, t in enumerate(content or []):
        check(len(t.top_logprobs) == 2, f"chat token {i}: top_logprobs {t.top_logprobs}")
        check(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob,
              f"chat token {i}: top_logprobs not best first")
        check(abs(t.top_logprobs[0].logprob - t.logprob) <= 1e-6,
              f"chat token {i}: greedy logprob {t.logprob} is not the top {t.top_logprobs[0]}")
        check(isinstance(t.bytes, list) and all(0 <= b < 256 for b in t.bytes),
              f"chat token {i}: bytes {t.bytes}")
    if content:
        joined = bytes(b for t in content for b in t.bytes)
        check(joined.decode("utf-8", errors="replace") == r.choices[0].message.content,
              f"chat: the tokens' bytes {joined!r} do not spell the reply {r.choices[0].message.content!r}")
    r = client.chat.completions.create(
        model=spec["model"], messages=cw["messages"], max_tokens=cw["max_tokens"],
        temperature=0, logprobs=True)
    content = r.choices[0].logprobs and r.choices[0].logprobs.content
    check(content is not None and all(t.top_logprobs == [] for t in content),
          f"chat logprobs without top_logprobs: {content}")


@section
def echo(client, spec):
    """`echo` with `logprobs`: the prompt's log-probabilities, as
    lm-evaluation-harness's log-likelihood requests read them, equal to the
    log-softmax of `metrale logits` on the same ids (within 1e-4)."""
    e = spec["echo"]
    ids, want = e["ids"], e["logprobs"]
    m = spec["model"]
    r = client.completions.create(model=m, prompt=ids, echo=True, max_tokens=0, logprobs=1)
    c = r.choices[0]
    lp = c.logprobs
    check(c.text == e["text"], f"echo: text {c.text!r}, expected the prompt {e['text']!r}")
    check(c.finish_reason == "length", f"echo: finish_reason {c.finish_reason!r}")
    check(len(lp.token_logprobs) == len(ids) and len(lp.tokens) == len(ids),
          f"echo: {len(lp.token_logprobs)} logprobs for {len(ids)} prompt tokens")
    check(lp.token_logprobs[0] is None and lp.top_logprobs[0] is None,
          "echo: the first token's logprob and alternatives are null")
    worst = max(abs(g - w) for g, w in zip(lp.token_logprobs[1:], want))
    check(worst <= 1e-4, f"echo: prompt logprobs off metrale logits by {worst}")
    for i, (tok, top) in enumerate(zip(lp.token_logprobs[1:], lp.top_logprobs[1:])):
        check(len(top) == 1 and max(top.values()) >= tok - 1e-6,
              f"echo: token {i + 1}: top {top} below its own {tok}")
    check(r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0,
          f"echo: usage {r.usage}")
    # With generated tokens after it: the prompt's part is unchanged.
    r = client.completions.create(model=m, prompt=ids, echo=True, max_tokens=3, logprobs=2,
                                  temperature=0)
    lp = r.choices[0].logprobs.token_logprobs
    check(len(lp) == len(ids) + 3, f"echo + 3 tokens: {len(lp)} logprobs")
    worst = max(abs(g - w) for g, w in zip(lp[1:len(ids)], want))
    check(worst <= 1e-4, f"echo + 3 tokens: prompt logprobs off by {worst}")
    check(r.choices[0].text.startswith(e["text"]), "echo + 3 tokens: the text starts with the prompt")
    # Streamed: the prompt is the first chunk; the chunks join to the whole.
    whole = client.completions.create(model=m, prompt=ids, echo=True, max_tokens=3, logprobs=2,
                                      temperature=0)
    chunks = list(client.completions.create(model=m, prompt=ids, echo=True, max_tokens=3,
                                            logprobs=2, temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    lps = [x for c in chunks if c.choices and c.choices[0].logprobs
           for x in c.choices[0].logprobs.token_logprobs]
    check(chunks[0].choices[0].text == e["text"], f"echo streamed: first chunk {chunks[0]}")
    check(text == whole.choices[0].text, f"echo streamed: {text!r} != {whole.choices[0].text!r}")
    check(len(lps) == len(whole.choices[0].logprobs.token_logprobs) and lps[0] is None
          and all(abs(a - b) <= 1e-6 for a, b in
                  zip(lps[1:], whole.choices[0].logprobs.token_logprobs[1:])),
          "echo streamed: the logprobs join to the whole reply's")
    # vLLM's prompt_logprobs: per token its id's logprob and rank, and the
    # K most likely.
    r = client.completions.create(model=m, prompt=ids, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    pl = (r.choices[0].model_extra or {}).get("prompt_logprobs")
    check(isinstance(pl, list) and len(pl) == len(ids) and pl[0] is None,
          f"prompt_logprobs: {pl!r}")
    if isinstance(pl, list) and len(pl) == len(ids):
        for i, (entry, w) in enumerate(zip(pl[1:], want)):
            own = entry.get(str(ids[i + 1]), {})
            check(abs(own.get("logprob", 1e9) - w) <= 1e-4 and own.get("rank", 0) >= 1
                  and 1 <= len(entry) <= 3,
                  f"prompt_logprobs token {i + 1}: {entry}, expected logprob {w}")
    # A text prompt is echoed as given; without logprobs there are none.
    r = client.completions.create(model=m, prompt="The quick", echo=True, max_tokens=2)
    check(r.choices[0].text.startswith("The quick") and r.choices[0].logprobs is None,
          f"echo of a text prompt: {r.choices[0]}")


@section
def errors(client, spec, keyed_url, key):
    m = spec["model"]
    expect_error(openai.NotFoundError,
                 lambda: client.completions.create(model="no-such-model", prompt="hi", max_tokens=2),
                 "an unknown model (completions)", 404, "model_not_found")
    expect_error(openai.NotFoundError,
                 lambda: client.chat.completions.create(
                     model="no-such-model", messages=[{"role": "user", "content": "hi"}]),
                 "an unknown model (chat)", 404, "model_not_found")
    expect_error(openai.BadRequestError,
                 lambda: client.completions.create(model=m, prompt="hi", max_tokens=-1),
                 "max_tokens -1", 400)
    expect_error(openai.BadRequestError,
                 lambda: client.completions.create(model=m, prompt="hi", max_tokens=10**9),
                 "a huge max_tokens", 400)
    expect_error(openai.BadRequestError,
                 lambda: client.completions.create(model=m, prompt="hi", temperature="hot"),
                 "a string temperature", 400)
    expect_error(openai.BadRequestError,
                 lambda: client.completions.create(model=m, prompt="hi", suffix="!"),
                 "suffix", 400)
    expect_error(openai.BadRequestError,
                 lambda: client.completions.create(model=m, prompt="hi", best_of=3, n=1),
                 "best_of > n", 400)
    expect_error(openai.BadRequestError,
                 lambda: client.chat.completions.create(
                     model=m, messages=[{"role": "user", "content": "hi"}],
                     tools=[{"type": "function", "function": {"name": "f g", "parameters": {}}}]),
                 "tools", 400)
    expect_error(openai.BadRequestError,
                 lambda: client.chat.completions.create(model=m, messages=[]),
                 "no messages", 400)

    wrong = OpenAI(base_url=keyed_url, api_key="wrong-key", max_retries=0, timeout=60)
    expect_error(openai.AuthenticationError,
                 lambda: wrong.completions.create(model=m, prompt="hi", max_tokens=2),
                 "a wrong API key", 401)
    expect_error(openai.AuthenticationError, lambda: wrong.models.list(),
                 "a wrong API key (models)", 401)
    right = OpenAI(base_url=keyed_url, api_key=key, max_retries=0, timeout=60)
    r = right.completions.create(model=m, prompt=spec["completion"]["prompt"],
                                 max_tokens=spec["completion"]["max_tokens"], temperature=0)
    check(r.choices[0].text == spec["completion"]["text"], "the right API key: wrong text")

    # The server is still healthy after all that.
    r = client.completions.create(model=m, prompt=spec["completion"]["prompt"],
                                  max_tokens=spec["completion"]["max_tokens"], temperature=0)
    check(r.choices[0].text == spec["completion"]["text"], "after the errors: wrong text")


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print(f"openai {openai.__version__} against {spec['base_url']}", flush=True)
    client = OpenAI(base_url=spec["base_url"], api_key="unused", max_retries=0, timeout=120)
    if spec.get("sections") == ["models", "chat"]:
        # Another model family: listed, and chatting streamed and not.
        models(client, spec)
        chat(client, spec)
    else:
        models(client, spec)
        completions(client, spec)
        chat(client, spec)
        stop(client, spec)
        seed(client, spec)
        n_choices(client, spec)
        logprobs(client, spec)
        echo(client, spec)
        errors(client, spec, spec["keyed_base_url"], spec["api_key"])
    report()


if __name__ == "__main__":
    main()
