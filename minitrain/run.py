"""The steps every training recipe takes, as plain functions a recipe calls in order.

    check_out_dir(cfg)             refuse a folder holding another run, before minutes of loading
    -- a recipe's `setup(cfg) -> Job` does the next four, writing nothing (minitrain audit uses it) --
    load_tokenizer(cfg)            the tokenizer alone (light)
    load_examples(cfg, tok, kind)  JSONL -> token-id examples (train, eval): before the weights, so a
                                   bad row costs seconds, not minutes of loading
                                   (load_image_examples: also the rows' images, for a vision-language
                                   checkpoint; with_images(collate, ...) decodes them per batch, ahead of the step)
    load_model(cfg, build, tok)    weights streamed into `build(config.json)` (+ quantized)
    attach_adapters(model, cfg)    LoRA (or a saved adapter, trainable), freeze the rest, report;
                                   finetune=full: every float parameter trains instead
    prepare_out_dir(cfg, job)      the preflight audit, then create `out`, write the resolved `config.json`
    evaluate_at_start(job, cfg)    the held-out evaluation before step 1 (step 0), into out/eval.jsonl
    ... train(...) ...             minitrain.train: the loop, called by the recipe itself
                                   (eval_log(out): the loop's eval_fn that appends to out/eval.jsonl)
    evaluate_only(cfg, job)        eval_only=true, instead of the three above: one held-out evaluation,
                                   out/eval.jsonl, nothing trained or saved
    finish(model, cfg, lora, summary)  the adapter in PEFT format in `out/adapter` (finetune=full: the model
                                   as an HF folder in `out/model`), and where things are

Every check that can fail on bad input runs before anything is written, so a mistake leaves
no half-made output folder (docs/design.md rule 9). The engine never imports `models/`: the recipe
passes the builder (`models.from_hf_config`) in.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from safetensors import SafetensorError
from torch import nn

from minitrain import checkpoint, ema
from minitrain.parallel import distributed, fsdp
from minitrain.adapters.lora import (LoRAConfig, adapter_signature, apply_lora, count_parameters, freeze_for_adapters,
                                     trainable_report)
from minitrain.adapters.peft_format import load_adapter, save_adapter
from minitrain.audit import preflight
from minitrain.config import check_model_folder, to_dict, to_json
from minitrain.data.collate import collate_causal
from minitrain.data.images import ImageRows, collate_images
from minitrain.data.packing import collate_packed_causal
from minitrain.data.files import data_sources
from minitrain.data.readers import (Examples, held_out, hold_out, kept_per_source, mixture, read_preference, read_prompts,
                                    read_seq2seq, read_sft, read_unpaired)
from minitrain.data.store import carries
from minitrain.data.store_build import default_cache, open_or_build
from minitrain.data.videos import VideoRows
from minitrain.device import base_dtype, pick_device, resolve_attention
from minitrain.kernels import resolve_kernels
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.progress import log, strict_json
from minitrain.schedule import resolve_steps
from minitrain.text.chat_template import CARRIED, TEMPLATE_FILE, resolve_template
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import (SIDE_FILES, carried_tensors, io_error_reason, load_pretrained, open_pretrained,
                               read_config, save_pretrained)


CONFIG_FILE = "config.json"
EVAL_LOG = "eval.jsonl"  # one row per held-out evaluation: {"step", "eval/...": value}
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"  # finetune=full: the trained model, an HF folder (config.json, model.safetensors, tokenizer)
EMA_SUFFIX = "_ema"  # ema_decay: the moving average beside them, adapter_ema/ or model_ema/, in the same format
# what a run writes into `out` (besides config.json); a folder holding one of these has trained
RUN_OUTPUTS = ("metrics.jsonl", "checkpoint", ADAPTER_DIR, MODEL_DIR, *(d + EMA_SUFFIX for d in (ADAPTER_DIR, MODEL_DIR)))
# keys that say where / how to start, not what the run is
NOT_THE_RUN = ("out", "resume", "overwrite", "extend", "trained_format", "data_cache", "data_workers",
               "dist_timeout", "stop_after")
# config.json's one entry that is not a key: how the run rendered its rows (`trained_format`), which
# minitrain generate follows so that a model is queried in the format it was trained in
READERS = {"sft": read_sft, "seq2seq": read_seq2seq, "preference": read_preference, "unpaired": read_unpaired,
           "prompts": read_prompts}


@dataclass
class Job:
    """What a recipe's `setup(cfg)` assembles and its `run(cfg)` trains: everything `train()` needs.

    `minitrain audit` and `minitrain plan` call `setup` to inspect a recipe without training it.
    """

    model: nn.Module
    objective: Callable[[nn.Module, dict], tuple[torch.Tensor, Any, dict]]
    train_examples: list[dict]
    collate: Callable[[list[dict]], dict[str, torch.Tensor]]
    eval_examples: list[dict] | None
    lora: LoRAConfig | None  # None: finetune=full
    tok: Tokenizer
    images: ImageRows | None = None  # how a vision-language checkpoint reads the rows' images (`image_rows`)


# ----------------------------------------------------------------------------- the output folder


def check_out_dir(cfg: Any) -> Path:
    """Refuse an `out` that holds something other than a run we may write (writes nothing).

    First, a run without `model` or `data` is refused (before minutes of loading).

    A folder with run outputs (metrics, checkpoint, adapter) needs `resume=true` (continue it)
    or `overwrite=true` (replace it); the message says how its config.json differs from this
    run's. A non-empty folder without a config.json is not ours to write into without
    `overwrite=true`. A folder holding only a config.json never got to step 1 and is reused.
    """
    out = Path(cfg.out)
    if not str(cfg.out):
        raise UserError("out: empty — pass out=runs/<name>")
    if not getattr(cfg, "model", "x"):  # a real run asks for what it lacks before anything loads
        raise UserError("model: not set — pass model=path/to/hf_model_folder (config.json, *.safetensors, tokenizer)")
    if not getattr(cfg, "data", "x"):
        raise UserError("data: not set — pass data=path/to/train.jsonl")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: is a file, not a folder — choose another out")
    under = next((p for p in out.parents if p.exists()), None)  # the nearest ancestor that exists
    if under is not None and not under.is_dir():
        raise UserError(f"{out}: {under} is a file, so no folder can be made under it — choose another out")
    if cfg.resume:
        if not out.is_dir() or checkpoint.find(out) is None:
            if out.is_dir() and any(out.iterdir()):
                raise UserError(f"{out}: holds no checkpoint to resume from (the run there stopped before its "
                                f"first save) — pass overwrite=true instead of resume=true to start it again")
            raise UserError(f"{out}: holds no checkpoint to resume from — run without resume=true first")
        check_resume(cfg)
        note = checkpoint.fallback_note(out)
        if note:
            log(note)
        return out
    if getattr(cfg, "eval_only", False) and out.is_dir():
        trained = [name for name in RUN_OUTPUTS if (out / name).exists()]
        if trained:
            raise UserError(f"{out}: holds a training run ({', '.join(trained)}); eval_only=true writes only "
                            f"{CONFIG_FILE} and {EVAL_LOG} — choose another out (init_adapter={out / ADAPTER_DIR} "
                            f"evaluates its adapter)")
    if not out.is_dir() or not any(out.iterdir()) or cfg.overwrite:
        return out
    outputs = [name for name in RUN_OUTPUTS if (out / name).exists()]
    config_path = out / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"{out}: is not empty and holds no minitrain run ({CONFIG_FILE} missing) "
                        f"— choose another out, or pass overwrite=true to write into it")
    if not outputs:
        return out
    differs = config_differences(cfg, config_path)
    if differs:
        raise UserError(f"{out}: holds a different run (config differs in {', '.join(differs)}) "
                        f"— pass overwrite=true or choose another out")
    if checkpoint.find(out) is None:
        raise UserError(f"{out}: holds a run of this same config ({', '.join(outputs)}) that stopped before its "
                        f"first checkpoint — pass overwrite=true to start it again, or choose another out")
    raise UserError(f"{out}: holds a run of this same config ({', '.join(outputs)}) — pass resume=true to "
                    f"continue it, overwrite=true to replace it, or choose another out")


def check_resume(cfg: Any, run: dict[str, Any] | None = None) -> None:
    """Refuse `resume=true` when the checkpoint in `cfg.out` was made by another run (writes nothing).

    The checkpoint must read (state.json, the safetensors headers, every per-rank part), hold these
    settings, and have been made from this base model and tokenizer (`checkpoint.made_from`). The
    loop checks the same when it loads it, but by then `prepare_out_dir` has rewritten
    `config.json`; checking here keeps a refused resume from changing the folder. `run` adds values
    only known after reading the data (num_examples, total_steps, warmup_steps).
    """
    folder = checkpoint.find(cfg.out)
    if not cfg.resume or folder is None:
        return
    state = checkpoint.check_readable(folder)  # (any world size: each rank reads the rows it owns)
    items = list(state.get("run", {}).items())
    mine = {**{k: getattr(cfg, k) for k, _ in items if hasattr(cfg, k)}, **(run or {})}
    checkpoint.check_run(dict(items), mine, extend=getattr(cfg, "extend", False))
    model = Path(cfg.model) if getattr(cfg, "model", None) else None
    if model is not None and model.is_dir():
        try:
            here = {"model_path": str(model), "model": checkpoint.model_fingerprint(model),
                    "tokenizer": checkpoint.tokenizer_fingerprint(model)}
        except OSError:
            return  # an unreadable model folder is reported by load_model, with its own message
        checkpoint.check_made_from(state.get("made_from"), here, folder)


def config_differences(cfg: Any, config_path: Path) -> list[str]:
    """Keys whose value in `config_path` differs from `cfg` (a file that does not read: ["config.json"])."""
    try:
        old = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return [CONFIG_FILE]
    if not isinstance(old, dict):
        return [CONFIG_FILE]
    new = to_dict(cfg)
    keys = [k for k in new if k not in NOT_THE_RUN] + [k for k in old if k not in new]
    return [k for k in keys if k not in NOT_THE_RUN and old.get(k) != new.get(k)]


def prepare_out_dir(cfg: Any, job: Job | None = None) -> Path:
    """Create `out` and write the resolved config to `out/config.json` (atomically); returns `out`.

    Call it after loading the model and data, right before training. With the recipe's `job`, the
    gradient-path audit that `train()` would run before step 1 runs first (the loop then does not
    repeat it), so every refusal before step 1 comes before anything is written: the folder of a
    refused start stays byte for byte as it was. A fresh start (no `resume`) removes a previous
    run's adapter so no stale result sits beside the new config; the loop itself clears the old
    metrics and checkpoint under `overwrite=true`.
    """
    if job is not None and not getattr(cfg, "skip_audit", False):
        from minitrain.train import audit_inputs, mark_audited  # train imports nothing of run

        batch, optimizer, amp_dtype = audit_inputs(job.model, job.train_examples, job.collate, cfg, log=log)
        preflight(job.model, job.objective, batch, optimizer=optimizer, amp_dtype=amp_dtype, log=log)
        mark_audited(job.model, job.objective)
    out = Path(cfg.out)
    extra = trained_format(getattr(job.train_examples, "shapes", None), job.tok) if job is not None else None
    distributed.main_only(lambda: _write_config(cfg, extra))  # under torchrun: rank 0 writes
    log(f"out: {out} ({'resuming' if cfg.resume else 'new run'}; config in {out / CONFIG_FILE})")
    return out


def trained_format(shapes: dict[str, int] | None, tok: Tokenizer) -> dict[str, Any] | None:
    """config.json's `trained_format`: the SFT rows per shape and how a plain prompt string was
    rendered in training: "chat" (through the chat template: `prompt_completion=chat`, or only chats
    were trained) or "raw". None for other readers."""
    if shapes is None:
        return None
    chat = shapes.get("pair_chat", 0) or shapes.get("chat", 0) and not (shapes.get("pair", 0) or shapes.get("text", 0))
    return {"rows": dict(shapes), "prompts": "chat" if chat else "raw",
            "rendered_by": tok.chat_renderer() if chat else "plain text"}


def _write_config(cfg: Any, trained: dict[str, Any] | None = None) -> None:
    out = check_out_dir(cfg)
    _write_text(out, CONFIG_FILE, to_json(cfg) if trained is None else to_json(cfg, trained_format=trained))
    for name in RUN_OUTPUTS[2:]:  # the saved adapter / model folders
        if not cfg.resume and (out / name).is_dir():
            shutil.rmtree(out / name)


def _write_text(out: Path, name: str, text: str) -> None:
    """`out/name` written whole (a temporary file renamed into place); a failure is one UserError and
    leaves nothing behind (not even `out`, when this call created it)."""
    tmp = out / f".{name}.tmp"
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / name)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise UserError(f"{out}: cannot write {name}: {io_error_reason(e)} — free space or choose a "
                        f"writable out folder") from None


# ----------------------------------------------------------------------------- model


def load_tokenizer(cfg: Any) -> Tokenizer:
    """The tokenizer of folder `cfg.model` (light: read before the weights, so a bad data row costs seconds)."""
    check_model_folder(cfg.model)
    folder = Path(cfg.model)
    tok = Tokenizer.from_folder(folder, chat_format=None if cfg.chat_format == "auto" else cfg.chat_format)
    if getattr(cfg, "chat_template", ""):  # the user's template replaces the checkpoint's (and a detected format)
        tok.chat_template = resolve_template(cfg.chat_template, str(folder), tok.special_id)
        tok.template_origin = f"the chat template chat_template={cfg.chat_template}"
        if cfg.chat_format == "auto":
            tok.chat_format = None
    return tok


def load_model(cfg: Any, build: Callable[[dict[str, Any]], nn.Module],
               tok: Tokenizer | None = None) -> tuple[nn.Module, Tokenizer]:
    """The tokenizer and the model of folder `cfg.model`, on `cfg.device` in the dtype for `cfg.precision`.

    `tok`: the tokenizer `load_tokenizer(cfg)` already read (recipes read the data with it before
    the weights); else it is read here. With `cfg.quantize` nf4 / int8 / ternary, each base linear is
    quantized as its weight arrives (no full-precision copy of the model in memory). A tokenizer
    with more ids than the model's embedding has rows is refused here, not as an index error mid-step.
    """
    tok = load_tokenizer(cfg) if tok is None else tok
    folder = Path(cfg.model)
    if distributed.world_size() > 1 and (folder / "config.json").is_file():  # (else the loader says what is missing)
        distributed.check_agree("model", checkpoint.model_fingerprint(folder),
                                f"model={cfg.model} must be the same checkpoint on every machine (copy the same "
                                f"files to each, or use a shared filesystem)")
    device = pick_device(cfg.device)
    # full fine-tuning reads the weights in fp32: they are the master weights (rule 8), and a bf16
    # round trip on the way in would round a fp32 checkpoint before step 1
    dtype = torch.float32 if full_finetune(cfg) else base_dtype(cfg.precision, device)
    hook = None
    if cfg.quantize == "ternary":  # plain torch: no extra package, CPU and CUDA alike
        from minitrain.adapters.quant import quantize_hook

        hook = quantize_hook("ternary", compute_dtype=dtype, ternary_scale=cfg.ternary_scale,
                             act_bits=cfg.ternary_act_bits)
    elif cfg.quantize != "none":
        from minitrain.adapters.quant import quantize_hook, require_bitsandbytes  # bitsandbytes: only when asked for

        try:
            require_bitsandbytes()
        except UserError as e:
            raise UserError(f"quantize={cfg.quantize}: {e.message.removeprefix('quantized loading: ')} "
                            f"(or use quantize=none)") from None
        if device.type != "cuda":
            log(f"note: quantize={cfg.quantize} on {device}: bitsandbytes' CPU kernels work but are slow — "
                f"meant for trying a recipe, not for long runs")
        hook = quantize_hook(cfg.quantize, compute_dtype=dtype)  # float layers and 4-bit matmuls alike
    sharded = fsdp.wanted(cfg)
    if sharded:  # built on meta; each rank reads only its rows of each tensor when FSDP2 shards it
        model, headers = open_pretrained(folder, build)
        fsdp.defer_weights(model, folder, headers, dtype, device)
        if cfg.quantize in ("nf4", "int8"):  # as rows FSDP2 can cut; each rank quantizes and keeps its rows
            from minitrain.adapters.quant_experts import replace_experts
            from minitrain.adapters.quant_rows import replace_linears

            # an MoE's experts: each rank quantizes its own, each expert alone
            replace_experts(model, cfg.quantize, dtype, require_bitsandbytes())
            replace_linears(model, cfg.quantize, dtype)
    else:
        model = load_pretrained(folder, build, dtype=dtype, device=device, tensor_hook=hook)
    # `attention=` refused here, before anything is written; `train` sets it on the model it compiles
    # (not on a model that only runs eagerly, as distillation's teacher: eager FlexAttention is slow)
    resolve_attention(getattr(cfg, "attention", "auto"), model, device, compiled=False)
    resolve_kernels(getattr(cfg, "kernels", "auto"), model, device)  # likewise `kernels=`
    emb = getattr(model, "input_embeddings", None)
    if isinstance(emb, nn.Embedding) and tok.vocab_size > emb.num_embeddings:
        raise UserError(f"{folder}: the tokenizer has {tok.vocab_size} ids but the model's embedding has "
                        f"{emb.num_embeddings} rows — use the tokenizer saved with these weights")
    if getattr(cfg, "router_z_loss_coef", 0.0):
        if not hasattr(model, "router_z_loss_coef"):
            raise UserError(f"router_z_loss_coef={cfg.router_z_loss_coef}: {folder} is not a mixture-of-experts model "
                            f"(no router to regularise) — drop router_z_loss_coef")
        model.router_z_loss_coef = cfg.router_z_loss_coef
    n = count_parameters(model)  # logical: an nf4 layer's packed bytes hold two weights each
    kind = model.hf_config.get("model_type", "?")
    base = cfg.quantize if cfg.quantize != "none" else str(dtype).removeprefix("torch.")
    if cfg.quantize == "ternary":
        base += (f" (2 bits a weight, per-{cfg.ternary_scale} absmean scale"
                 + (f", {cfg.ternary_act_bits}-bit activations" if cfg.ternary_act_bits else "") + ")")
    log(f"model: {folder} ({kind}, {n:,} parameters) on {device}, base in {base}"
        + (f"; sharded over {distributed.world_size()} rank{'s' if distributed.world_size() > 1 else ''} as it is "
           f"read (parallel=fsdp)" if sharded else ""))
    return model, tok


def full_finetune(cfg: Any) -> bool:
    """Whether `cfg` trains every floating-point parameter (`finetune=full`) rather than adapters."""
    return getattr(cfg, "finetune", "lora") == "full"


def lora_config(cfg: Any) -> LoRAConfig:
    """The `LoRAConfig` that the `lora_*` keys of `cfg` describe."""
    return LoRAConfig(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=list(cfg.lora_targets),
                      rslora=cfg.rslora, modules_to_save=list(cfg.modules_to_save))


def attach_adapters(model: nn.Module, cfg: Any, lora: LoRAConfig | None = None, train_towers: bool = True
                    ) -> LoRAConfig | None:
    """Give `model` its adapters, freeze everything else, print what trains; returns the LoRAConfig.

    `lora`: the adapters to apply when the recipe derives them itself (LRC's per-layer ranks);
    default `lora_config(cfg)`.
    `init_adapter` loads a saved adapter trainable on purpose (rule 4); its own r / alpha /
    targets apply and the `lora_*` keys are ignored (said so). Fully trained modules
    (`modules_to_save`) are kept in fp32 whatever the base dtype (rule 8).

    `finetune=full`: no adapters; every floating-point parameter trains, in fp32, and None is
    returned (`finish` then saves the model itself). Integer tensors stay frozen (rule 3). `train_towers`
    False (the rows hold no image): a vision-language model's `towers` stay frozen too, since no loss reaches
    them, and are saved as they were read.
    """
    if full_finetune(cfg):
        if cfg.modules_to_save:
            log(f"note: modules_to_save={','.join(cfg.modules_to_save)} is not used: finetune=full trains every module")
        towers = () if train_towers else tuple(getattr(model, "towers", ()))
        unfreeze_all(model, towers)
        if towers:
            log(f"note: finetune=full: no row has an image, so {', '.join(towers)} stays frozen (no loss reaches it)")
        _check_resume_tensors(model, cfg)
        log(full_report(model))
        return None
    if cfg.init_adapter:
        lcfg = load_adapter(model, cfg.init_adapter, trainable=True)
        if fsdp.pending(model) is not None:
            fsdp.draw_adapters(model, [], cfg.seed)  # (nothing to draw: moves the loaded values to the device)
        log(f"adapter: continuing {cfg.init_adapter} (r={lcfg.r}, alpha={lcfg.alpha}, targets={lcfg.targets}); "
            f"the lora_* keys of this run are not used")
    else:
        lcfg = lora if lora is not None else lora_config(cfg)
        torch.manual_seed(cfg.seed)  # the adapter's init (LoRA A) follows `seed`: same seed, same start
        names = apply_lora(model, lcfg)
        if fsdp.pending(model) is not None:  # a base on meta: the adapter is drawn for real, as one process would
            fsdp.draw_adapters(model, names, cfg.seed)
        freeze_for_adapters(model, lcfg)
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # fp32 master weights for what trains in full (e.g. lm_head)
    _check_resume_tensors(model, cfg)
    log(trainable_report(model))
    return lcfg


def unfreeze_all(model: nn.Module, frozen: Sequence[str] = ()) -> int:
    """Full fine-tuning: every floating-point parameter trains, as fp32 master weights; returns how many
    tensors train. Integer tensors (none in a float model) stay frozen: they cannot train (rule 3); so do
    the modules named in `frozen` (and what is inside them)."""
    n = 0
    for name, p in model.named_parameters():
        trains = p.dtype.is_floating_point and not any(name.startswith(m + ".") for m in frozen)
        if trains and p.dtype != torch.float32:
            p.data = p.data.float()
        p.requires_grad_(trains)
        n += trains
    return n


def full_report(model: nn.Module) -> str:
    """What full fine-tuning trains and what it costs beside the weights (gradients + two AdamW moments).

    No warning: training every tensor is what `finetune=full` asks for (the `modules_to_save`
    warning of `trainable_report` is for LoRA runs that train whole modules by surprise)."""
    total = count_parameters(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = sum(p.numel() * (p.element_size() + 8) for p in model.parameters() if p.requires_grad)
    return (f"trainable: {trainable:,} of {total:,} parameters ({100.0 * trainable / max(total, 1):.2f}%): full "
            f"fine-tuning in fp32 master weights; gradients + AdamW moments ~{state / 2**20:,.1f} MiB beside them")


def _check_resume_tensors(model: nn.Module, cfg: Any) -> None:
    """With `resume=true`: every tensor that trains must be in the checkpoint with its shape (another
    lora_r, lora_targets or base is refused here, before `prepare_out_dir` writes, not by the loop).

    Only what trains now is checked: a recipe may add trainable tensors after this (ARD gates).
    """
    folder = checkpoint.find(cfg.out) if cfg.resume else None
    if folder is None:
        return
    saved = checkpoint.saved_shapes(folder)  # whole files or per-rank parts
    if saved is None:
        return  # an unreadable checkpoint is reported by checkpoint.load
    mine = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(mine) - set(saved))
    if missing:
        raise UserError(f"{folder}: checkpoint holds different trainable tensors (missing {missing[:3]}) — resume "
                        f"with the same model, adapters and settings")
    for n, shape in mine.items():
        if saved[n] != shape:
            raise UserError(f"{folder}: {n} has shape {saved[n]}, the model {shape} — resume with the same model "
                            f"and adapter settings")
    try:  # same tensors, same shapes: the adapter's alpha, rsLoRA or targets may still differ
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(state, dict):
        checkpoint.check_made_from(state.get("made_from"), {"adapter": adapter_signature(model)}, folder)


# ----------------------------------------------------------------------------- data


def load_examples(cfg: Any, tok: Tokenizer, kind: str = "sft", **options: Any) -> tuple[list[dict], list[dict] | None]:
    """(train, eval) examples from `cfg.data` / `cfg.eval_data`, or `cfg.eval_split` of `cfg.data`
    held out (None without either).

    kind: "sft" (prompt / completion, chats, text -> input_ids and labels), "seq2seq",
    "preference", "unpaired" (KTO) or "prompts" (GRPO); rows are read by `minitrain.data.readers` with `cfg.fields`, the tokenizer's
    chat template gets `cfg.chat_template_kwargs`; `options` go to the reader (e.g. max_target_len).
    """
    if not cfg.data:
        raise UserError("data: not set — pass data=path/to/train.jsonl")
    if kind not in READERS:
        raise ValueError(f"load_examples: kind {kind!r} is not one of {', '.join(READERS)}")
    tok.chat_template_kwargs = dict(getattr(cfg, "chat_template_kwargs", {}) or {})
    options = dict(max_len=cfg.max_len, truncation_side=cfg.truncation_side, fields=getattr(cfg, "fields", None),
                   **options)
    if kind == "preference":
        options["drop_identical"] = getattr(cfg, "drop_identical_pairs", False)
    if kind == "sft":
        options["prompt_completion"] = getattr(cfg, "prompt_completion", "raw")
    weights = list(getattr(cfg, "data_weights", None) or []) or None
    train, counts = read_data(cfg, cfg.data, kind, tok, options, weights)
    shapes = getattr(train, "shapes", None)  # rows per shape, before any eval_split
    if not train and getattr(train, "identical", 0):
        raise UserError(f"{cfg.data}: no usable examples ({train.identical} pairs dropped: chosen == rejected"
                        + (f", {train.skipped} left no target token" if train.skipped else "") + ") — fix the rows")
    if not train:
        raise UserError(f"{cfg.data}: no usable examples ({train.skipped} rows left no target token within "
                        f"max_len={cfg.max_len}) — check the rows or raise max_len")
    if cfg.eval_data and (Path(cfg.eval_data) / "dataset_dict.json").is_file():
        raise UserError(f"eval_data={cfg.eval_data}: a datasets folder with splits — name the split, e.g. "
                        f"eval_data={Path(cfg.eval_data) / 'validation'}")
    evals = read_data(cfg, cfg.eval_data, kind, tok, options)[0] if cfg.eval_data else None
    if evals is None and getattr(cfg, "eval_split", 0):
        counts = kept_per_source(counts, held_out(len(train), cfg.eval_split, cfg.seed))
        train, evals = hold_out(train, cfg.eval_split, cfg.seed)
    if weights:  # after eval_split: an example taken twice is never on both sides
        train = mixture(train, counts, weights, cfg.seed)
    if distributed.world_size() > 1:
        distributed.check_agree("data", examples_digest(train) + (examples_digest(evals) if evals else ""),
                                "every machine must read the same data files with the same settings (copy the "
                                "same files to each, or use a shared filesystem)")
    # the run's size in optimizer steps (warmup longer than the run, ...) is refused now, before
    # prepare_out_dir writes anything, rather than by the loop
    total, warmup, _ = resolve_steps(len(train), cfg.batch_size, cfg.grad_accum, cfg.epochs, cfg.max_steps,
                                     cfg.warmup)
    check_resume(cfg, {"num_examples": len(train), "total_steps": total, "warmup_steps": warmup})
    for name, ex in (("train", train), ("eval", evals)):
        if ex is not None:
            log(f"data ({name}): {len(ex)} examples from {ex.path}"
                + (f", {ex.truncated} truncated to max_len={cfg.max_len}" if ex.truncated else "")
                + (f", {ex.skipped} skipped (no target token left)" if ex.skipped else "")
                + (f", {ex.bos_in_text} began with bos already (not doubled)" if ex.bos_in_text else "")
                + (f", {ex.identical} dropped (chosen == rejected)" if getattr(ex, "identical", 0) else ""))
    if kind != "seq2seq":
        log_rendering(shapes, tok)
    return train, evals


def examples_digest(examples: Sequence[dict]) -> str:
    """A short hash of tokenized examples: their count, every length, the first and the last example
    (what tells two ranks' data apart without hashing every token)."""
    h = hashlib.sha256(str(len(examples)).encode())
    lengths = getattr(examples, "lengths", None)  # Examples and the token store know them; else count
    if lengths is None:
        lengths = [sum(len(v) for k, v in ex.items() if k.endswith("ids")) for ex in examples]
    h.update(np.asarray(lengths, dtype=np.int64).tobytes())
    for ex in (examples[0], examples[-1]) if len(examples) else ():  # a store's arrays as lists
        h.update(json.dumps(ex, sort_keys=True, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)).encode())
    return h.hexdigest()[:12]


def log_rendering(shapes: dict[str, int] | None, tok: Tokenizer) -> None:
    """Say how the training file's rows became tokens (`shapes`: rows per shape, from `read_sft`):
    chats through the chat template (or format), and whether prompt / completion strings went through
    it too (`prompt_completion=chat`) or not (plain text)."""
    if shapes is None:  # pairs / unpaired rows: their message lists are rendered, their strings are not
        log(f"chats: message lists rendered by {tok.chat_renderer()}; prompt strings as plain text")
        return
    if shapes.get("chat"):
        log(f"chats: {shapes['chat']} rows rendered by {tok.chat_renderer()}")
    if shapes.get("pair_chat"):
        log(f"prompt / completion: {shapes['pair_chat']} rows rendered as one user and one assistant turn "
            f"by {tok.chat_renderer()} (prompt_completion=chat)")
    if shapes.get("pair"):
        advice = (" — prompt_completion=chat renders them through it as one user / assistant turn"
                  if tok.chat_format or tok.chat_template else "")
        log(f"prompt / completion: {shapes['pair']} rows trained as plain text, not through the chat "
            f"template{advice}")
    if shapes.get("text"):
        log(f"text: {shapes['text']} rows trained as plain text")


def read_data(cfg: Any, data: str, kind: str, tok: Tokenizer, options: dict[str, Any],
              weights: list[float] | None = None) -> tuple[Sequence[dict], list[int]]:
    """(examples, examples per source) of `data` (one path, or several / globs separated by commas):
    from the token store in `cfg.data_cache` (built when missing, `cfg.data_workers` processes;
    `minitrain.data.store_build`), or with `data_cache=false` read into memory. `weights` (checked
    against the sources here, applied by the caller) are part of the store's fingerprint."""
    read = READERS[kind]
    sources = data_sources(data)
    if weights and len(weights) != len(sources):
        raise UserError(f"data_weights: {len(weights)} weights for {len(sources)} data sources ({', '.join(sources)}) "
                        f"— give one weight per source")
    cache = str(getattr(cfg, "data_cache", "false"))
    if cache == "auto":
        try:
            default_cache().mkdir(parents=True, exist_ok=True)
        except OSError as e:  # no writable cache folder (a read-only home): today's path, said once
            log(f"note: data_cache=auto: cannot create {default_cache()} ({e.strerror or e}) — examples are kept in "
                f"memory; pass data_cache=<a writable folder> to keep a token store")
            cache = "false"
    # GRPO's prompts carry their rows' other columns for the reward functions: kept in memory, never in a store
    # (image rows of the other readers go into it: their paths and data row kept, the images decoded per batch)
    if cache.lower() in ("false", "off", "no", "none", "0", "") or kind == "prompts":
        parts = [read(s, tok, **options) for s in sources]
        examples = parts[0] if len(parts) == 1 else Examples(
            [ex for p in parts for ex in p], path=data,
            **{c: sum(getattr(p, c) for p in parts) for c in ("truncated", "skipped", "bos_in_text", "identical")},
            shapes=None if parts[0].shapes is None else {k: sum(p.shapes[k] for p in parts) for k in parts[0].shapes})
        counts = [len(p) for p in parts]
    else:
        examples = open_or_build(default_cache() if cache == "auto" else cache, sources, kind, read, tok, options,
                                 workers=getattr(cfg, "data_workers", 0), weights=weights,
                                 keep_days=getattr(cfg, "data_cache_days", 0),
                                 verify=bool(getattr(cfg, "resume", False)))
        counts = examples.header["per_source"]
    return examples, counts


def sft_job(cfg: Any, build: Callable[[dict[str, Any]], nn.Module]) -> Job:
    """The causal-LM SFT job that `recipes/sft_llama.py` and `recipes/sft_mistral.py` share:
    model (+ adapters) from `cfg.model`, `{"prompt","completion"}` / `{"messages"}` / `{"text"}`
    examples, the `sft` objective and the padding collator (`cfg.packing`: the packing one,
    `minitrain.data.packing`). Writes nothing."""
    tok = load_tokenizer(cfg)
    # a bad row costs seconds, not a model load
    train_examples, eval_examples, images = load_image_examples(cfg, tok, "sft")
    model, tok = load_model(cfg, build, tok)
    if model.is_encoder_decoder:
        raise UserError(f"{cfg.model}: is an encoder-decoder (T5) model — this recipe trains causal LMs; "
                        f"use recipes/lora_t5.py for it")
    with_images_in_rows = rows_have_images(images, train_examples)
    if getattr(cfg, "packing", False) and not getattr(model, "packs_images", False) and (
            with_images_in_rows or rows_have_images(images, eval_examples or [])):
        raise UserError(f"packing=true: {cfg.data} has rows with images, which {model.config.model_type} does not pack "
                        f"yet (Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE do) — set packing=false")
    lora = attach_adapters(model, cfg, train_towers=with_images_in_rows)
    collate = (functools.partial(collate_packed_causal, pad_id=tok.pad_id, max_len=cfg.max_len)
               if getattr(cfg, "packing", False) else functools.partial(collate_causal, pad_id=tok.pad_id))
    return Job(model, sft, train_examples, with_images(collate, images), eval_examples, lora, tok, images)


def load_image_examples(cfg: Any, tok: Tokenizer, kind: str, **options: Any
                        ) -> tuple[list[dict], list[dict] | None, ImageRows | None]:
    """`load_examples` with the rows' images read as the checkpoint `cfg.model` reads them (`image_rows`;
    a text-only checkpoint refuses rows with images): (train, eval, how images are read or None). Rows with
    images are refused under `shared_prompt=true`, and under `packing=true` but for SFT on the families whose
    forward packs them (`packs_images`: Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE), whose rows do not carry them yet."""
    images = image_rows(cfg, tok)
    train, evals = load_examples(cfg, tok, kind, **options, **({"images": images} if images else {}))
    if images is not None and any(carries(examples).any() for examples in (train, evals or [])):
        for key, what in (("packing", "packed"), ("shared_prompt", "run as one shared-prompt row")):
            if getattr(cfg, key, False) and not (key == "packing" and kind == "sft"):  # (SFT: `sft_job` asks the model)
                raise UserError(f"{key}=true: {cfg.data} has rows with images, which are not {what} yet — set "
                                f"{key}=false")
    return train, evals, images


def rows_have_images(images: ImageRows | None, examples) -> bool:
    """Whether a vision-language checkpoint's (`images`: how it reads them) training rows carry an image or a video:
    under `finetune=full` its towers train only then (`attach_adapters`' `train_towers`). A token store answers from its
    offsets, without building the examples."""
    return images is not None and bool(carries(examples).any() or carries(examples, "videos").any())


def with_images(collate: Callable[[list[dict]], dict], images: ImageRows | None, copies: int = 1, group: int = 1
                ) -> Callable[[list[dict]], dict]:
    """`collate`, plus each batch's images decoded when it is collated, never all at once (`collate_images`:
    `copies` 2 for preference rows [chosen; rejected], `group` G for GRPO's rows); `collate` itself for a
    text-only checkpoint. Marked `decodes_images`: on rows with images the training loop collates the next
    micro-batch with it in a background thread while one trains (`minitrain.data.prefetch`)."""
    if images is None:
        return collate
    out = functools.partial(collate_images, collate=collate, spec=images.spec, copies=copies, group=group,
                            videos=images.videos)
    out.decodes_images = True
    return out


def image_rows(cfg: Any, tok: Tokenizer) -> ImageRows | None:
    """How the checkpoint `cfg.model` reads images in rows (its config.json's `image_token_id`, or a multimodal
    Gemma 3's token ids; its image processor's config, `processor_configs`), or None for a text-only checkpoint;
    and videos (`ImageRows.videos`: Qwen2.5-VL's and Qwen3-VL's, with their video processor's config)."""
    config = read_config(cfg.model)
    image, video = processor_configs(Path(cfg.model))
    decode = lambda i: tok.decode([i], skip_special=False)  # noqa: E731
    images = ImageRows.from_checkpoint(config, image, decode)
    if images is None:
        return None
    return dataclasses.replace(images, videos=VideoRows.from_checkpoint(config, video, decode))


def processor_configs(folder: Path) -> tuple[dict | None, dict | None]:
    """A checkpoint's image and video processor configs, read where transformers 5 reads them: nested in
    processor_config.json (its `image_processor` / `video_processor`, what transformers 5's `save_pretrained`
    writes), else preprocessor_config.json, and for videos video_preprocessor_config.json, then
    preprocessor_config.json (the Hub's files). None: not given (the processor's defaults)."""
    def read(name: str) -> dict | None:
        path = folder / name
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: cannot be read ({e}) — restore the checkpoint's file") from None
        if not isinstance(d, dict):
            raise UserError(f"{path}: not a JSON object — restore the checkpoint's file")
        return d

    nested = read("processor_config.json") or {}
    image, video = (nested.get(k) if isinstance(nested.get(k), dict) else None
                    for k in ("image_processor", "video_processor"))
    if image is None:
        image = read("preprocessor_config.json")
    if video is None:
        video = read("video_preprocessor_config.json") or read("preprocessor_config.json")
    return image, video


# ----------------------------------------------------------------------------- held-out evaluation


def eval_log(out: Path, then: Callable[[nn.Module, int, dict], dict] | None = None) -> Callable:
    """The loop's `eval_fn` that appends each evaluation's `eval/...` values to `out/eval.jsonl`
    (`then`: another eval_fn run first, e.g. ROUGE; its values are logged too and returned to the loop).
    Under torchrun rank 0 alone writes (every rank holds the same figures)."""
    def record(model: nn.Module, step: int, row: dict) -> dict:
        extra = dict(then(model, step, row)) if then is not None else {}
        values = {k: v for k, v in {**row, **extra}.items() if k.startswith("eval/")}

        def write() -> None:
            with open(out / EVAL_LOG, "a", encoding="utf-8") as f:
                f.write(strict_json({"step": step, **values}) + "\n")
        distributed.main_only(write)
        return extra
    return record


def evaluate_at_start(job: Job, cfg: Any, eval_fn: Callable | None = None) -> dict | None:
    """The held-out evaluation before step 1, so a run's first eval row is the model it started from
    (the base, or `init_adapter`): `train.evaluate_once` then `eval_fn` (give it `eval_log(out)` to
    record it). A resumed run runs none and drops the eval.jsonl rows after its checkpoint (they are
    written again). Returns the row (None: no eval data, or resumed)."""
    from minitrain.train import evaluate_once  # train imports nothing of run

    out = Path(cfg.out)
    if cfg.resume:
        step = checkpoint.read_state(out)["step"]
        distributed.main_only(lambda: checkpoint.truncate_log(out / EVAL_LOG, step))
        return None
    distributed.main_only(lambda: (out / EVAL_LOG).unlink(missing_ok=True))
    if not job.eval_examples:
        return None
    return evaluate_once(job.model, job.objective, job.eval_examples, job.collate, cfg, eval_fn=eval_fn, log=log)


def evaluate_only(cfg: Any, job: Job, eval_fn: Callable | None = None) -> dict[str, Any]:
    """`eval_only=true`: the recipe's held-out evaluation once, on the model as `setup` left it (the
    base with fresh adapters, which change nothing, or `init_adapter`), written to `out/eval.jsonl` as
    `{"step": 0, "eval/...": ...}` beside `out/config.json`. Nothing trains, no adapter or checkpoint is
    written. `eval_fn`: the recipe's extra evaluation (ROUGE, ...), called as the loop would at step 0.
    Returns `{"step": 0, "total_steps": 0, "eval/...", "out_dir"}`."""
    from minitrain.train import evaluate_once  # train imports nothing of run

    out = Path(cfg.out)
    if not job.eval_examples:
        raise UserError("eval_only=true: no held-out examples were read — pass eval_data=path/to/eval.jsonl "
                        "(or a larger eval_split)")
    what = f"adapter {cfg.init_adapter}" if getattr(cfg, "init_adapter", "") else "the base model"
    log(f"eval_only: evaluating {what} on {len(job.eval_examples)} held-out examples; nothing is trained")

    distributed.main_only(lambda: _write_text(out, CONFIG_FILE, to_json(cfg)))  # check_out_dir(cfg) has passed (the recipe)
    row = evaluate_once(job.model, job.objective, job.eval_examples, job.collate, cfg, eval_fn=eval_fn, log=log)
    values = {k: v for k, v in row.items() if k.startswith("eval/")}
    distributed.main_only(lambda: _write_text(out, EVAL_LOG, strict_json({"step": 0, **values}) + "\n"))
    log(f"eval: {out / EVAL_LOG} | config: {out / CONFIG_FILE}")
    return {"step": 0, "total_steps": 0, **values, "out_dir": str(out)}


# ----------------------------------------------------------------------------- the end


def finish(model: nn.Module, cfg: Any, lora: LoRAConfig | None, summary: dict[str, Any]) -> Path:
    """Save the adapter in PEFT's format into `out/adapter` (`lora` None, i.e. finetune=full: the model
    as an HF folder in `out/model`) and say where everything is. Every rank calls it: a sharded
    (`parallel=fsdp`) adapter is gathered for rank 0, a sharded model written one shard file at a time."""
    out = Path(cfg.out)
    folder = out / (ADAPTER_DIR if lora is not None else MODEL_DIR)
    sharded = any(distributed.is_sharded(p) for p in model.parameters())
    averaged = ema.of(model) if sharded else ema.whole(model)  # (whole: every rank gathers, rank 0 writes)

    def write(to: Path, values: dict[str, torch.Tensor] | None = None) -> None:
        """The adapter or model at `to`; `values`: tensors by parameter name to save in place of the model's."""
        if lora is not None:
            write_adapter(model, to, lora, values)
        elif sharded:  # never the whole model on one rank: one shard file at a time
            fsdp.save_model(to, {**_saved_tensors(model), **(values or {})}, _model_config(model),
                            side_files=lambda tmp: _copy_side_files(model, tmp), kept=carried_tensors(model))
        elif values is not None:
            with ema.swapped_in(model, values):
                write(to)
        else:  # every rank gathers (a ddp run: whole already), rank 0 writes
            tensors = {n: distributed.full_tensor(p.detach()).contiguous().cpu() for n, p in _saved_tensors(model).items()}
            distributed.main_only(lambda: _write_model(model, to, tensors))

    write(folder)
    if averaged is not None:
        write(folder.with_name(folder.name + EMA_SUFFIX), averaged)
    template = getattr(cfg, "chat_template", "")
    if template and lora is None:  # the template the run was given travels with the model (transformers reads it)
        for to in [folder] + ([folder.with_name(folder.name + EMA_SUFFIX)] if averaged is not None else []):
            distributed.main_only(lambda to=to: (to / TEMPLATE_FILE).write_text(
                CARRIED[template][0] if template in CARRIED else Path(template).read_text(encoding="utf-8"),
                encoding="utf-8"))
    loss = summary.get("loss")
    parts = [f"done: step {summary.get('step')}/{summary.get('total_steps')}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if summary.get("eval/loss") is not None:
        parts.append(f"eval/loss{' (EMA)' if getattr(cfg, 'ema_decay', 0) else ''} {summary['eval/loss']:.4f}")
    if summary.get("skipped_steps"):
        parts.append(f"{summary['skipped_steps']} skipped steps")
    log(" | ".join(parts))
    log(f"adapter (PEFT format): {folder}" if lora is not None else
        f"model (HF format, loads with transformers' from_pretrained): {folder}")
    if averaged is not None:
        log(f"EMA of the trained weights (ema_decay={cfg.ema_decay:g}), same format: {folder}{EMA_SUFFIX}")
    log(f"metrics: {out / 'metrics.jsonl'} | config: {out / CONFIG_FILE}")
    return folder


def write_adapter(model: nn.Module, folder: Path, lora: LoRAConfig,
                  values: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter in PEFT's format at `folder`. Every rank calls it under torchrun: a sharded
    (`parallel=fsdp`) adapter is gathered for rank 0, which writes. `values`: tensors by parameter
    name to save in place of the model's (the EMA)."""
    if any(distributed.is_sharded(p) for p in model.parameters()):
        values = fsdp.gather_whole(values or {n: p for n, p in model.named_parameters(remove_duplicate=False)
                                              if p.requires_grad})
    distributed.main_only(lambda: _write_adapter(model, folder, lora, values))


def _write_adapter(model: nn.Module, folder: Path, lora: LoRAConfig,
                   state: dict[str, torch.Tensor] | None = None) -> None:
    out = folder.parent
    try:
        save_adapter(model, folder, lora, state=state)
    except UserError as e:
        if not isinstance(e.__cause__, OSError | SafetensorError):
            raise
        raise UserError(f"{folder}: cannot write the adapter: {io_error_reason(e.__cause__)} — the "
                        f"trained checkpoint is in {out / checkpoint.NAME}: free space or make {out} writable, "
                        f"then rerun with resume=true to write the adapter") from None


def _saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a fully fine-tuned model's folder holds: its parameters and its persistent buffers (weights a
    checkpoint stores but nothing trains, e.g. Gemma 4's `layer_scalar`)."""
    params = dict(model.named_parameters())
    buffers = {f"{prefix}{'.' if prefix else ''}{name}": b for prefix, m in model.named_modules()
               for name, b in m.named_buffers(recurse=False) if b is not None and name not in m._non_persistent_buffers_set}
    return {**params, **buffers}


def _write_model(model: nn.Module, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The fully fine-tuned model as an HF folder: config.json, model.safetensors (`tensors`: the
    whole parameters, a tied one once under its first name; fp32: the master weights as trained)
    and the tokenizer (`SIDE_FILES`) of the folder the base came from."""
    out = folder.parent
    try:
        save_pretrained(model, folder, _model_config(model), dtype=torch.float32, state_dict=tensors)
        _copy_side_files(model, folder)
    except (OSError, UserError) as e:
        cause = e.__cause__ if isinstance(e, UserError) else e
        if not isinstance(cause, OSError | SafetensorError):
            raise
        raise UserError(f"{folder}: cannot write the model: {io_error_reason(cause)} — the trained checkpoint is in "
                        f"{out / checkpoint.NAME}: free space or make {out} writable, then rerun with resume=true "
                        f"to write the model") from None


def _model_config(model: nn.Module) -> dict[str, Any]:
    """The config.json of a trained model: its base's, with the embedding's rows as `vocab_size`."""
    emb = getattr(model, "input_embeddings", None)
    return dict(model.hf_config, **({"vocab_size": emb.num_embeddings} if isinstance(emb, nn.Embedding) else {}))


def _copy_side_files(model: nn.Module, folder: Path) -> None:
    """The tokenizer files (`SIDE_FILES`) of the folder the base came from, copied into `folder`."""
    source = getattr(model, "source_dir", None)
    for name in SIDE_FILES if source is not None else ():
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, folder / name)
