"""Talk to `jaxseek serve` with the official `openai` client: list the model, complete a prompt, stream a chat,
ask for a JSON object under a schema, and count a prompt's tokens with `/tokenize`.

    jaxseek serve --port 8000 &                        # the bundled model on 127.0.0.1:8000
    python examples/client.py --base-url http://127.0.0.1:8000

Needs `pip install openai httpx`.
"""

import argparse
import json

import httpx
import openai


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key, max_retries=0)

    model = client.models.list().data[0].id
    print(f"model: {model} ({client.models.retrieve(model).max_model_len} tokens of context)")

    completion = client.completions.create(model=model, prompt="ROMEO:\nBut soft, what light",
                                           max_tokens=args.max_tokens, temperature=0)
    print("completion:", json.dumps(completion.choices[0].text))

    print("chat: ", end="", flush=True)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Who goes there?"}],
                                            max_tokens=args.max_tokens, stream=True, seed=1)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a king."}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "king", "schema": schema}})
    print("json:", json.loads(reply.choices[0].message.content))

    tokens = httpx.post(args.base_url + "/tokenize", json={"model": model, "prompt": "Who goes there?"},
                        headers={"Authorization": f"Bearer {args.api_key}"}).json()
    print(f"tokenize: {tokens['count']} tokens {tokens['tokens']}")


if __name__ == "__main__":
    main()
