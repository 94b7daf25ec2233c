"""minitrain export: GGUF files for llama.cpp, checked against llama.cpp itself.

Without llama.cpp (CI): the file's adapter fold against peft's `merge_and_unload`, the metadata
llama.cpp reads (bos / eos / add_bos as transformers' tokenizer has them, the chat template), and
the refusals. With llama-cpp-python installed (it builds from its source distribution with cmake
and a C++ compiler: `pip install llama-cpp-python`, several minutes on two cores), per family on a
tiny checkpoint saved by transformers with a tokenizer of that family's shape:

- tokenization of 20 strings (special tokens, unicode, leading / trailing spaces) equals ours
  (which equals transformers'). One difference is llama.cpp's own and is checked as such: with a
  sentencepiece model that puts a space before a text (LLaMA 2, Mistral, Phi-3), llama.cpp also
  puts one ("▁") before the text that follows a special token inside the string, where
  transformers does not;
- next-token logits of a prompt: an f32 file with an f32 KV cache within 1e-5 x max|logit| (the
  conversion is exact; Gemma within 1e-3: llama.cpp's CPU GELU reads an f16 table; Gemma 4, with a second GELU per
  layer, 3e-3, and exact to 1e-5 with its GELUs taken out), f16 within 3e-3 x max|logit| (f16 keeps 11 bits), bf16
  within 2e-2 (8 bits), q8_0 within 5e-2 x max|logit| (8-bit weights, and llama.cpp's CPU matmul quantizes
  activations to 8 bits too; Gemma 4's 16-bit and q8_0 files three times those, its MoE size's bf16 and q8_0
  0.2: the measurements beside GEMMA4_GELU_BY and BF16_BY);
- 32 greedy tokens (f16): our greedy sequence is fed to llama.cpp and its argmax at every step must
  be our token, except at a step where our top-2 logits are closer than the f16 tolerance (a tie
  f16 cannot decide; at most 8 of 32 allowed).

    pip install llama-cpp-python && python -m pytest tests/test_gguf.py   # the llama.cpp checks too
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _tok import (make_gemma_tokenizer, make_llama3_tokenizer, make_phi3_tokenizer, make_qwen_tokenizer,
                  make_sp_tokenizer)
from conftest import save_hf_causal

pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]

GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0}}
# name: (config overrides, tokenizer builder, vocab size)
FAMILIES = {
    "llama": (dict(model_type="llama", num_key_value_heads=2),
              lambda d: make_sp_tokenizer(d, 400, byte_fallback=True), 400),
    "llama3": (dict(model_type="llama", num_key_value_heads=2, rope_theta=500000.0), make_llama3_tokenizer, 325),
    "mistral": (dict(model_type="mistral", num_key_value_heads=2),
                lambda d: make_sp_tokenizer(d, 400, byte_fallback=True), 400),
    "qwen2": (dict(model_type="qwen2", num_key_value_heads=2, rope_theta=1000000.0), make_qwen_tokenizer, 305),
    "qwen3": (dict(model_type="qwen3", num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
              make_qwen_tokenizer, 305),
    "gemma2": (dict(model_type="gemma2", head_dim=16, num_key_value_heads=2, sliding_window=5, query_pre_attn_scalar=16,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
               make_gemma_tokenizer, 420),
    "gemma3": (dict(model_type="gemma3_text", head_dim=16, num_key_value_heads=2, sliding_window=5,
                    query_pre_attn_scalar=16, num_hidden_layers=3), make_gemma_tokenizer, 420),
    "phi3": (dict(model_type="phi3", num_key_value_heads=2), make_phi3_tokenizer, 411),
    # LLaMA with biases on the attention and MLP projections: llama.cpp's llama loader reads them
    "llama_bias": (dict(model_type="llama", num_key_value_heads=2, attention_bias=True, mlp_bias=True),
                   lambda d: make_sp_tokenizer(d, 400, byte_fallback=True), 400),
    # mixture-of-experts: top-2 of 4 experts; Qwen2-MoE's shared expert and its gate; Qwen3-MoE renormalised
    "qwen2_moe": (dict(model_type="qwen2_moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, initializer_range=0.2),
                  make_qwen_tokenizer, 305),
    "qwen3_moe": (dict(model_type="qwen3_moe", num_key_value_heads=2, head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, initializer_range=0.2),
                  make_qwen_tokenizer, 305),
    "mixtral": (dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=48, initializer_range=0.2),
                lambda d: make_sp_tokenizer(d, 400, byte_fallback=True), 400),
    # Qwen3.5: three DeltaNet layers (2 key heads, 4 value heads: llama.cpp's tiled value order) and a gated
    # full-attention layer with partial rotary
    "qwen3_5": (dict(model_type="qwen3_5_text", num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=4,
                     initializer_range=0.05), make_qwen_tokenizer, 305),
    # gpt-oss: sinks, sliding / full layers (window 5), YaRN past its 16 original positions, router and expert
    # biases, the SwiGLU clamp at llama.cpp's 7
    "gpt_oss": (dict(model_type="gpt_oss", num_key_value_heads=2, head_dim=16, num_local_experts=4,
                     num_experts_per_tok=2, intermediate_size=32, sliding_window=5, swiglu_limit=7.0,
                     max_position_embeddings=512, initializer_range=0.1,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
                make_qwen_tokenizer, 305),
    # the Qwen3.5 MoE sizes (qwen35moe): the same layers, every MLP top-2 of 4 experts and the shared expert
    "qwen3_5_moe": (dict(model_type="qwen3_5_moe_text", num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=4,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, initializer_range=0.05), make_qwen_tokenizer, 305),
    # Gemma 4 (gemma4): per-layer embeddings, sliding (head dim 16, window 5) / global layers (head dim 32, one kv
    # head, attention_k_eq_v: no v_proj), proportional RoPE on the global layers (half the pairs turned, base 100),
    # the last two layers reusing the keys of layers 2 / 3 and twice as wide, the final soft cap
    "gemma4": (dict(model_type="gemma4_text", num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                    use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=420,
                    sliding_window=5, final_logit_softcapping=5.0, rope_parameters=GEMMA4_ROPE,
                    layer_types=["sliding_attention", "full_attention"] * 3), make_gemma_tokenizer, 420),
    # the 31B layout: no PLE, no sharing, v_proj, its own lm_head, a proportional RoPE `factor`, no soft cap
    "gemma4_dense": (dict(model_type="gemma4_text", num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                          global_head_dim=32, hidden_size_per_layer_input=0, tie_word_embeddings=False,
                          sliding_window=5,
                          layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                          rope_parameters={**GEMMA4_ROPE, "full_attention": {**GEMMA4_ROPE["full_attention"],
                                                                             "factor": 2.0}}),
                     make_gemma_tokenizer, 420),
    # the 26B-A4B layout: the expert block (top 2 of 4; router scale, per-expert scale) beside each layer's MLP
    "gemma4_moe": (dict(model_type="gemma4_text", num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                        global_head_dim=32, hidden_size_per_layer_input=0, sliding_window=5,
                        layer_types=["sliding_attention", "full_attention"], enable_moe_block=True, num_experts=4,
                        top_k_experts=2, moe_intermediate_size=32, rope_parameters=GEMMA4_ROPE),
                   make_gemma_tokenizer, 420),
    # RoPE scalings llama.cpp takes as tensors; original context 16, so a longer prompt uses them
    "llama3_rope": (dict(model_type="llama", num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
                    make_llama3_tokenizer, 325),
    "phi3_longrope": (dict(model_type="phi3", num_key_value_heads=2, max_position_embeddings=64,
                           original_max_position_embeddings=16,
                           rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                         "long_factor": [1.0 + 0.5 * i for i in range(8)]}),
                      make_phi3_tokenizer, 411),
}
PARITY = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "llama_bias", "qwen2_moe",
          "qwen3_moe", "mixtral", "qwen3_5", "qwen3_5_moe", "gpt_oss", "gemma4", "gemma4_dense", "gemma4_moe"]
GEMMA4 = ["gemma4", "gemma4_dense", "gemma4_moe"]
STRINGS = ["Hello world", " leading space", "  two spaces", "tabs\tand\nnewlines\n\n", "ünïcödé façade naïve",
           "日本語のテキスト", "emoji 🦙🚀 ok", "numbers 12345 3.14", "the word of the day", "punctuation!?... (yes)",
           "MiXeD CaSe", "a", " ", "trailing space ", "line\r\nbreak", "end.", "x" * 30, "über straße"]
F16_TOL, BF16_TOL, Q8_TOL = 3e-3, 2e-2, 5e-2  # x max|logit|: f16 keeps 11 bits (2^-10 ~ 1e-3)
F32_TOL, F32_TOL_GELU = 1e-5, 1e-3  # f32 file, f32 cache: exact but for the order of sums; Gemma: GELU's f16 table
# Gemma 4: a GELU in every layer's per-layer input besides its MLP's (and the experts'), each through llama.cpp's f16
# table: x3. Without the GELUs (their output projections zeroed) the file is exact to F32_TOL
# (test_gemma4_is_exact_but_for_gelu)
GEMMA4_GELU_BY = 3
# MoE in a 16-bit file: the rounded weights before a router move its input, so the routing weights (and, near a
# tie, the choice of expert; the routers themselves are written f32 as llama.cpp's converter writes them), so the
# rounding error is not only the weights'; Qwen3.5: the rounded decay and beta projections
# (`ssm_alpha`, `ssm_beta`) move every later token's state through the recurrence: f16 / bf16 / q8_0
# tolerances x3 for both (f32 stays exact)
LOOSER = ("qwen2_moe", "qwen3_moe", "mixtral", "qwen3_5", "qwen3_5_moe")
LOOSER_BY = 3
# q8_0 on the Qwen3.5 MoE: our own model with its weights rounded to q8_0 (the routers kept f32, as in the file)
# moves its logits by 0.186 x max|logit| (max|logit| 1.46; the rounding changes the experts of two of the prompt's
# tokens), llama.cpp's file by 0.187: the rounding's, not the file's. x4 there
Q8_BY = {"qwen3_5_moe": 4, "gemma4_moe": 4}
# Gemma 4 in a 16-bit or q8_0 file: no 1/sqrt(hd) on the attention scores (q and k normed, scale 1), so a rounded q
# or k moves the softmax more than in the other families; measured on `gemma4` (PLE, shared keys), our own model with
# its weights rounded (no rounded activations, no f16 KV cache) moves the logits by 7.6e-3 (f16), 2.4e-2 (bf16),
# 8.5e-2 (q8_0) of max|logit|, llama.cpp's files by 5.7e-3, 2.8e-2, 0.126: x3 (GEMMA4). The MoE size: llama.cpp's
# CPU matmul rounds the activations of a bf16 file to bf16 as it quantizes a q8_0 file's to 8 bits, and on this
# tiny model that flips a routing at the prompt's last token: our model with bf16 weights and bf16 inputs to every
# projection moves by 0.172, llama.cpp's bf16 file by 0.173 (q8_0: ours 0.168 with the weights rounded alone,
# llama.cpp 0.173): bf16 x10 there (and q8_0 x4 above); f16 and greedy decoding stay close
BF16_BY = {"gemma4_moe": 10}
PROMPT = "the word of the day is"


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            overrides, tokenizer, vocab = FAMILIES[name]
            kw = dict(overrides)
            d = save_hf_causal(tmp_path_factory.mktemp(f"gguf_{name}"), seed=3, model_type=kw.pop("model_type"),
                               vocab_size=vocab, **kw)
            if name in GEMMA4:
                perturb_scales(d)
            tokenizer(d)
            cache[name] = d
        return cache[name]

    return make


def perturb_scales(folder: Path) -> None:
    """Gemma 4's scales start at 1 (each layer's `layer_scalar`, the MoE router's `scale` and `per_expert_scale`):
    moved so that a file that dropped one would show it."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state, g = load_file(path), torch.Generator().manual_seed(1)
    for k, t in state.items():
        if k.endswith(("layer_scalar", ".scale", "per_expert_scale")):
            state[k] = t + 0.3 * torch.randn(t.shape, generator=g)
    save_file(state, path, metadata={"format": "pt"})


def tool():
    import importlib

    mod = importlib.import_module("minitrain.commands.export")
    return mod


def export(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = tool().main([str(a) for a in args])
    return code, capsys.readouterr().err


def fields(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items()}


# ----------------------------------------------------------------------------- without llama.cpp


def test_adapter_is_folded_in_as_peft_merges_it(family, tmp_path, capsys):
    """The exported blocks equal peft's merge_and_unload of the same adapter (f32 file, read back)."""
    import gguf
    import peft
    import transformers

    from minitrain.export.gguf_file import FAMILIES as ARCHS, gguf_tensors

    base = family("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    pm.save_pretrained(tmp_path / "adapter")
    merged = pm.merge_and_unload().state_dict()
    code, err = export(capsys, "--model", base, "--adapter", tmp_path / "adapter", "--out", tmp_path / "m.gguf",
                       "--type", "f32")
    assert code == 0, err
    config = json.loads((base / "config.json").read_text())
    want = gguf_tensors(merged, config, ARCHS["qwen2"])
    got = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert set(got) == set(want)
    for name in ("blk.0.attn_q.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight", "blk.0.attn_q.bias"):
        assert torch.allclose(got[name].reshape(want[name].shape), want[name], atol=1e-6), name
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    before = gguf_tensors(plain, config, ARCHS["qwen2"])
    assert not torch.allclose(before["blk.0.attn_q.weight"], want["blk.0.attn_q.weight"])  # the adapter did change it


def test_metadata_llama_cpp_reads(family, tmp_path, capsys):
    """bos / eos / add_bos as transformers' tokenizer has them; the chat template; the token count."""
    import transformers

    for name in ("llama", "qwen3"):
        folder = tmp_path / name
        shutil.copytree(family(name), folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        code, err = export(capsys, "--model", folder, "--out", tmp_path / f"{name}.gguf")
        assert code == 0, err
        f = fields(tmp_path / f"{name}.gguf")
        ref = transformers.AutoTokenizer.from_pretrained(folder)
        assert f["tokenizer.ggml.eos_token_id"] == ref.eos_token_id
        assert f.get("tokenizer.ggml.bos_token_id") == ref.bos_token_id
        with_bos = ref.encode("a")[:1] == [ref.bos_token_id] if ref.bos_token_id is not None else False
        assert f["tokenizer.ggml.add_bos_token"] == with_bos
        assert f["tokenizer.chat_template"] == cfg["chat_template"]
        assert len(f["tokenizer.ggml.tokens"]) == json.loads((folder / "config.json").read_text())["vocab_size"]
        assert f["general.architecture"] == {"llama": "llama", "qwen3": "qwen3"}[name]


@pytest.mark.parametrize("change, args, needle", [
    ({}, ("--type", "q4_k"), "--type q4_k: not one of f32, f16, bf16, q8_0"),
    ({}, ("--adapter", "MISSING"), "no adapter_config.json"),
    ({"model_type": "t5"}, (), "GGUF export takes"),
    ({"sliding_window": 8, "max_position_embeddings": 256}, (), "sliding_window=8"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, (), "rope_scaling 'dynamic'"),
])
def test_refusals_are_one_line_and_write_nothing(family, tmp_path, capsys, change, args, needle):
    folder = tmp_path / "m"
    shutil.copytree(family("llama"), folder)
    cfg = {**json.loads((folder / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(cfg))
    args = [str(tmp_path / "nope") if a == "MISSING" else a for a in args]
    code, err = export(capsys, "--model", folder, "--out", tmp_path / "x.gguf", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# a family's config that llama.cpp's architecture would run as another model: (family, change, the line's words)
FAMILY_REFUSALS = [
    # Phi-3-mini-4k (sliding_window 2047 of 4096): llama.cpp runs Phi's attention over the whole context
    ("phi3", {"sliding_window": 8, "max_position_embeddings": 256},
     "sliding_window=8 — llama.cpp's phi3 attends to the whole context"),
    # llama.cpp's qwen3moe renormalises the top-k weights and makes every layer sparse
    ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "with dense layers"),
    # llama.cpp's gpt-oss clamps its SwiGLU at 7 and makes the even layers sliding, whatever the config says
    ("gpt_oss", {"swiglu_limit": 1.0}, "swiglu_limit=1.0"),
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]}, "do not alternate"),
    ("gemma2", {"query_pre_attn_scalar": 24}, "query_pre_attn_scalar=24"),
    ("gemma2", {"tie_word_embeddings": False}, "own lm_head"),
    # llama.cpp's qwen35 places its attention layers by full_attention_interval alone
    # llama.cpp's gemma4 gives a sharing layer the keys of the layer before the first sharing one (global) or of the
    # one before that (sliding), has no attention biases, turns the sliding layers with the default RoPE and reads
    # one per-layer embedding row per token
    ("gemma4", {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                "full_attention", "full_attention"]}, "num_kv_shared_layers=2"),
    ("gemma4", {"attention_bias": True}, "attention_bias=true"),
    ("gemma4", {"rope_parameters": {**GEMMA4_ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                         "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention"),
    ("gemma4", {"vocab_size_per_layer_input": 400}, "vocab_size_per_layer_input=400"),
    ("qwen3_5", {"layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]},
     "full_attention_interval"),
]


@pytest.mark.parametrize("name, change, needle", FAMILY_REFUSALS, ids=lambda x: x if isinstance(x, str) else "")
def test_configs_llama_cpp_would_run_otherwise_are_refused(family, tmp_path, capsys, name, change, needle):
    folder = tmp_path / "m"
    shutil.copytree(family(name), folder)
    cfg = {**json.loads((folder / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(cfg))
    code, err = export(capsys, "--model", folder, "--out", tmp_path / "x.gguf")
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.gguf").exists()


def test_llama_biases_are_written_where_llama_cpp_reads_them(family, tmp_path, capsys):
    from gguf import GGUFReader

    code, err = export(capsys, "--model", family("llama_bias"), "--out", tmp_path / "b.gguf")
    assert code == 0, err
    names = {t.name for t in GGUFReader(str(tmp_path / "b.gguf")).tensors}
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        assert f"blk.0.{part}.bias" in names, (part, sorted(names))


def test_adapter_of_another_base_is_refused(family, tmp_path, capsys):
    from _tok import corpus

    from minitrain.cli import run_cli

    other = tmp_path / "other"
    shutil.copytree(family("qwen2"), other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(4, seed=2)))
    assert run_cli([str(REPO / "recipes" / "sft.py"), f"model={other}", f"data={data}", f"out={tmp_path / 'run'}",
                    "max_steps=1", "batch_size=2", "lora_r=2", "device=cpu"]) == 0
    code, err = export(capsys, "--model", family("qwen2"), "--adapter", tmp_path / "run" / "adapter",
                       "--out", tmp_path / "x.gguf")
    assert code == 2 and "was trained on another base model" in err, err
    assert not (tmp_path / "x.gguf").exists()


def test_lrc_adapter_needs_its_quantized_base(family, tmp_path, capsys):
    """A low-rank-correction adapter corrects the ternary base: without --quantize it is refused (one line)."""
    from _tok import corpus

    from minitrain.cli import run_cli

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(4, seed=2)))
    run = tmp_path / "lrc"
    assert run_cli([str(REPO / "recipes" / "lrc.py"), f"model={family('qwen2')}", f"data={data}", f"out={run}",
                    "max_steps=1", "batch_size=2", "lora_r=2", "device=cpu", "quantize=ternary"]) == 0
    code, err = export(capsys, "--model", family("qwen2"), "--adapter", run / "adapter", "--out", tmp_path / "x.gguf")
    assert code == 2 and "--quantize ternary" in err and len(err.strip().splitlines()) == 1, err
    code, err = export(capsys, "--model", family("qwen2"), "--adapter", run / "adapter", "--out", tmp_path / "x.gguf",
                       "--quantize", "ternary")
    assert code == 0, err


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_multimodal_folder_writes_its_language_model(family, tmp_path, capsys, name):
    """A `Qwen3_5ForConditionalGeneration` (`Qwen3_5MoeForConditionalGeneration`) folder (a vision tower beside
    the language model) writes the same qwen35 (qwen35moe) file as the text checkpoint of its language model:
    every tensor equal, none of the tower's."""
    import gguf
    import transformers

    text = family(name)
    tcfg = json.loads((text / "config.json").read_text())
    inner = {k: v for k, v in tcfg.items() if k not in ("architectures", "model_type", "transformers_version", "dtype")}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=tcfg["hidden_size"],
                  patch_size=4, temporal_patch_size=2, num_position_embeddings=16)
    cfg = (transformers.Qwen3_5MoeConfig if name == "qwen3_5_moe" else transformers.Qwen3_5Config)(
        text_config=inner, vision_config=vision, image_token_id=300, video_token_id=301, vision_start_token_id=302,
        vision_end_token_id=303, tie_word_embeddings=tcfg.get("tie_word_embeddings", False))
    mm = transformers.AutoModelForImageTextToText.from_config(cfg)
    lm = transformers.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    mm.model.language_model.load_state_dict(lm.model.state_dict())
    mm.lm_head.load_state_dict(lm.lm_head.state_dict())
    mm.save_pretrained(tmp_path / "mm")
    for f in text.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "mm" / f.name)
    read, arch = {}, {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}[name]
    for which, folder in (("text", text), ("mm", tmp_path / "mm")):
        code, err = export(capsys, "--model", folder, "--out", tmp_path / f"{which}.gguf", "--type", "f32")
        assert code == 0, err
        reader = gguf.GGUFReader(str(tmp_path / f"{which}.gguf"))
        read[which] = {t.name: t.data.copy() for t in reader.tensors}
        assert fields(tmp_path / f"{which}.gguf")["general.architecture"] == arch
    assert set(read["mm"]) == set(read["text"]), set(read["mm"]) ^ set(read["text"])
    for n, t in read["text"].items():
        assert (read["mm"][n] == t).all(), n


def test_gemma4_multimodal_folder_writes_its_language_model(family, tmp_path, capsys):
    """A `Gemma4ForConditionalGeneration` folder (vision and audio towers beside the language model) writes the
    same gemma4 file as the text checkpoint of its language model: every tensor equal, none of the towers'."""
    import gguf
    import transformers

    text = family("gemma4")
    tcfg = json.loads((text / "config.json").read_text())
    inner = {k: v for k, v in tcfg.items() if k not in ("architectures", "model_type", "transformers_version", "dtype")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=16)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=32)
    cfg = transformers.Gemma4Config(text_config=inner, vision_config=vision, audio_config=audio, image_token_id=410,
                                    video_token_id=411, audio_token_id=412, boi_token_id=413, eoi_token_id=414,
                                    boa_token_id=415, eoa_token_index=416,
                                    tie_word_embeddings=tcfg.get("tie_word_embeddings", True))
    mm = transformers.Gemma4ForConditionalGeneration(cfg)
    lm = transformers.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    mm.model.language_model.load_state_dict(lm.model.state_dict())
    mm.lm_head.load_state_dict(lm.lm_head.state_dict())
    mm.save_pretrained(tmp_path / "mm")
    for f in text.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "mm" / f.name)
    read = {}
    for which, folder in (("text", text), ("mm", tmp_path / "mm")):
        code, err = export(capsys, "--model", folder, "--out", tmp_path / f"{which}.gguf", "--type", "f32")
        assert code == 0, err
        read[which] = {t.name: t.data.copy() for t in gguf.GGUFReader(str(tmp_path / f"{which}.gguf")).tensors}
        assert fields(tmp_path / f"{which}.gguf")["general.architecture"] == "gemma4"
    assert set(read["mm"]) == set(read["text"]), set(read["mm"]) ^ set(read["text"])
    for n, t in read["text"].items():
        assert (read["mm"][n] == t).all(), n


# ----------------------------------------------------------------------------- against llama.cpp


def our_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.output_projection(model(torch.tensor([ids])))[0].float()


def one_space_more_after_specials(ours: list[int], theirs: list[int], specials: set[int], space: int,
                                  start: int) -> bool:
    """llama.cpp's sentencepiece puts "▁" before the text after a special token of the string (from
    `start`: not after the bos it adds): theirs is ours with one there."""
    fixed = []
    for i, t in enumerate(ours):
        fixed.append(t)
        if i >= start and t in specials and i + 1 < len(ours) and ours[i + 1] not in specials:
            fixed.append(space)
    return fixed == theirs


@pytest.mark.parametrize("name", PARITY)
def test_llama_cpp_parity(family, tmp_path, capsys, name):
    llama_cpp_parity(family(name), tmp_path, capsys, name, STRINGS)


def test_the_demo_exports_and_llama_cpp_runs_it(tmp_path, capsys):
    """The built-in demo's tokenizer.json is a Metaspace BPE without tokenizer.model: it exports as
    llama.cpp's sentencepiece vocabulary (scores from the merge ranks), checked on the demo's own rows
    (it has no byte pieces, so text outside its 320 pieces is not llama.cpp's to encode)."""
    rows = [json.loads(line) for line in (REPO / "demo" / "sft_train.jsonl").read_text().splitlines()[:6]]
    strings = [m["content"] for r in rows for m in r.get("messages", [])] or [r["prompt"] for r in rows]
    llama_cpp_parity(REPO / "demo" / "model", tmp_path, capsys, "demo", strings[:12])


def llama_cpp_parity(folder: Path, tmp_path: Path, capsys, name: str, strings: list[str]) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    import models
    from minitrain.text.tokenizer import Tokenizer
    from minitrain.weights import load_pretrained

    tok = Tokenizer.from_folder(folder)
    model = load_pretrained(folder, models.from_hf_config, dtype=torch.float32).eval()
    files = {}
    for kind in ("f32", "f16", "bf16", "q8_0"):
        files[kind] = tmp_path / f"{name}.{kind}.gguf"
        code, err = export(capsys, "--model", folder, "--out", files[kind], "--type", kind)
        assert code == 0, err
    llm = llama_cpp.Llama(model_path=str(files["f16"]), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    # tokenization: 18 plain strings and 2 with special tokens inside
    specials = [s for s in tok.special_strings() if s]
    strings = strings + [f"{specials[0]} after special", f"before {specials[-1]} mid"]
    special_ids = {tok.token_to_id(s) for s in specials}
    sp_with_prefix = fields(files["f16"]).get("tokenizer.ggml.add_space_prefix", False)
    for s in strings:
        ours, theirs = tok.encode(s, bos=tok.add_bos), llm.tokenize(s.encode(), add_bos=True, special=True)
        if ours != theirs and sp_with_prefix and special_ids & set(ours):
            space = tok.token_to_id("\u2581")
            assert one_space_more_after_specials(ours, theirs, special_ids, space, int(tok.add_bos)), (s, ours, theirs)
        else:
            assert ours == theirs, (s, ours, theirs)
    # logits of a prompt
    prompt = tok.encode(PROMPT, bos=tok.add_bos)
    ours = our_logits(model, prompt).numpy()
    scale = float(np.abs(ours).max())
    f32 = getattr(llama_cpp, "GGML_TYPE_F32", 0)
    exact = (F32_TOL_GELU * (GEMMA4_GELU_BY if name in GEMMA4 else 1)) if "gemma" in name else F32_TOL
    k = LOOSER_BY if name in LOOSER or name in GEMMA4 else 1
    f16_tol = k * F16_TOL
    for kind, tol in (("f32", exact), ("f16", f16_tol), ("bf16", BF16_BY.get(name, k) * BF16_TOL),
                      ("q8_0", Q8_BY.get(name, k) * Q8_TOL)):
        # f32: the weights as they are and an f32 KV cache (llama.cpp's default cache is f16)
        cache = {"type_k": f32, "type_v": f32} if kind == "f32" else {}
        m = llm if kind == "f16" else llama_cpp.Llama(model_path=str(files[kind]), n_ctx=128, logits_all=True,
                                                      verbose=False, n_threads=2, **cache)
        m.reset()
        m.eval(prompt)
        diff = float(np.abs(np.array(m.scores[: len(prompt)]) - ours).max())
        print(f"{name} {kind}: max|logit diff| {diff:.3g}, {diff / scale:.3g} of max|logit| ({scale:.3g})")
        assert diff <= tol * scale, (kind, diff, scale)
    # 32 greedy tokens, f16: our greedy sequence fed to llama.cpp token by token; at each step its argmax
    # must be ours, except at a tie f16 cannot decide (our top-2 closer than the f16 tolerance)
    gen = models.family(model).generate(model, torch.tensor([prompt]), max_new_tokens=32, eos_token_id=[])
    gen = gen[0, len(prompt):].tolist()
    llm.reset()
    llm.eval(prompt + gen)
    theirs = np.array(llm.scores[len(prompt) - 1: len(prompt) + 31]).argmax(-1).tolist()
    margins = torch.topk(our_logits(model, prompt + gen)[len(prompt) - 1: len(prompt) + 31], 2).values
    margins = (margins[:, 0] - margins[:, 1]).tolist()
    ties = [i for i, m in enumerate(margins) if m < f16_tol * scale]
    differ = [i for i in range(32) if gen[i] != theirs[i] and i not in ties]
    print(f"{name}: greedy {32 - len(ties)} of 32 steps compared ({len(ties)} ties), {len(differ)} differ")
    assert not differ, f"{name}: greedy steps {differ}: ours {[gen[i] for i in differ]}, llama.cpp " \
                       f"{[theirs[i] for i in differ]}"
    assert len(ties) <= 8  # most steps are decided


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_is_exact_but_for_gelu(family, tmp_path, capsys, name):
    """Gemma 4 with its GELU paths taken out (the MLPs', the experts' and the per-layer inputs' output projections
    zeroed): an f32 file with an f32 KV cache gives our logits to F32_TOL, the conversion's own exactness, on a
    prompt past the window of 5 (the shared keys, k_eq_v, both head dims, proportional RoPE, the router's and
    per-expert scales are all still in the path; the per-layer embeddings' context part only through the GELU)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np
    from safetensors.torch import load_file, save_file

    import models
    from minitrain.text.tokenizer import Tokenizer
    from minitrain.weights import load_pretrained

    folder = tmp_path / "m"
    shutil.copytree(family(name), folder)
    state = load_file(folder / "model.safetensors")
    for k in state:
        if k.endswith(("mlp.down_proj.weight", "per_layer_projection.weight", "experts.down_proj")):
            state[k] = torch.zeros_like(state[k])
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    code, err = export(capsys, "--model", folder, "--out", tmp_path / "m.gguf", "--type", "f32")
    assert code == 0, err
    tok = Tokenizer.from_folder(folder)
    prompt = tok.encode("the word of the day is a long sentence that goes past the window", bos=tok.add_bos)
    f32 = getattr(llama_cpp, "GGML_TYPE_F32", 0)
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=64, logits_all=True, verbose=False,
                          n_threads=2, type_k=f32, type_v=f32)
    llm.eval(prompt)
    ours = our_logits(load_pretrained(folder, models.from_hf_config, dtype=torch.float32).eval(), prompt).numpy()
    diff = float(np.abs(np.array(llm.scores[: len(prompt)]) - ours).max())
    print(f"{name} without GELU: {len(prompt)} tokens, max|logit diff| {diff:.3g}, "
          f"{diff / float(np.abs(ours).max()):.3g} of max|logit|")
    assert diff <= F32_TOL * float(np.abs(ours).max())


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "gemma4"])
def test_llama_cpp_runs_the_adapter_folded_in(family, tmp_path, capsys, name):
    """A PEFT adapter exported with the base: llama.cpp's logits are ours with the adapter, to f16
    precision, while the adapter moves them far more than that."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np
    import peft
    import transformers

    import models
    from minitrain.adapters.peft_format import load_adapter
    from minitrain.text.tokenizer import Tokenizer
    from minitrain.weights import load_pretrained

    base = family(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    torch.manual_seed(0)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    pm.save_pretrained(tmp_path / "adapter")
    code, err = export(capsys, "--model", base, "--adapter", tmp_path / "adapter", "--out", tmp_path / "a.gguf")
    assert code == 0, err
    tok = Tokenizer.from_folder(base)
    prompt = tok.encode(PROMPT, bos=tok.add_bos)
    plain = load_pretrained(base, models.from_hf_config, dtype=torch.float32).eval()
    adapted = load_pretrained(base, models.from_hf_config, dtype=torch.float32)
    load_adapter(adapted, tmp_path / "adapter")
    ours, before = our_logits(adapted.eval(), prompt).numpy(), our_logits(plain, prompt).numpy()
    llm = llama_cpp.Llama(model_path=str(tmp_path / "a.gguf"), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(prompt)
    diff = float(np.abs(np.array(llm.scores[: len(prompt)]) - ours).max())
    moved = float(np.abs(ours - before).max())
    print(f"{name} + adapter: max|logit diff| {diff:.3g}; the adapter moves the logits by up to {moved:.3g}")
    tol = F16_TOL * (LOOSER_BY if name in GEMMA4 else 1)
    assert diff <= tol * float(np.abs(ours).max()) and moved > 100 * diff


@pytest.mark.parametrize("name", ["llama3_rope", "phi3_longrope", "gpt_oss"])
def test_llama_cpp_rope_scaling(family, tmp_path, capsys, name):
    """LLaMA 3.1's `llama3` scaling (the rope_freqs tensor), Phi-3's long factors and gpt-oss's YaRN (with its
    window of 5 and sinks over the long prompt), on a prompt past the original context of 16 (an f32 file, an f32
    KV cache). llama.cpp picks Phi-3's long or short factors
    by its context size, transformers by the sequence's length: a sequence shorter than the original
    context in a larger llama.cpp context gets the long factors there and the short ones here."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    import models
    from minitrain.text.tokenizer import Tokenizer
    from minitrain.weights import load_pretrained

    folder = family(name)
    code, err = export(capsys, "--model", folder, "--out", tmp_path / "m.gguf", "--type", "f32")
    assert code == 0, err
    tok = Tokenizer.from_folder(folder)
    prompt = tok.encode("the word of the day is a long sentence that goes past sixteen", bos=tok.add_bos)
    assert len(prompt) > 16
    f32 = getattr(llama_cpp, "GGML_TYPE_F32", 0)
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=64, logits_all=True, verbose=False,
                          n_threads=2, type_k=f32, type_v=f32)
    llm.eval(prompt)
    ours = our_logits(load_pretrained(folder, models.from_hf_config, dtype=torch.float32).eval(), prompt).numpy()
    diff = float(np.abs(np.array(llm.scores[: len(prompt)]) - ours).max())
    print(f"{name}: {len(prompt)} tokens, max|logit diff| {diff:.3g}")
    assert diff <= F32_TOL * float(np.abs(ours).max())
