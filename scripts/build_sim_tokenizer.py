"""Build the simulated model's tokenizer from the corpus the repo owns.

Trains a small byte-level BPE with the ``tokenizers`` library and writes a Hugging Face model
directory (``tokenizer.json`` + ``tokenizer_config.json`` with a Jinja chat template), so the
simulated engine's tokenizer loads through exactly the code path a real model's would.

    .venv/bin/python scripts/build_sim_tokenizer.py [--out DIR] [--check]

Deterministic: one training thread, fixed corpus order, sorted JSON keys; ``--check`` rebuilds
into a temporary directory and fails if the committed files differ.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import sys
import tempfile
from pathlib import Path

# Rayon's work splitting can reorder ties between equally frequent pairs: one thread keeps the
# merges (and so the token ids) identical from build to build. Must be set before the import.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "workers" / "assets" / "corpus" / "gateway_prose.txt"
OUT = ROOT / "serving" / "assets" / "sim-model"

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>"]
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
MODEL_MAX_LENGTH = 8192

# Each message is wrapped in its role token and closed with EOS, the generation prompt opens an
# assistant turn: the engine's EOS then ends the assistant's answer, as with real chat models.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # Tools go in a system turn of their own, Hermes style, before the conversation.
    "{% if tools %}"
    "{{ '<|system|>\nYou may call functions. Their signatures are within <tools></tools>:\n"
    "<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\nTo call one, answer with <tool_call>{\"name\": <function name>, "
    "\"arguments\": <arguments object>}</tool_call> for each call.' + eos_token + '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>' }}{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}{{ '</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def paragraphs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def train(corpus: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(paragraphs(corpus), trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write(out: Path, corpus: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok_json = json.loads(train(corpus).to_str())
    for name, obj in (("tokenizer.json", tok_json), ("tokenizer_config.json", tokenizer_config())):
        text = json.dumps(obj, ensure_ascii=False, indent=1, sort_keys=True) + "\n"
        (out / name).write_text(text, encoding="utf-8")


def check(corpus: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp), corpus)
        names = ["tokenizer.json", "tokenizer_config.json"]
        _, mismatch, errors = filecmp.cmpfiles(tmp, OUT, names, shallow=False)
    if mismatch or errors:
        print(
            f"out of date: {mismatch + errors}; run scripts/build_sim_tokenizer.py", file=sys.stderr
        )
        return 1
    print("sim tokenizer is up to date")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--check", action="store_true", help="verify the committed files")
    args = parser.parse_args()
    if args.check:
        return check(args.corpus)
    write(args.out, args.corpus)
    size = json.loads((args.out / "tokenizer.json").read_text())["model"]["vocab"]
    print(f"wrote {args.out} (vocab {len(size)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
