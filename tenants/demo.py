"""What the quick start prints so a newcomer can stream a completion at once (README)."""

from __future__ import annotations

DEMO_MODEL = "sim-small"
DEMO_EMBED_MODEL = "sim-embed"  # an embedding model, so /v1/embeddings works out of the box


def try_it(base_url: str, key: str | None = None) -> str:
    """A curl line and a few lines of Python with the official client, both streaming, and a
    curl line for the demo embedding model.

    Without ``key`` both read it from the ``IGW_KEY`` environment variable (``serve`` prints
    this form: the key itself is shown only once, by ``bootstrap_demo``).
    """
    shell_key = key or "$IGW_KEY"
    py_key = f'"{key}"' if key else 'os.environ["IGW_KEY"]'
    py_import = "" if key else "import os\n  "
    body = (f'{{"model": "{DEMO_MODEL}", "stream": true, '
            '"messages": [{"role": "user", "content": "Hello"}]}')
    return f"""\
Stream a completion with curl:
  curl -N {base_url}/v1/chat/completions -H "Authorization: Bearer {shell_key}" \\
    -H "Content-Type: application/json" \\
    -d '{body}'
or with the openai client (.venv/bin/python):
  {py_import}from openai import OpenAI
  client = OpenAI(base_url="{base_url}/v1", api_key={py_key})
  for chunk in client.chat.completions.create(
          model="{DEMO_MODEL}", messages=[{{"role": "user", "content": "Hello"}}], stream=True):
      print(chunk.choices[0].delta.content or "", end="", flush=True)
Embed text with the embedding model:
  curl {base_url}/v1/embeddings -H "Authorization: Bearer {shell_key}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{DEMO_EMBED_MODEL}", "input": "Hello"}}'"""
