#!/usr/bin/env python3
"""Talk to a running `tether serve` with the official `openai` Python client.

    pip install openai
    ./target/release/tether serve --model tiny --port 8080 &
    python3 scripts/openai_client.py --base-url http://127.0.0.1:8080/v1

Lists the models, asks a chat question whole and streamed, continues the conversation (the
second turn reuses the first turn's state: see usage.prompt_tokens_details.cached_tokens),
runs a text completion, and shows that a bad request comes back as an OpenAI error.
Not part of CI: it needs the `openai` package and a server.
"""

import argparse
import sys

import openai


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()

    # The server has no authentication; the client insists on some key.
    client = openai.OpenAI(base_url=a.base_url, api_key="none")
    model = client.models.list().data[0].id
    print(f"model: {model}")

    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=a.max_tokens, temperature=0
    )
    reply = r.choices[0].message.content
    print(f"chat ({r.choices[0].finish_reason}): {reply!r}")
    print(f"  usage: {r.usage}")

    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And at sunset?"}]
    print("streamed second turn: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=a.max_tokens,
        temperature=0.7,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            usage = chunk.usage
    print()
    print(f"  usage: {usage}")
    if usage and usage.prompt_tokens_details:
        cached = usage.prompt_tokens_details.cached_tokens
        print(f"  reused {cached} of {usage.prompt_tokens} prompt tokens; prefilled {usage.prompt_tokens - cached}")

    c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=a.max_tokens, stop=["\n"])
    print(f"completion ({c.choices[0].finish_reason}): {c.choices[0].text!r}")

    try:
        client.chat.completions.create(model=model, messages=messages, temperature=5)
    except openai.BadRequestError as e:
        print(f"bad request, as expected: {e.status_code} {e.body}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
