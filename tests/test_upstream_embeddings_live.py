"""``/v1/embeddings`` passed through to a real upstream server: llama.cpp's (llama-cpp-python)
with embeddings on, serving the tiny random-weight Llama of ``tests/llama_model.py`` written
with mean pooling, behind an ``openai_upstream`` pool in the ``llama_cpp`` dialect, in front of
the real gateway and worker processes, called with the official openai client.

The tiny model's vocabulary is the gateway's tokenizer, so the gateway's count of input tokens
and the server's can be compared one to one. Skipped, saying why, without the ``llama`` extra.
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from serving.tokenization import load_tokenizer
from tests import procs, rkeys
from tests.factories import make_key, make_model, make_pool, make_tenant
from tests.llama_model import start_llama_server
from tests.procs import Server

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL = "up-embed"
MODEL = "tiny-embed"
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "2"}
TOK = load_tokenizer(None)
TEXTS = ["the gateway queues requests fairly", "zebras graze", "tokens are metered"]


@pytest.fixture(scope="module")
def llama_embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_llama_server(tmp_path_factory.mktemp("llama-embed"),
                                "as a real upstream embedding server", "--embedding", "true",
                                pooling="mean")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def system(live_system, llama_embedder) -> dict[str, Any]:
    owner: dict[str, Any] = {}

    def prepare() -> None:
        # llama.cpp takes no cache salt, so the pool must be dedicated to one tenant (I1).
        tenant = make_tenant()
        make_pool(make_model(MODEL, task="embed", engine_model_id="tiny", max_model_len=2048),
                  name=POOL, backend="openai_upstream", dedicated_to=tenant, max_sequences=1,
                  backend_settings={"base_url": llama_embedder.url, "model": "tiny",
                                    "dialect": "llama_cpp", "first_byte_timeout_s": 30.0})
        owner["tenant"] = tenant

    live = live_system(pool=POOL, worker_ids=["up-embed-1"], env=ENV, prepare=prepare)
    return {**live, "server": llama_embedder, "tenant": owner["tenant"]}


def client(system: dict[str, Any], plain: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=system["url"] + "/v1", api_key=plain, max_retries=0)


def server_embeddings(url: str, texts: list[str]) -> dict[str, Any]:
    body = {"model": "tiny", "input": texts}
    return httpx.post(url + "/v1/embeddings", json=body, timeout=30).json()


def records_of(redis_client, rid: str) -> list[dict[str, Any]]:
    return [r for r in rkeys.usage_records(redis_client) if r["request_id"] == rid]


def test_embeddings_pass_through_to_llama_cpp(system, redis_client) -> None:
    procs.wait_for_worker(redis_client, POOL, "up-embed-1", system["worker"], timeout=10)
    _, plain = make_key(system["tenant"])
    c = client(system, plain)
    direct = server_embeddings(system["server"].url, TEXTS)
    expected = sum(len(TOK.encode(t)) for t in TEXTS)
    assert direct["usage"]["prompt_tokens"] == expected  # the same tokenizer on both sides

    raw = c.embeddings.with_raw_response.create(model=MODEL, input=TEXTS,
                                                encoding_format="float")
    reply = raw.parse()
    assert [d.index for d in reply.data] == [0, 1, 2]
    vectors = [d.embedding for d in reply.data]
    assert all(len(v) == 64 for v in vectors)  # the server's width (the model's 64)
    for mine, theirs in zip(vectors, direct["data"], strict=True):
        assert mine == pytest.approx(theirs["embedding"], rel=1e-6, abs=1e-7)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == expected

    # base64 (the client decodes it): the server's numbers as float32.
    b64 = c.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="base64")
    packed = array("f")
    packed.frombytes(base64.b64decode(b64.data[0].embedding))  # type: ignore[arg-type]
    assert list(packed) == pytest.approx(direct["data"][1]["embedding"], rel=1e-6, abs=1e-7)
    default = c.embeddings.create(model=MODEL, input=[TOK.encode(TEXTS[2])])  # token ids
    assert default.data[0].embedding == pytest.approx(direct["data"][2]["embedding"], rel=1e-6,
                                                      abs=1e-7)

    # Settled once, with exactly the input tokens, and the slot given back.
    rid = raw.headers["x-request-id"]
    records = procs.wait_until(lambda: records_of(redis_client, rid), 10, "usage record")
    assert [(r["prompt_tokens"], r["completion_tokens"], r["status"])
            for r in records] == [(expected, 0, "ok")]  # type: ignore[attr-defined]
    conc = rkeys.counter_key("conc", system["tenant"].id)
    procs.wait_until(lambda: int(redis_client.get(conc) or 0) == 0, 5, "slot back")

    # llama.cpp cannot shorten embeddings (it would answer full width): a clear 400 naming
    # `dimensions`, refused before the server is called and charged nothing.
    with pytest.raises(openai.BadRequestError) as err:
        c.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=8)
    assert "dimensions" in str(err.value) and err.value.param == "dimensions"
    refused = err.value.response.headers["x-request-id"]
    settled = procs.wait_until(lambda: records_of(redis_client, refused), 10, "its record")
    assert [(r["prompt_tokens"], r["error_code"])
            for r in settled] == [(0, "engine_refused")]  # type: ignore[attr-defined]

    # Another tenant does not see the dedicated pool's model at all (I1).
    _, other = make_key(make_tenant())
    with pytest.raises(openai.NotFoundError):
        client(system, other).embeddings.create(model=MODEL, input=TEXTS[0])
