"""The tokenizer path: the sim model loads like a real one, round-trips, streams whole chars."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.tokenization import (
    ChatTemplateError,
    IncrementalDetokenizer,
    load_tokenizer,
    sim_model_dir,
)

ROOT = Path(__file__).resolve().parent.parent
TOK = load_tokenizer(None)
MULTIBYTE = "naïve 東京 🙂"


def stream(ids: list[int], use_byte_table: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(TOK, use_byte_table=use_byte_table)
    return [detok.push([i]) for i in ids] + [detok.flush()]


def test_default_is_the_packaged_sim_model_and_cached():
    assert load_tokenizer(None) is load_tokenizer("") is load_tokenizer(str(sim_model_dir()))
    packaged = resources.files("serving").joinpath("assets/sim-model/tokenizer.json")
    assert packaged.is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (sim_model_dir() / name).stat().st_size < 500 * 1024


def test_vocabulary_and_special_tokens():
    assert 2_000 <= TOK.vocab_size <= 4_000
    assert TOK.eos_token_id is not None and TOK.bos_token_id is not None
    assert TOK.eos_token_id in TOK.special_token_ids
    assert TOK.decode([TOK.eos_token_id]) == ""
    # Plain text never turns into special tokens by encode's own doing.
    assert TOK.eos_token_id not in TOK.encode("end of text")


@pytest.mark.parametrize(
    "text", ["The gateway sits between tenants and pools.", MULTIBYTE, "  spaces\tand\nlines ", ""]
)
def test_round_trip(text):
    assert TOK.decode(TOK.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text().filter(lambda s: "<|" not in s))
def test_round_trip_any_text(text):
    assert TOK.decode(TOK.encode(text)) == text


def test_corpus_words_are_few_tokens():
    # A BPE trained on the corpus compresses it: well under one token per 3 characters.
    text = "The scheduler picks the request with the smallest virtual finish tag."
    assert len(TOK.encode(text)) < len(text) / 3


def test_chat_template_with_generation_prompt():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a token?"},
    ]
    rendered = TOK.render_chat(messages)
    assert rendered.startswith("<|bos|><|system|>\nBe brief.<|eos|>")
    assert rendered.endswith("<|user|>\nWhat is a token?<|eos|>\n<|assistant|>\n")
    ids = TOK.apply_chat_template(messages)
    assert ids[0] == TOK.bos_token_id
    assert ids.count(TOK.eos_token_id) == 2
    assert TOK.decode(ids, skip_special_tokens=False) == rendered
    without = TOK.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(ids) > len(without)


def test_chat_template_rejects_unknown_role():
    with pytest.raises(ChatTemplateError, match="unknown role"):
        TOK.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_incremental_detokenizer_never_emits_half_characters():
    ids = TOK.encode(MULTIBYTE)
    # The emoji and the ideographs are split across byte-level tokens: some token alone is not
    # valid UTF-8, so a naive per-token decode would show replacement characters.
    assert any(TOK.decode([i]).count("\ufffd") for i in ids)
    for use_table in (True, False):
        chunks = stream(ids, use_byte_table=use_table)
        assert "".join(chunks) == MULTIBYTE
        assert not any("\ufffd" in c for c in chunks)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=40))
def test_streamed_text_equals_full_decode(ids):
    # Also for arbitrary (even invalid UTF-8) token sequences, on both paths.
    full = TOK.decode(ids)
    assert "".join(stream(ids)) == full
    assert "".join(stream(ids, use_byte_table=False)) == full


def test_a_real_model_dir_layout_loads_the_same_way(tmp_path):
    # Variants real model dirs use: AddedToken dicts, a list of named templates, a separate
    # chat_template.jinja file (newer transformers).
    src = sim_model_dir()
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    config["eos_token"] = {"content": "<|eos|>", "special": True}
    config["chat_template"] = [{"name": "default", "template": template}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    assert tok is not TOK and tok.eos_token_id == TOK.eos_token_id
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == TOK.apply_chat_template(msgs)
    jinja_dir = tmp_path / "jinja"
    jinja_dir.mkdir()
    shutil.copy(src / "tokenizer.json", jinja_dir / "tokenizer.json")
    (jinja_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_tokenizer(str(jinja_dir)).render_chat(msgs) == "hi"


@pytest.mark.slow
def test_build_script_is_deterministic_and_committed_files_are_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_sim_tokenizer.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_the_developer_role_maps_to_what_each_template_supports(tmp_path):
    """OpenAI's ``developer`` role is rendered as ``system`` by a template that does not know
    it (the simulated model's), and kept by one that names it."""
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    as_system = [{"role": "system", "content": "Be brief."}, msgs[1]]
    assert TOK.developer_role == "system"
    assert TOK.apply_chat_template(msgs) == TOK.apply_chat_template(as_system)
    knows = tmp_path / "knows"
    knows.mkdir()
    shutil.copy(sim_model_dir() / "tokenizer.json", knows / "tokenizer.json")
    (knows / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'developer' %}D:{% endif %}"
        "{{ m['content'] }}|{% endfor %}")
    tok = load_tokenizer(str(knows))
    assert tok.developer_role == "developer"
    assert tok.decode(tok.apply_chat_template(msgs)) == "D:Be brief.|hi|"
