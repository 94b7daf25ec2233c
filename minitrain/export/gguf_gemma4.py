"""Gemma 4 (`gemma4_text`, a multimodal `gemma4` folder's language model) as llama.cpp's `gemma4` architecture
reads it, after llama.cpp's own converter (convert_hf_to_gguf.py, `Gemma4Model`):

- norms store their weight as it is (Gemma 4 scales by w, not Gemma 3's 1 + w);
- the two head dims: `attention.key_length` / `value_length` the global layers' (`global_head_dim`),
  `*_length_swa` the sliding layers' (`head_dim`); with `attention_k_eq_v` and its own count of global key / value
  heads, `head_count_kv` per layer; the layer types as `sliding_window_pattern` (true: sliding);
- RoPE: base `rope.freq_base` (global) / `rope.freq_base_swa` (sliding), each over its whole head dim; the global
  layers' proportional RoPE is the `rope_freqs` tensor (one factor per rotary pair, read by the global layers only):
  `factor` for the turned pairs, 1e30 for the rest (a frequency divided by 1e30 is 0: those pairs stay as they are);
- per-layer embeddings: `embedding_length_per_layer_input` (0 without them), the tables under llama.cpp's names;
- `attention.shared_kv_layers`; llama.cpp gives a sharing layer the keys and values of the layer just before the
  first sharing one if it is global, of the one before that if it is sliding: a layer pattern where the last
  earlier layer of a type is elsewhere is refused;
- `use_double_wide_mlp`: `feed_forward_length` per layer (the sharing layers' twice as wide);
- `layer_scalar` -> `layer_output_scale`; the MoE sizes: the router's `proj` -> `ffn_gate_inp`, its `scale` ->
  `ffn_gate_inp.scale`, `per_expert_scale` -> `ffn_down_exps.scale`, the fused experts `ffn_gate_up_exps` as they
  are (E, 2F, D) and `ffn_down_exps`.

What llama.cpp's graph does not compute is refused in one line naming the field (`check`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from minitrain.errors import UserError

KINDS = ("gemma4_text", "gemma4")
UNTURNED = 1e30  # llama.cpp's factor for a pair that does not turn (its frequency / 1e30 = 0)


def layer_types(c: Mapping[str, Any]) -> list[str]:
    """config.json's layer types (transformers' default: five sliding to one global), the last one global as
    transformers makes it."""
    n = c["num_hidden_layers"]
    types = list(c.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    return [*types[:-1], "full_attention"]


def global_heads(c: Mapping[str, Any]) -> tuple[int, int]:
    """The global layers' (head dim, key / value heads): transformers 5's `per_layer_config` or the published
    `global_head_dim` / `num_global_key_value_heads` (the latter read with `attention_k_eq_v` only, as transformers)."""
    kv = c.get("num_key_value_heads") or c["num_attention_heads"]
    per_layer = c.get("per_layer_config")
    if isinstance(per_layer, Mapping) and per_layer:
        entry = next(iter(per_layer.values()))
        return entry.get("head_dim", c.get("global_head_dim", 512)), entry.get("num_key_value_heads") or kv
    own = c.get("num_global_key_value_heads") if c.get("attention_k_eq_v") else None
    return c.get("global_head_dim", 512), own or kv


def rope(c: Mapping[str, Any], layer_type: str) -> dict[str, Any]:
    params = c.get("rope_parameters") or {}
    default = ({"rope_type": "default", "rope_theta": 10000.0} if layer_type == "sliding_attention" else
               {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})
    return dict(params.get(layer_type) or default)


def kv_sources(c: Mapping[str, Any]) -> tuple[list[int | None], list[int | None]]:
    """Per layer, the layer whose keys and values it reads (None: its own): (the checkpoint's: the last earlier
    layer of its type before the sharing ones; llama.cpp's: first - 1 for a global layer, first - 2 for a
    sliding one)."""
    types, shared = layer_types(c), c.get("num_kv_shared_layers") or 0
    first = len(types) - shared
    last = {t: i for i, t in enumerate(types[:first])}
    ours = [last.get(t) if i >= first else None for i, t in enumerate(types)]
    theirs = [first - (2 if t == "sliding_attention" else 1) if i >= first else None for i, t in enumerate(types)]
    return ours, theirs


def check(c: Mapping[str, Any]) -> None:
    """A `UserError` naming the field when llama.cpp's gemma4 would compute another model than this config."""
    if c.get("attention_bias"):
        raise UserError("config.json: attention_bias=true — llama.cpp's gemma4 has no attention biases; not exported")
    ours, theirs = kv_sources(c)
    if ours != theirs:
        at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        raise UserError(f"config.json: num_kv_shared_layers={c.get('num_kv_shared_layers')} with these layer_types — "
                        f"layer {at} reuses layer {ours[at]}'s keys, llama.cpp's gemma4 would give it layer "
                        f"{theirs[at]}'s (the last own layer must be global, the one before it sliding); not exported")
    sliding, full = rope(c, "sliding_attention"), rope(c, "full_attention")
    if sliding.get("rope_type", "default") != "default" or (sliding.get("partial_rotary_factor") or 1.0) != 1.0:
        raise UserError(f"config.json: rope_parameters.sliding_attention {sliding} — llama.cpp's gemma4 turns the "
                        f"sliding layers' whole head dim with the default RoPE; not exported")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise UserError(f"config.json: rope_parameters.full_attention rope_type {full.get('rope_type')!r} — "
                        f"llama.cpp's gemma4 takes the default or proportional RoPE there; not exported")
    rows = c.get("vocab_size_per_layer_input", c["vocab_size"])
    if (c.get("hidden_size_per_layer_input") or 0) and rows != c["vocab_size"]:
        raise UserError(f"config.json: vocab_size_per_layer_input={rows} — llama.cpp's gemma4 reads one per-layer "
                        f"embedding row per token of the vocabulary ({c['vocab_size']}); not exported")


def write_metadata(writer: Any, c: Mapping[str, Any]) -> None:
    """Gemma 4's hyper-parameters under llama.cpp's gemma4 keys."""
    types = layer_types(c)
    L, shared = len(types), c.get("num_kv_shared_layers") or 0
    hd_global, kv_global = global_heads(c)
    kv = c.get("num_key_value_heads") or c["num_attention_heads"]
    writer.add_context_length(c.get("max_position_embeddings", 131072))
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(L)
    ff = c["intermediate_size"]
    writer.add_feed_forward_length([ff * 2 if c.get("use_double_wide_mlp") and i >= L - shared else ff
                                    for i in range(L)] if c.get("use_double_wide_mlp") and shared else ff)
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv([kv if t == "sliding_attention" else kv_global for t in types] if kv_global != kv else kv)
    writer.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(c["vocab_size"])
    writer.add_key_length(hd_global)
    writer.add_value_length(hd_global)
    writer.add_key_length_swa(c.get("head_dim", 256))
    writer.add_value_length_swa(c.get("head_dim", 256))
    writer.add_rope_dimension_count(hd_global)  # the global layers' partial turn is in `rope_freqs`
    writer.add_rope_dimension_count_swa(c.get("head_dim", 256))
    writer.add_rope_freq_base(float(rope(c, "full_attention").get("rope_theta", 1e6)))
    writer.add_rope_freq_base_swa(float(rope(c, "sliding_attention").get("rope_theta", 10000.0)))
    writer.add_sliding_window(c.get("sliding_window", 512))
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(c.get("hidden_size_per_layer_input") or 0)
    # always written: without the key llama.cpp caps at its default, 30 (0: no cap, as a config without one)
    writer.add_final_logit_softcapping(float(c.get("final_logit_softcapping") or 0.0))
    if c.get("enable_moe_block"):
        writer.add_expert_count(c["num_experts"])
        writer.add_expert_used_count(c["top_k_experts"])
        writer.add_expert_feed_forward_length(c.get("moe_intermediate_size") or c["expert_intermediate_size"])


def rope_freqs(c: Mapping[str, Any]) -> torch.Tensor:
    """The global layers' `rope_freqs` (global_head_dim / 2 factors): llama.cpp divides each pair's frequency
    by its factor. Proportional RoPE: `factor` for the first partial_rotary_factor * hd / 2 pairs, the rest
    not turned; the default RoPE: ones."""
    hd = global_heads(c)[0]
    p = rope(c, "full_attention")
    if p.get("rope_type") != "proportional":
        return torch.ones(hd // 2)
    turned = int(p.get("partial_rotary_factor", 1.0) * hd // 2)
    return torch.tensor([float(p.get("factor", 1.0))] * turned + [UNTURNED] * (hd // 2 - turned))


def rename(key: str) -> str:
    """The llama.cpp name of a Gemma 4 key the gguf package's table has no row for (the router's `scale`, the
    per-expert scale); any other key as it is (the table names it: `layer_scalar`, the fused experts, ...)."""
    stem = key.split(".router.")[0].split(".experts.")[0]
    bid = stem.rsplit(".", 1)[-1]
    if key.endswith(".router.scale"):
        return f"blk.{bid}.ffn_gate_inp.scale"
    if key.endswith(".router.per_expert_scale"):
        return f"blk.{bid}.ffn_down_exps.scale"
    return key
