"""The tiny inputs every recipe runs on in the tests (a LLaMA and a Mistral with BPE tokenizers, a
T5, SFT / preference / KTO rows, a GRPO reward) and each recipe's command line over them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from _tok import corpus, make_bpe_tokenizer, make_t5_tokenizer

REPO = Path(__file__).resolve().parents[1]


def make_recipe_inputs(root: Path, hf_causal) -> dict[str, Path]:
    """Write the inputs under `root` (`hf_causal`: conftest's saver of tiny transformers checkpoints)."""
    llama = root / "llama"
    shutil.copytree(hf_causal("audit_recipes_llama"), llama)
    make_bpe_tokenizer(llama)
    mistral = root / "mistral"
    shutil.copytree(hf_causal("audit_recipes_mistral", model_type="mistral", sliding_window=8), mistral)
    make_bpe_tokenizer(mistral)

    import transformers

    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1, dropout_rate=0.0))  # no dropout: a resume at another world size is exact
    t5.save_pretrained(root / "t5")
    make_t5_tokenizer(root / "t5")

    lines = [t.split() for t in corpus(12, seed=3)]
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": " ".join(w[:3]), "completion": " ".join(w[3:]) or "end"}) + "\n"
                           for w in lines))
    prefs = root / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": " ".join(w[:3]), "chosen": " ".join(w[3:6]) or "yes",
                                         "rejected": " ".join(w[6:8]) or "no"}) + "\n" for w in lines))
    kto = root / "kto.jsonl"
    kto.write_text("".join(json.dumps({"prompt": " ".join(w[:3]), "completion": " ".join(w[3:6]) or "yes",
                                       "label": i % 2 == 0}) + "\n" for i, w in enumerate(lines)))
    rewards = root / "rewards.py"  # GRPO's reward: any function of the completions
    rewards.write_text("def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    return {"llama": llama, "mistral": mistral, "t5": root / "t5", "sft": sft, "prefs": prefs, "kto": kto,
            "root": root, "rewards": rewards}


def args_for(recipe: str, d: dict[str, Path]) -> list[str]:
    common = {"batch_size": "2", "lora_r": "4", "lora_alpha": "8", "device": "cpu", "out": str(d["root"] / "out")}
    per = {
        "sft_llama.py": {"model": d["llama"], "data": d["sft"]},
        "sft.py": {"model": d["llama"], "data": d["sft"]},  # sft_llama.py's family-agnostic alias
        "sft_mistral.py": {"model": d["mistral"], "data": d["sft"]},
        "dpo_mistral.py": {"model": d["mistral"], "data": d["prefs"], "eval_data": d["prefs"]},
        "distill_llama.py": {"model": d["llama"], "teacher": d["llama"], "data": d["sft"]},
        "ard_lora_llama.py": {"model": d["llama"], "data": d["sft"], "eval_data": d["sft"]},
        "lrc_llama.py": {"model": d["llama"], "data": d["sft"]},
        "lrc.py": {"model": d["llama"], "data": d["sft"]},
        "lora_t5.py": {"model": d["t5"], "data": d["sft"]},
        "kto_mistral.py": {"model": d["mistral"], "data": d["kto"], "eval_data": d["kto"]},
        "reward_model.py": {"model": d["llama"], "data": d["prefs"], "eval_data": d["prefs"]},
        "grpo_qwen.py": {"model": d["llama"], "data": d["sft"], "rewards": f"{d['rewards']}:length",
                         "num_generations": 2, "max_completion_length": 4},
    }
    assert recipe in per, f"recipes/{recipe}: add its command line to args_for in this test"
    return [str(REPO / "recipes" / recipe)] + [f"{k}={v}" for k, v in {**common, **per[recipe]}.items()]
