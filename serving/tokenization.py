"""Tokenizer loading: a Hugging Face ``tokenizer.json`` plus the chat template of its model dir.

Admission counts tokens with the engine's own tokenizer (the design's "tokenizer mismatch"
failure mode), so the gateway and every engine load tokenizers here, through one code path:
the simulated model's directory (``serving/assets/sim-model``, built by
``scripts/build_sim_tokenizer.py``) is laid out like a real model's, and a real model directory
loads the same way.
"""

from __future__ import annotations

import codecs
import json
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

SIM_MODEL_DIR = "assets/sim-model"


class ChatTemplateError(ValueError):
    """The messages do not fit the model's chat template (unknown role, missing field...)."""


@cache
def sim_model_dir() -> Path:
    """The built-in simulated model directory, from the installed package's data (looked up
    once: ``importlib.resources`` costs a sixth of a millisecond, and every request asks)."""
    return Path(str(resources.files("serving").joinpath(SIM_MODEL_DIR)))


def load_tokenizer(path: str | None = None) -> HFTokenizer:
    """Load (once per process and path) the tokenizer of a model directory; None = the sim model."""
    return _load(str(Path(path).resolve()) if path else str(sim_model_dir()))


@lru_cache(maxsize=16)
def _load(model_dir: str) -> HFTokenizer:
    root = Path(model_dir)
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    return HFTokenizer(tokenizer, config, _chat_template(root, config))


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    # Newer transformers write the template to its own file; older ones keep it in the config,
    # either as a string or as a list of named templates.
    jinja_file = root / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def developer_role_of(chat_template: str | None) -> str:
    """The role a model's template gives OpenAI's ``developer`` messages: ``developer`` when the
    template names that role (it renders it itself), else ``system``. Read from the template,
    so every model, the simulated one included, maps by what its own template supports."""
    return "developer" if chat_template and "developer" in chat_template else "system"


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-unicode map, inverted (what the ByteLevel decoder undoes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with its model dir's special tokens and chat template."""

    def __init__(
        self, tokenizer: Tokenizer, config: dict[str, Any], chat_template: str | None
    ) -> None:
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id: int | None = self._id_of(self.eos_token)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.model_max_length = int(config.get("model_max_length") or 0) or None
        self.special_token_ids = frozenset(
            tid for tid, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )
        self._template = self._compile(chat_template) if chat_template else None
        self.developer_role = developer_role_of(chat_template)
        self.token_bytes = self._token_bytes()

    def _id_of(self, token: str | None) -> int | None:
        return self._tok.token_to_id(token) if token else None

    @staticmethod
    def _compile(source: str) -> jinja2.Template:
        # The same environment options transformers uses, so real models' templates render alike.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise_exception
        return env.from_string(source)

    def _token_bytes(self) -> tuple[bytes, ...] | None:
        """Bytes of every token id, when the decoder is byte-level (decode = concat + UTF-8).

        Lets streaming decode a token with a table lookup instead of a tokenizer call. Special
        tokens map to b"" because decode skips them. None for other decoders (SentencePiece
        style), which use the slower generic path.
        """
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        table = _byte_decoder()
        added = self._tok.get_added_tokens_decoder()
        out: list[bytes] = []
        for tid in range(self.vocab_size):
            if tid in added:
                out.append(b"" if added[tid].special else added[tid].content.encode())
                continue
            piece = self._tok.id_to_token(tid) or ""
            out.append(bytes(table[c] for c in piece))
        return tuple(out)

    def vocab_pieces(self) -> list[str]:
        """Every token's spelling in the vocabulary, added tokens included."""
        return list(self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, without BOS/EOS (what admission counts for a prompt)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text for a chat; ``tools`` (OpenAI's function tools) as HF passes
        them, so a model's own template renders its tool prompt."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids for a chat, ending with the assistant's generation prompt."""
        # The template writes BOS itself, so no special tokens are added on top (as in HF).
        return self.encode(self.render_chat(self.map_roles(messages), add_generation_prompt,
                                            tools))

    def map_roles(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """OpenAI's ``developer`` role as this model's template knows it: kept where the
        template names it, else sent as ``system`` (what vLLM and OpenAI do for such models)."""
        if self.developer_role == "developer":
            return messages
        return [{**m, "role": "system"} if m.get("role") == "developer" else m
                for m in messages]

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns streamed token ids into text, never emitting half a character.

    A multi-byte character (an emoji, a CJK ideograph) can span several byte-level tokens. Text
    is emitted only once its bytes are complete; ``flush()`` returns what is left at the end
    (a lone incomplete tail becomes U+FFFD, as the full decode would show it).
    """

    def __init__(self, tokenizer: HFTokenizer, use_byte_table: bool = True) -> None:
        # The byte table is the fast path; the generic one serves other decoders (and tests).
        self._table = tokenizer.token_bytes if use_byte_table else None
        self._tokenizer = tokenizer
        if self._table is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded for context (generic path)
        self._read = 0  # ids before this are already emitted as text (generic path)

    def push(self, token_ids: list[int]) -> str:
        """Text completed by these new tokens (maybe empty)."""
        if self._table is not None:
            table = self._table
            return self._utf8.decode(b"".join([table[t] for t in token_ids]))
        return self._push_generic(token_ids)

    def push_one(self, token_id: int) -> str:
        """``push([token_id])`` without building a list: the simulated engine's hot path."""
        if self._table is not None:
            return self._utf8.decode(self._table[token_id])
        return self._push_generic([token_id])

    def _push_generic(self, token_ids: list[int]) -> str:
        # Decode a window starting a few tokens back so decoders that depend on the previous
        # token (leading-space handling) see context; emit only when no character is cut.
        self._ids.extend(token_ids)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        if self._table is not None:
            return self._utf8.decode(b"", final=True)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]
