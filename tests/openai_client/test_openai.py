"""The official `openai` Python package drives `moe-lanes serve` (run by cli/tests/openai.rs).

Usage: python3 test_openai.py http://127.0.0.1:PORT   (the server serves a model with a
tokenizer and a chat template; temperatures 0 make answers deterministic).
Exits non-zero on the first failed check, printing what differed.
"""

import sys

import openai


def main(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    models = client.models.list()
    model = models.data[0].id
    check(len(models.data) == 1 and models.data[0].object == "model", f"models: {models}")

    # completion
    c = client.completions.create(model=model, prompt="Hello, world", max_tokens=8, temperature=0)
    check(c.object == "text_completion", f"completion object: {c}")
    check(len(c.choices) == 1 and isinstance(c.choices[0].text, str) and c.choices[0].text, f"completion: {c}")
    check(c.choices[0].finish_reason in ("stop", "length"), f"finish_reason: {c}")
    check(c.usage.completion_tokens >= 1 and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens, f"usage: {c.usage}")

    # streamed completion: the pieces join to the same text
    pieces = [ch.choices[0].text for ch in client.completions.create(model=model, prompt="Hello, world", max_tokens=8, temperature=0, stream=True) if ch.choices]
    check("".join(pieces) == c.choices[0].text, f"streamed completion {pieces!r} != {c.choices[0].text!r}")

    # seeded sampled completion: the same twice, another seed differs
    def sampled(seed):
        r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.2, top_p=0.95, seed=seed)
        return r.choices[0].text
    a, b, other = sampled(42), sampled(42), sampled(43)
    check(a == b, f"same seed, different text: {a!r} vs {b!r}")
    check(a != other, f"another seed, same text: {a!r}")

    # chat
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello in French."},
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    check(r.object == "chat.completion", f"chat object: {r}")
    msg = r.choices[0].message
    check(msg.role == "assistant" and isinstance(msg.content, str) and msg.content, f"chat message: {r}")
    check(r.choices[0].finish_reason in ("stop", "length"), f"chat finish: {r}")
    check(r.usage.prompt_tokens > 0 and r.usage.completion_tokens >= 1, f"chat usage: {r.usage}")

    # streaming chat: the first delta names the role, the deltas join to the same content
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    check(chunks[0].choices[0].delta.role == "assistant", f"first chunk: {chunks[0]}")
    check(all(ch.object == "chat.completion.chunk" for ch in chunks), "chunk objects")
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(content == msg.content, f"streamed chat {content!r} != {msg.content!r}")
    check(chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason, f"last chunk: {chunks[-1]}")

    # bad requests: OpenAI-shaped 400s the client raises as BadRequestError
    for kwargs, param in [
        (dict(prompt="Hello", max_tokens=10**7), "max_tokens"),
        (dict(prompt="Hello", temperature=-1), "temperature"),
    ]:
        try:
            client.completions.create(model=model, **kwargs)
        except openai.BadRequestError as e:
            check(e.status_code == 400 and e.body.get("param") == param and e.body.get("message"), f"error body: {e.body}")
        else:
            check(False, f"{kwargs}: no BadRequestError")
    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
    except openai.BadRequestError as e:
        check(e.body.get("param") == "messages", f"chat error body: {e.body}")
    else:
        check(False, "empty messages: no BadRequestError")
    print("openai client: all checks passed")


def check(ok: bool, what: str) -> None:
    if not ok:
        print("FAILED:", what, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
