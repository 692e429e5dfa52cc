"""Drives a running metrale server's structured output with the official `openai` client.

Run with the path of a JSON spec:

    python3 structured_client.py SPEC.json

where SPEC.json is

    {"base_url": "http://127.0.0.1:PORT/v1", "model": "NAME",
     "corpus": "/abs/path/tests/fixtures/schemas/corpus.json",
     "seeds": [1, 2, 3], "max_tokens": N, "workers": 8}

(optional: "json_object_max_tokens", the max_tokens of the json_object
requests, default max_tokens). `openai` (1.109.1) and `jsonschema` must be
importable (the caller sets PYTHONPATH).

Every corpus schema is requested under every seed as a strict
`response_format` json_schema, sampled at temperature 1, and the reply must
finish with "stop" (a reply cut by max_tokens is a failure), parse as JSON and
validate against the schema (Draft 2020-12). Then json_object, the vLLM
extra-body spellings (`structured_outputs` choice / regex / grammar / json,
`guided_json`, `guided_choice`, `guided_regex`), a constrained completions
request, and malformed constraints (400s).

Every check runs (a failure does not stop the others); each failure is
printed, a summary line gives the requests, the failures and the longest
reply, and the script exits 1 if any check failed, 0 otherwise.
"""

import importlib.metadata
import json
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
from jsonschema import Draft202012Validator
from openai import OpenAI

import client_checks
from client_checks import FAILURES, check, section

REQUESTS = 0
LONGEST = (0, "")  # (characters, which request)
LOCK = threading.Lock()

MESSAGES = [{"role": "user", "content": "Reply with JSON."}]
CHOICES = ["yes", "no", "maybe"]
REGEX = "[0-9]{3}-[a-z]{2}"
# A small Lark grammar with a rule, an alternative and an imported terminal;
# bounded, so a sampled reply always ends well inside max_tokens.
GRAMMAR = 'start: "ab" | "cd" DIGIT DIGIT?\n%import common.DIGIT\n'
GRAMMAR_MATCH = re.compile(r"ab|cd[0-9]{1,2}")
MALFORMED_SCHEMA = {"type": "object", "properties": 5}


def short(text, n=200):
    text = repr(text)
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"


def note_reply(text, what):
    global LONGEST
    if isinstance(text, str) and len(text) > LONGEST[0]:
        LONGEST = (len(text), what)


def run_all(workers, jobs):
    """Runs `jobs`, (label, request, verify) triples, `workers` requests at a
    time; then calls verify(label, response) for each in order, here in the
    main thread. A request that raises is a failure of that job."""
    global REQUESTS

    def call(request):
        global REQUESTS
        with LOCK:
            REQUESTS += 1
        try:
            return request(), None
        except Exception as e:  # noqa: BLE001 - reported below
            return None, e

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(call, request) for _, request, _ in jobs]
        for (label, _, verify), fut in zip(jobs, futures):
            response, err = fut.result()
            if err is not None:
                check(False, f"{label}: {type(err).__name__}: {err}")
                continue
            try:
                verify(label, response)
            except Exception as e:  # noqa: BLE001
                check(False, f"{label}: checking the reply raised {type(e).__name__}: {e}")


def expect_error(kind, call, what, status=None):
    """`call()` must raise the client's `kind` (with `status`); counted as a request."""
    global REQUESTS
    REQUESTS += 1
    client_checks.expect_error(kind, call, what, status)


# ----------------------------------------------------------------- requests


def chat_request(client, spec, seed, max_tokens=None, **kw):
    return lambda: client.chat.completions.create(
        model=spec["model"], messages=MESSAGES, temperature=1.0, seed=seed,
        max_tokens=max_tokens or spec["max_tokens"], **kw)


def finished(label, choice, text):
    """The reply ended with "stop" and has a text; a failure (once) otherwise."""
    note_reply(text, label)
    if choice.finish_reason != "stop":
        check(False, f"{label}: finish_reason {choice.finish_reason!r}, expected 'stop' "
                     f"(cut at max_tokens?); the reply {short(text)}")
        return False
    if not isinstance(text, str):
        check(False, f"{label}: no text: {choice}")
        return False
    return True


def chat_reply(label, r):
    """The reply's text if it finished with "stop"; None (a failure) otherwise."""
    choice = r.choices[0]
    text = choice.message.content
    return text if finished(label, choice, text) else None


def verify_schema(schema, text, label):
    """`text` parses as JSON and validates against `schema`."""
    if text is None:
        return
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as e:
        check(False, f"{label}: not JSON ({e}): {short(text)}")
        return
    try:
        jsonschema.validate(instance, schema, cls=Draft202012Validator)
    except jsonschema.ValidationError as e:
        check(False, f"{label}: does not validate ({e.message} at {list(e.absolute_path)}): "
                     f"{short(text)}")
        return
    check(True, label)


def schema_checker(schema):
    def verify(label, r):
        verify_schema(schema, chat_reply(label, r), label)
    return verify


# ----------------------------------------------------------------- sections


@section
def json_schema_corpus(client, spec, corpus):
    jobs = []
    for entry in corpus:
        rf = {"type": "json_schema",
              "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}
        for seed in spec["seeds"]:
            jobs.append((f"{entry['name']} seed {seed}",
                         chat_request(client, spec, seed, response_format=rf),
                         schema_checker(entry["schema"])))
    before = len(FAILURES)
    run_all(spec["workers"], jobs)
    print(f"json_schema: {len(jobs)} requests ({len(corpus)} schemas x {len(spec['seeds'])} "
          f"seeds), {len(FAILURES) - before} failures", flush=True)


@section
def json_object(client, spec):
    max_tokens = spec.get("json_object_max_tokens", spec["max_tokens"])

    def verify(label, r):
        text = chat_reply(label, r)
        if text is None:
            return
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            check(False, f"{label}: not JSON ({e}): {short(text)}")
            return
        check(isinstance(value, dict), f"{label}: not a JSON object: {short(text)}")

    jobs = [(f"json_object seed {seed}",
             chat_request(client, spec, seed, max_tokens, response_format={"type": "json_object"}),
             verify)
            for seed in range(1, 21)]
    run_all(spec["workers"], jobs)


def choice_checker(choices):
    def verify(label, r):
        text = chat_reply(label, r)
        if text is not None:
            check(text in choices, f"{label}: {short(text)} is not one of {choices}")
    return verify


def regex_checker(pattern):
    def verify(label, r):
        text = chat_reply(label, r)
        if text is not None:
            check(re.fullmatch(pattern, text) is not None,
                  f"{label}: {short(text)} does not match {pattern!r}")
    return verify


@section
def extra_body(client, spec, corpus):
    """The vLLM spellings, passed through extra_body."""
    jobs = []
    picks = corpus[::len(corpus) // 5][:5]
    for seed in spec["seeds"]:
        def job(label, body, verify, seed=seed):
            jobs.append((f"{label} seed {seed}",
                         chat_request(client, spec, seed, extra_body=body), verify))

        job("structured_outputs choice", {"structured_outputs": {"choice": CHOICES}},
            choice_checker(CHOICES))
        job("structured_outputs regex", {"structured_outputs": {"regex": REGEX}},
            regex_checker(REGEX))
        job("structured_outputs grammar", {"structured_outputs": {"grammar": GRAMMAR}},
            regex_checker(GRAMMAR_MATCH.pattern))
        job("guided_choice", {"guided_choice": CHOICES}, choice_checker(CHOICES))
        job("guided_regex", {"guided_regex": REGEX}, regex_checker(REGEX))
        for entry in picks:
            job(f"guided_json {entry['name']}", {"guided_json": entry["schema"]},
                schema_checker(entry["schema"]))
            job(f"structured_outputs json {entry['name']}",
                {"structured_outputs": {"json": entry["schema"]}},
                schema_checker(entry["schema"]))
    run_all(spec["workers"], jobs)


@section
def completions(client, spec, corpus):
    """The legacy completions endpoint takes the constraint too."""
    picks = corpus[1::len(corpus) // 3][:3]

    def checker(schema):
        def verify(label, r):
            choice = r.choices[0]
            if finished(label, choice, choice.text):
                verify_schema(schema, choice.text, label)
        return verify

    jobs = []
    for entry in picks:
        for seed in spec["seeds"]:
            jobs.append((
                f"completions structured_outputs json {entry['name']} seed {seed}",
                lambda entry=entry, seed=seed: client.completions.create(
                    model=spec["model"], prompt="x", temperature=1.0, seed=seed,
                    max_tokens=spec["max_tokens"],
                    extra_body={"structured_outputs": {"json": entry["schema"]}}),
                checker(entry["schema"])))
    run_all(spec["workers"], jobs)


@section
def malformed(client, spec):
    m, mt = spec["model"], spec["max_tokens"]
    expect_error(
        openai.BadRequestError,
        lambda: client.chat.completions.create(
            model=m, messages=MESSAGES, max_tokens=mt,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": MALFORMED_SCHEMA,
                                             "strict": True}}),
        "a malformed schema (response_format)", 400)
    expect_error(
        openai.BadRequestError,
        lambda: client.chat.completions.create(
            model=m, messages=MESSAGES, max_tokens=mt,
            extra_body={"guided_json": MALFORMED_SCHEMA}),
        "a malformed schema (guided_json)", 400)
    expect_error(
        openai.BadRequestError,
        lambda: client.completions.create(
            model=m, prompt="x", max_tokens=mt,
            extra_body={"structured_outputs": {"json": MALFORMED_SCHEMA}}),
        "a malformed schema (completions, structured_outputs json)", 400)
    expect_error(
        openai.BadRequestError,
        lambda: client.chat.completions.create(
            model=m, messages=MESSAGES, max_tokens=mt,
            extra_body={"structured_outputs": {"regex": "[0-9"}}),
        "an unclosed regex (structured_outputs regex)", 400)


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with open(spec["corpus"]) as f:
        corpus = json.load(f)
    print(f"openai {openai.__version__}, jsonschema {importlib.metadata.version('jsonschema')}, "
          f"against {spec['base_url']}: {len(corpus)} schemas, seeds {spec['seeds']}, "
          f"max_tokens {spec['max_tokens']}, {spec['workers']} workers", flush=True)
    client = OpenAI(base_url=spec["base_url"], api_key="unused", max_retries=0, timeout=600)
    json_schema_corpus(client, spec, corpus)
    json_object(client, spec)
    extra_body(client, spec, corpus)
    completions(client, spec, corpus)
    malformed(client, spec)
    # The server still answers after all that.
    run_all(1, [("after the errors", chat_request(client, spec, spec["seeds"][0],
                 extra_body={"guided_choice": CHOICES}), choice_checker(CHOICES))])
    print(f"structured: {REQUESTS} requests, longest reply {LONGEST[0]} chars "
          f"({LONGEST[1] or 'none'})", flush=True)
    client_checks.report()


if __name__ == "__main__":
    main()
