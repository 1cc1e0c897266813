"""Copyable first-request snippets (curl, Python ``openai``, JavaScript ``openai``), filled with
this site's base URL, a model the tenant may use and, right after a key is created, that key."""

from __future__ import annotations

import json

from django.http import HttpRequest

KEY_PLACEHOLDER = "$OPENAI_API_KEY"


def base_url(request: HttpRequest) -> str:
    """The OpenAI-compatible base URL as the browser reached this site (``…/v1``)."""
    return request.build_absolute_uri("/v1")


def snippets(base: str, model: str, key: str | None = None) -> list[tuple[str, str, str]]:
    """(id, label, code) for each language; without ``key`` the code reads it from the
    environment, so a snippet pasted into a shell or a repository carries no secret."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello"}]})
    curl_key = key or KEY_PLACEHOLDER
    py_key = f'"{key}"' if key else 'os.environ["OPENAI_API_KEY"]'
    js_key = f'"{key}"' if key else "process.env.OPENAI_API_KEY"
    curl = (f"curl {base}/chat/completions \\\n"
            f'  -H "Authorization: Bearer {curl_key}" \\\n'
            '  -H "Content-Type: application/json" \\\n'
            f"  -d '{body}'")
    python = ("import os\nfrom openai import OpenAI\n\n"
              f'client = OpenAI(base_url="{base}", api_key={py_key})\n'
              "reply = client.chat.completions.create(\n"
              f'    model="{model}",\n'
              '    messages=[{"role": "user", "content": "Say hello"}],\n)\n'
              "print(reply.choices[0].message.content)")
    javascript = ('import OpenAI from "openai";\n\n'
                  f'const client = new OpenAI({{ baseURL: "{base}", apiKey: {js_key} }});\n'
                  "const reply = await client.chat.completions.create({\n"
                  f'  model: "{model}",\n'
                  '  messages: [{ role: "user", content: "Say hello" }],\n});\n'
                  "console.log(reply.choices[0].message.content);")
    return [("snippet-curl", "curl", curl), ("snippet-python", "Python (openai)", python),
            ("snippet-js", "JavaScript (openai)", javascript)]
