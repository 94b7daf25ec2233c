"""LoRA adapters on disk in PEFT's format: `save_adapter` / `load_adapter`.

A folder holds `adapter_config.json` (PEFT's `LoraConfig` fields) and `adapter_model.safetensors`
(keys `base_model.model.<module>.lora_A.weight` / `lora_B.weight`, plus `modules_to_save`), so
PEFT loads what minitrain saves and minitrain loads what PEFT saves. A PEFT field that changes the
maths in a way minitrain cannot reproduce (DoRA, `fan_in_fan_out`, ...) is refused, not
approximated. A saved adapter loads frozen unless `trainable=True` is asked for (rule 4).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minitrain.adapters import lora_experts
from minitrain.adapters.lora import (LoRAConfig, applied, apply_lora, freeze_for_adapters, lora_layers, minimal_targets,
                                     name_matches, output_head, target_names)
from minitrain.errors import UserError
from minitrain.weights import io_error_reason, write_folder

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VOCAB_KEY = "minitrain.vocab_size"  # safetensors metadata: rows of the base input embedding
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix for LoRA adapters

# PEFT LoraConfig fields that change the maths, with the value that means "off". An adapter that
# sets one of them to anything else cannot be reproduced here and is refused, not approximated.
_PEFT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "bias": ("none",),
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None, []),
    "layer_replication": (None, []),
    "exclude_modules": (None, [], ""),
    "trainable_token_indices": (None, [], {}),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None,),
}


def save_adapter(model: nn.Module, folder: str | os.PathLike, cfg: LoRAConfig | None = None, *,
                 base_model_name_or_path: str | None = None, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` in PEFT's format (loadable by
    `peft.PeftModel.from_pretrained`) into a temporary folder beside `folder`, then swap it in by
    renames (`weights.write_folder`); other files already in `folder` (a tokenizer) are kept.

    Keys are `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (and
    `base_model.model.<param>` for modules_to_save). The safetensors metadata adds our own
    `minitrain.vocab_size` (the base's input-embedding rows) so loading onto a differently resized
    vocabulary is caught; the JSON config holds PEFT's fields only. `state`: whole tensors by
    parameter name to save in place of the model's own (an FSDP run's gathered adapter, an EMA).
    """
    st = applied(model)
    if st is None:
        raise UserError("save_adapter: the model has no adapters — apply_lora(model, cfg) first")
    c = st.config
    if cfg is not None and (cfg.r, cfg.alpha, cfg.rslora, cfg.rank_pattern) != (c.r, c.alpha, c.rslora, c.rank_pattern):
        raise UserError(f"save_adapter: cfg (r={cfg.r}, alpha={cfg.alpha}, rslora={cfg.rslora}) differs from the "
                        f"applied adapter (r={c.r}, alpha={c.alpha}, rslora={c.rslora}) — pass the config used "
                        f"by apply_lora, or none")
    state = state or {}
    tensors: dict[str, torch.Tensor] = {}
    for n, m in lora_layers(model):
        for name, p in ((f"{n}.lora_A.weight", m.lora_A.weight), (f"{n}.lora_B.weight", m.lora_B.weight)):
            tensors[f"{PEFT_PREFIX}{name}"] = state.get(name, p).detach().contiguous().cpu()
    for n, p, _ in st.saved:
        tensors[f"{PEFT_PREFIX}{n}"] = state.get(n, p).detach().contiguous().cpu()
    expert_tensors, target_parameters = lora_experts.peft_tensors(model, PEFT_PREFIX, state)
    tensors.update(expert_tensors)
    emb = getattr(model, "input_embeddings", None)
    if base_model_name_or_path is None and getattr(model, "source_dir", None) is not None:
        base_model_name_or_path = str(model.source_dir)
    config = {
        "peft_type": "LORA",
        "task_type": getattr(model, "adapter_task_type", None)  # a reward model's: SEQ_CLS
                     or ("SEQ_2_SEQ_LM" if getattr(model, "is_encoder_decoder", False) else "CAUSAL_LM"),
        "r": c.r,
        "lora_alpha": c.alpha,
        "lora_dropout": c.dropout,
        "use_rslora": c.rslora,
        "target_modules": minimal_targets(model, st.wrapped) if st.wrapped else [],
        **({"target_parameters": target_parameters} if target_parameters else {}),
        "bias": "none",
        "modules_to_save": list(c.modules_to_save) or None,
        **({"rank_pattern": dict(c.rank_pattern)} if c.rank_pattern else {}),
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
    }
    # our own fields go in the safetensors metadata, so PEFT reads a config with nothing unknown
    metadata = {"format": "pt"}
    if isinstance(emb, nn.Embedding):
        metadata[VOCAB_KEY] = str(emb.num_embeddings)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata=metadata)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    folder = Path(folder)
    try:  # weights and config appear together: a crash never pairs new weights with an old config
        write_folder(folder, fill, keep_others=True)
    except (OSError, SafetensorError) as e:  # disk full, read-only, permissions
        raise UserError(f"{folder}: cannot write the adapter: {io_error_reason(e)} — free space or choose a "
                        f"writable folder, then save again") from e
    return folder


def _normalize_key(key: str) -> str:
    """PEFT key variants -> our module key: drop `base_model.model.`, the adapter name
    (`lora_A.default.weight`) and `modules_to_save.<name>.`."""
    key = key.removeprefix(PEFT_PREFIX)
    key = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", key)
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)


def _shape(s) -> str:
    return "(" + ", ".join(str(int(d)) for d in s) + ")"


def _read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cpath, wpath = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not cpath.is_file():
        raise UserError(f"{cpath}: not found — point to a folder written by save_adapter or PEFT's save_pretrained")
    if not wpath.is_file():
        hint = " (adapter_model.bin is pickle and is not read: re-save it with safetensors)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise UserError(f"{wpath}: not found{hint} — save the adapter with safetensors")
    try:
        config = json.loads(cpath.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cpath}:{e.lineno}: invalid JSON ({e.msg}) — fix or re-save the adapter") from None
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(wpath), framework="pt") as f:
        vocab = (f.metadata() or {}).get(VOCAB_KEY)
        if vocab is not None and "vocab_size" not in config:
            config["vocab_size"] = int(vocab)
        for k in f.keys():
            nk = _normalize_key(k)
            if nk in tensors:
                raise UserError(f"{wpath}: {k} appears twice (several adapters in one file?) — save one adapter")
            tensors[nk] = f.get_tensor(k)
    return config, tensors


def adapter_vocab_size(folder: str | os.PathLike) -> int | None:
    """The input-embedding rows of the base an adapter was saved from (our safetensors metadata),
    or None when unknown (e.g. an adapter saved by PEFT, or no readable file)."""
    path = Path(folder) / ADAPTER_WEIGHTS
    try:
        with safe_open(str(path), framework="pt") as f:
            vocab = (f.metadata() or {}).get(VOCAB_KEY)
    except Exception:  # a missing or damaged file is load_adapter's to report, with its own message
        return None
    return int(vocab) if vocab is not None and vocab.isdigit() else None


def _config_from_peft(config: dict[str, Any], where: Path) -> LoRAConfig:
    if config.get("peft_type") != "LORA":
        raise UserError(f"{where}: peft_type is {config.get('peft_type')!r} — only LORA adapters can be loaded")
    for k, ok in _PEFT_NEUTRAL.items():
        if k in config and config[k] not in ok:
            raise UserError(f"{where}: {k}={config[k]!r} changes the LoRA maths and is not supported — "
                            f"re-train the adapter without it")
    for k in ("r", "lora_alpha", "target_modules"):
        if config.get(k) is None:
            raise UserError(f"{where}: missing {k!r} — not a complete LoRA adapter config")
    targets = config["target_modules"]
    params = list(config.get("target_parameters") or [])
    if params and isinstance(targets, str):
        raise UserError(f"{where}: target_modules as a regular expression together with target_parameters is "
                        f"not supported — list the target modules")
    return LoRAConfig(r=int(config["r"]), alpha=float(config["lora_alpha"]),
                      dropout=float(config.get("lora_dropout") or 0.0),
                      targets=targets if isinstance(targets, str) else tuple(targets) + tuple(params),
                      rslora=bool(config.get("use_rslora", False)),
                      modules_to_save=tuple(config.get("modules_to_save") or ()),
                      rank_pattern=_rank_pattern(config.get("rank_pattern"), where))


def _rank_pattern(value: Any, where: Path) -> dict[str, int]:
    """A saved `rank_pattern` of plain module-name suffixes (PEFT also takes regular expressions: refused)."""
    if not value:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise UserError(f"{where}: rank_pattern={value!r} is not a mapping of module names to ranks — fix or re-save "
                        f"the adapter")
    bad = next((k for k in value if not re.fullmatch(r"[\w.]+", k)), None)
    if bad is not None:
        raise UserError(f"{where}: rank_pattern key {bad!r} is a regular expression, which is not supported — "
                        f"use module-name suffixes (e.g. 'k_proj') or re-train the adapter without it")
    return dict(value)


def load_adapter(model: nn.Module, folder: str | os.PathLike, *, trainable: bool = False) -> LoRAConfig:
    """Load a saved adapter (ours or PEFT's) onto `model`; returns its config.

    Applies LoRA per the saved config if the model has none yet (a model that already has the
    same adapter layout is loaded into; a different one is an error). Frozen unless
    `trainable=True`: continuing training is asked for, never a default (rule 4). Every shape is
    checked before the model is changed; a vocabulary of another size says to add the special
    tokens (and resize) first.
    """
    folder = Path(folder)
    config, tensors = _read_adapter(folder)
    wpath = folder / ADAPTER_WEIGHTS
    cfg = _config_from_peft(config, folder / ADAPTER_CONFIG)
    vocab = config.get("vocab_size")
    emb = getattr(model, "input_embeddings", None)
    if vocab is not None and isinstance(emb, nn.Embedding) and emb.num_embeddings != vocab:
        raise UserError(f"{folder}: the adapter was trained on a vocabulary of {vocab} tokens but the "
                        f"model's input embedding has {emb.num_embeddings} — add the same special tokens and call "
                        f"model.resize_token_embeddings({vocab}) before load_adapter")

    expert_paths, expert_tensors = lora_experts.from_peft(model, tensors, config.get("target_parameters") or [],
                                                          str(wpath))
    st = applied(model)
    if st is not None:
        c = st.config
        if ((c.r, c.alpha, c.rslora, c.modules_to_save, c.rank_pattern)
                != (cfg.r, cfg.alpha, cfg.rslora, cfg.modules_to_save, cfg.rank_pattern)):
            raise UserError(f"load_adapter: the model already has a different adapter (r={c.r}, alpha={c.alpha}) "
                            f"than {folder} (r={cfg.r}, alpha={cfg.alpha}) — adapters are applied once (rule 4); "
                            f"load it onto a fresh base model")
        wrapped = list(st.wrapped)
        if sorted(st.experts) != sorted(expert_paths):
            raise UserError(f"load_adapter: the model's expert adapters ({len(st.experts)}) are not the ones in "
                            f"{folder} ({len(expert_paths)}) — load it onto a fresh base model")
    else:
        _, linear_targets, never = lora_experts.split_targets(model, cfg.targets)
        wrapped = [n for n in (target_names(model, linear_targets) if linear_targets else [])
                   if n.rsplit(".", 1)[-1] not in never]
        chosen = lora_experts.split_targets(model, cfg.targets)[0]
        if sorted(chosen) != sorted(expert_paths):
            raise UserError(f"{wpath}: the config selects {len(chosen)} expert parameters but the file adapts "
                            f"{len(expert_paths)} — the file and adapter_config.json do not belong together")
    _check_adapter_tensors(model, cfg, wrapped, tensors, wpath)
    for key, t in expert_tensors.items():
        path = key.replace(".deltas.", ".").removesuffix(".lora_A.weight")
        if key.endswith(".lora_A.weight") and t.shape[1] != cfg.rank_for(path):
            raise UserError(f"{wpath}: the expert adapter of {path} has rank {t.shape[1]}, the config says "
                            f"r={cfg.rank_for(path)} — the file and adapter_config.json do not belong together")
    tensors.update(expert_tensors)

    if st is None:
        apply_lora(model, cfg, every_target=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, t in tensors.items():
            old = params[key]
            if not old.is_meta:
                old.copy_(t)
                continue
            # a base still on meta (FSDP's sharded load reads it later): the adapter becomes real now,
            # in every module that holds this Parameter (a tied one too)
            new = nn.Parameter(t.to(old.dtype), requires_grad=old.requires_grad)
            for m in model.modules():
                for leaf, q in m._parameters.items():
                    if q is old:
                        m._parameters[leaf] = new
    st = applied(model)  # modules_to_save: the file's value is live, the base copy stays
    if trainable:
        freeze_for_adapters(model)
    else:
        for n, p in params.items():
            if ".lora_A." in n or ".lora_B." in n:
                p.requires_grad_(False)
        for _, live, _ in st.saved:
            live.requires_grad_(False)
    return cfg


def _check_adapter_tensors(model: nn.Module, cfg: LoRAConfig, wrapped: list[str],
                           tensors: dict[str, torch.Tensor], wpath: Path) -> None:
    """Before the model changes: every tensor has a place of its shape, every wrapped module
    gets A and B, and full tensors belong to `modules_to_save`."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    saveable = {f"{n}.{pn}": p for n, m in modules.items() if n and any(name_matches(n, w) for w in cfg.modules_to_save)
                for pn, p in m.named_parameters(remove_duplicate=False)}
    in_file = {id(params[k]) for k in tensors if k in params}
    for key, p in saveable.items():  # a tied pair is saved once, under either name
        if id(p) not in in_file:
            raise UserError(f"{wpath}: no tensor for {key}, which modules_to_save names — the file and "
                            f"adapter_config.json do not belong together")
    emb = getattr(model, "input_embeddings", None)
    head = output_head(model)
    vocab_ids = {id(getattr(m, "weight", None)) for m in (emb, head) if m is not None}
    for n in wrapped:
        for ab in ("lora_A", "lora_B"):
            if f"{n}.{ab}.weight" not in tensors:
                raise UserError(f"{wpath}: no {ab} tensor for {n}, which the config's target_modules select — "
                                f"the file and adapter_config.json do not belong together")
    for key, t in tensors.items():
        if not t.dtype.is_floating_point:  # copy_ would silently turn integers into floats
            raise UserError(f"{wpath}: {key} is stored as {str(t.dtype).removeprefix('torch.')} — adapter tensors "
                            f"are floating point; the file is damaged or not a LoRA adapter: save it again")
        lora = re.fullmatch(r"(.+)\.(lora_[AB])\.weight", key)
        if lora:
            name, ab = lora.groups()
            if name not in wrapped:
                where = "is not in the model" if name not in modules else "is not selected by target_modules"
                raise UserError(f"{wpath}: {key}: {name} {where} — load the adapter onto the base model it was "
                                f"trained on")
            m = modules[name]
            r = cfg.rank_for(name)
            want = (r, m.in_features) if ab == "lora_A" else (m.out_features, r)
            if tuple(t.shape) != want:
                raise UserError(f"{wpath}: {key} has shape {_shape(t.shape)} but {name} (in {m.in_features}, "
                                f"out {m.out_features}, r={r}) needs {_shape(want)} — the adapter was trained "
                                f"on a base of another size; load it onto that base model")
        elif ".lora_" in key or key.startswith("lora_"):
            raise UserError(f"{wpath}: {key} is a kind of LoRA tensor minitrain does not load (embedding LoRA, "
                            f"DoRA) — re-train the adapter on linear layers only")
        elif key not in params:
            raise UserError(f"{wpath}: {key} is not a parameter of the model — load the adapter onto the base "
                            f"model it was trained on")
        elif key not in saveable:
            raise UserError(f"{wpath}: {key} is a full tensor of a module outside modules_to_save — add that "
                            f"module to modules_to_save in adapter_config.json, or save the adapter without it")
        elif tuple(t.shape) != tuple(params[key].shape):
            have = params[key]
            if id(have) in vocab_ids and t.shape[1:] == have.shape[1:]:
                todo = (f"the adapter was trained with {t.shape[0]} tokens: add the same special tokens and call "
                        f"model.resize_token_embeddings({t.shape[0]}) before load_adapter")
            else:
                todo = "load the adapter onto the base model it was trained on"
            raise UserError(f"{wpath}: {key} has shape {_shape(t.shape)} but the model's is {_shape(have.shape)} "
                            f"— {todo}")
