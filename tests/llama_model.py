"""A tiny random-weight Llama model in GGUF, for running llama.cpp's server in tests.

It has the architecture of a real Llama (2 layers, 64 wide, grouped-query attention, SwiGLU)
but random weights, so it generates nonsense at thousands of tokens per second on a CPU. Its
vocabulary is the repo's own simulated model's byte-level BPE (``serving/assets/sim-model``),
written as a GPT-2 style GGUF tokenizer: llama.cpp then tokenizes exactly as the gateway does,
so the gateway's token counts and the upstream server's can be compared one to one.

    python -m tests.llama_model OUT.gguf      # writes the file (about 1 MB)

Needs the ``gguf`` and ``numpy`` packages (the ``llama`` extra installs both).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from serving.tokenization import sim_model_dir

if TYPE_CHECKING:
    from tests.procs import Server

WIDTH = 64
HEADS = 4
KV_HEADS = 2
LAYERS = 2
FFN = 128
CONTEXT = 2048

# What running llama.cpp's server needs (the ``llama`` extra); None when all is installed.
LLAMA_MISSING = next((m for m in ("llama_cpp", "gguf", "numpy")
                      if importlib.util.find_spec(m) is None), None)

# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*)
NORMAL, CONTROL = 1, 3


def _vocabulary(model_dir: Path) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """Tokens by id, their types, the BPE merges and the special tokens of a tokenizer.json."""
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if data["model"]["type"] != "BPE":
        raise ValueError("only byte-level BPE tokenizers can be written as a GPT-2 GGUF vocab")
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    vocab.update(special)
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]  # ids no token claims (none in our vocab)
    for piece, tid in vocab.items():
        tokens[tid] = piece
    types = [CONTROL if t in special else NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    return tokens, types, merges, special


def write_tiny_llama(path: str | Path, model_dir: str | Path | None = None, seed: int = 0,
                     pooling: str | None = None) -> Path:
    """Write the model; returns its path. Deterministic for a given seed.

    ``pooling`` (``"mean"``, ``"last"``, ...) makes it an embedding model: without a pooling type
    a causal LM's ``/v1/embeddings`` on llama.cpp's server is one vector per token, not per input.
    """
    import numpy as np
    from gguf import GGUFWriter, PoolingType

    root = Path(model_dir) if model_dir else sim_model_dir()
    config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokens, types, merges, special = _vocabulary(root)
    head_dim = WIDTH // HEADS
    out = Path(path)
    w = GGUFWriter(str(out), "llama")
    w.add_name("tiny-random-llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(WIDTH)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the GPT-2 pre-tokenizer regex, as the sim tokenizer's
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(special[config["bos_token"]])
    w.add_eos_token_id(special[config["eos_token"]])
    w.add_add_bos_token(False)  # the gateway sends exactly the ids (or text) it counted
    if pooling is not None:
        w.add_pooling_type(PoolingType[pooling.upper()])
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)

    ones = np.ones(WIDTH, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(len(tokens), WIDTH))
    for i in range(LAYERS):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", ones)
        w.add_tensor(f"{blk}.attn_q.weight", mat(HEADS * head_dim, WIDTH))
        w.add_tensor(f"{blk}.attn_k.weight", mat(KV_HEADS * head_dim, WIDTH))
        w.add_tensor(f"{blk}.attn_v.weight", mat(KV_HEADS * head_dim, WIDTH))
        w.add_tensor(f"{blk}.attn_output.weight", mat(WIDTH, HEADS * head_dim))
        w.add_tensor(f"{blk}.ffn_norm.weight", ones)
        w.add_tensor(f"{blk}.ffn_gate.weight", mat(FFN, WIDTH))
        w.add_tensor(f"{blk}.ffn_up.weight", mat(FFN, WIDTH))
        w.add_tensor(f"{blk}.ffn_down.weight", mat(WIDTH, FFN))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", mat(len(tokens), WIDTH))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def start_llama_server(tmp: Path, purpose: str, *extra: str, pooling: str | None = None) -> Server:
    """llama.cpp's server (llama-cpp-python) on the tiny model written into ``tmp``, one thread
    (the machine is shared); ``extra`` are more server options. Skips the test, saying why,
    without the ``llama`` extra."""
    import pytest

    from tests import procs

    if LLAMA_MISSING:
        pytest.skip(f"{LLAMA_MISSING} is not installed: pip install -e '.[llama]' to run "
                    f"llama.cpp's server {purpose}")
    model = write_tiny_llama(tmp / "tiny.gguf", pooling=pooling)
    port = procs.free_port()
    return procs.Server([sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                         "--model_alias", "tiny", "--port", str(port), "--n_ctx", str(CONTEXT),
                         "--n_threads", "1", *extra],
                        f"http://127.0.0.1:{port}", "/v1/models", tmp / "server.log")

if __name__ == "__main__":
    print(write_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama.gguf"))
