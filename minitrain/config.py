"""Run configuration: one dataclass per recipe kind, fields documented in `metadata["help"]`.

`TrainConfig` holds the keys every training recipe has. Objective-specific recipes subclass it
(e.g. `DPOConfig(TrainConfig)` adds `beta`), so no god-config branches on the family or objective.
The CLI applies typed `key=value` overrides to these dataclasses (see `minitrain.cli`).

Constraints live next to each field (`doc(4, "...", ge=1)`, `doc("cosine", "...", choices=...)`),
so `validate(cfg)` checks a subclass's new fields with no extra code. Rules that tie several
fields together go in a `check(self)` method of the dataclass, which `validate` calls last.
`to_json` / `from_json` write and read the run's resolved config (`out/config.json`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from minitrain.errors import UserError

T = TypeVar("T")

_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def doc(default, help: str, *, choices: tuple | None = None, ge=None, gt=None, le=None, lt=None,
        example: Any = None):
    """A dataclass field with its help text (shown by `python -m minitrain RECIPE.py --help`).

    `choices` lists the allowed values; `ge` / `gt` / `le` / `lt` bound a number (>=, >, <=, <).
    `validate` enforces them; `--help` shows them. `example`: the value an error message suggests
    where the default would suggest nothing useful (`fields={}`, `eval_split=0.0`).
    """
    meta: dict[str, Any] = {"help": help}
    if example is not None:
        meta["example"] = example
    if choices is not None:
        meta["choices"] = tuple(choices)
    for name, bound in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)):
        if bound is not None:
            meta[name] = bound
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Keys every training recipe has."""

    model: str = doc("", "HF-format model folder (config.json + *.safetensors + tokenizer)")
    data: str = doc("", "training data: JSONL, JSON, CSV/TSV, Parquet, Arrow or a datasets folder (its train split)")
    eval_data: str = doc("", "held-out data, same formats; a datasets folder's validation split: "
                             "path/to/folder/validation (empty: no eval, or eval_split)")
    eval_split: float = doc(0.0, "hold out this share of data (seeded, the same on every resume) when there is "
                                 "no eval_data", ge=0, lt=1, example=0.05)
    fields: dict[str, str] = doc({}, 'your column names for the row shapes\' keys, e.g. {"prompt": "question", '
                                     '"completion": "answer"}',
                                 example={"prompt": "question", "completion": "answer"})
    data_weights: list[float] = doc([], "with several data sources: how many times each source's examples are taken per "
                                        "epoch (2: twice, 0.5: a seeded half), one weight per source")
    data_cache: str = doc("auto", "folder of the token stores (the tokenized data, memory-mapped, reused while "
                                  "nothing that made it changes); auto: $XDG_CACHE_HOME/minitrain/data or "
                                  "~/.cache/minitrain/data; false: tokenize into memory at every start")
    data_workers: int = doc(0, "processes that build a token store (0: the usable cores)", ge=0)
    data_cache_days: float = doc(30, "after building a token store, remove the stores of data_cache that no run "
                                      "opened for this many days (0: keep them all; `minitrain cache` lists them)",
                                 ge=0)
    out: str = doc("runs/run", "output folder: metrics.jsonl, config.json, adapter/, checkpoint/")
    max_steps: int = doc(-1, "optimizer steps to run (-1: derived from epochs)", ge=-1)
    epochs: float = doc(1.0, "passes over the data when max_steps is -1", gt=0)
    batch_size: int = doc(4, "examples per micro-batch (pairs for DPO)", ge=1)
    grad_accum: int = doc(1, "micro-batches per optimizer step", ge=1)
    lr: float = doc(2e-4, "peak learning rate", gt=0)
    weight_decay: float = doc(0.0, "AdamW weight decay", ge=0)
    max_grad_norm: float = doc(1.0, "clip the global gradient norm to this (0: no clipping)", ge=0)
    warmup: float = doc(0.0, "warmup: optimizer steps if >= 1, else a ratio of the total steps", ge=0)
    schedule: str = doc("cosine", "LR schedule after warmup", choices=("constant", "linear", "cosine"))
    min_lr_ratio: float = doc(0.0, "cosine / linear decay floor as a fraction of lr", ge=0, le=1)
    seed: int = doc(0, "seed for init, shuffling and dropout", ge=0)
    max_len: int = doc(512, "maximum tokens per sequence (prompt + completion)", ge=2)
    chat_format: str = doc("auto", "how chats are rendered: auto = the checkpoint's chat template (else detected "
                                   "from the vocabulary); a name overrides the template",
                           choices=("auto", "mistral", "llama2", "llama3"))
    chat_template: str = doc("", "a chat template for a checkpoint without one (or to replace its own): a .jinja "
                                 "file, or the name of one minitrain carries: chatml")
    prompt_completion: str = doc("raw", "{prompt, completion} string rows: raw = trained as plain text, as TRL does; "
                                        "chat = one user turn and one assistant turn through the chat template",
                                 choices=("raw", "chat"))
    chat_template_kwargs: dict = doc({}, 'variables for the chat template, e.g. {"enable_thinking": false}',
                                     example={"enable_thinking": False})
    truncation_side: str = doc("left", "which end of an over-long prompt to cut", choices=("left", "right"))
    group_by_length: bool = doc(True, "batch examples of similar length together (less padding; order still seeded)")
    device: str = doc("auto", "where to train: auto (cuda if available, else cpu) | cpu | cuda | cuda:N")
    threads: int = doc(0, "CPU runs: torch threads (0: the cores idle at start, at least 1; OMP_NUM_THREADS "
                          "also sets it)", ge=0)
    precision: str = doc("auto", "auto: bf16 autocast where supported, else fp32",
                         choices=("auto", "bf16", "fp32", "fp16"))
    checkpointing: int | bool = doc(False, "non-reentrant activation checkpointing per block: true = every "
                                           "block, false = none, N = the first N blocks (their activations "
                                           "live longest; the rest keep theirs, no recompute)", ge=0,
                                    example=True)
    memory_check: bool = doc(True, "on CUDA, plan the peak memory from config.json before loading and stop "
                                   "with suggestions if it exceeds the free memory (minitrain.plan.fit)")
    auto_fit: bool = doc(False, "when the plan does not fit: checkpoint the fewest blocks that fit "
                                "(checkpointing=N), else every block and a smaller micro-batch (global batch "
                                "kept through grad_accum) instead of stopping")
    gpu_mem: str = doc("", "plan against this much device memory (e.g. 12GiB) instead of the GPU's free "
                           "memory; also checks on a machine without a GPU", example="12GiB")
    compile: bool = doc(False, "torch.compile each block (CUDA; CPU with a C++ compiler)")
    attention: str = doc("auto", "how rows of several sequences attend (packing=true, DPO's shared_prompt, GRPO's "
                                 "shared prompt; padded batches are not affected): sdpa = a dense (B, 1, T, T) mask "
                                 "through SDPA; flex = FlexAttention with a block mask of the rows' document ids (only "
                                 "the blocks that attend are computed; CUDA only: it has no backward on a CPU); "
                                 "auto = flex on CUDA with compile=true, else sdpa",
                         choices=("auto", "sdpa", "flex"))
    kernels: str = doc("auto", "Qwen3.5's Gated DeltaNet layers on CUDA: auto = flash-linear-attention's Triton "
                               "kernels when the kernels extra is installed (pip install \"minitrain[kernels]\"), else "
                               "the torch path; fla = those kernels or one line saying why not; torch = the torch path",
                       choices=("auto", "fla", "torch"))
    parallel: str = doc("ddp", "under torchrun: ddp (each rank holds the model, gradients summed) or fsdp "
                               "(FSDP2 shards blocks, gradients and optimizer state); fsdp needs torchrun",
                        choices=("ddp", "fsdp"))
    dist_timeout: float = doc(600, "under torchrun: seconds a rank waits in a collective for the others before the "
                                   "run stops with one line naming the rank that stopped answering (a dead or "
                                   "stuck peer ends the run, never a hang)", gt=0)
    save_every: int = doc(0, "save a resumable checkpoint every N optimizer steps (0: only at the end)", ge=0)
    stop_after: int = doc(0, "stop after this many optimizer steps of this launch, with a checkpoint (a job with a "
                             "time limit continues with resume=true); 0: run to the end", ge=0)
    eval_every: int = doc(0, "evaluate every N optimizer steps (0: only at the end)", ge=0)
    log_every: int = doc(1, "write metrics every N optimizer steps", ge=1)
    report_to: list[str] = doc([], "experiment trackers beside metrics.jsonl, comma-separated: tensorboard "
                                   "(out/tensorboard/), wandb, trackio, mlflow (each its extra; settings by their own "
                                   "environment variables: WANDB_PROJECT, MLFLOW_TRACKING_URI, ...); none",
                               example=["tensorboard"])
    resume: bool = doc(False, "continue exactly from out/checkpoint")
    extend: bool = doc(False, "with resume: continue a run (finished or not) to a new max_steps / epochs; the "
                              "steps after the checkpoint take the LR of a schedule sized for the new total "
                              "(printed before they run)")
    overwrite: bool = doc(False, "allow writing into an output folder that holds a different run")
    max_bad_steps: int = doc(5, "stop (with a checkpoint) after this many non-finite steps in a row", ge=1)
    skip_audit: bool = doc(False, "skip the gradient-path audit before step 1 (the skip is logged)")
    ema_decay: float = doc(0.0, "keep an exponential moving average of the trained tensors, ema = d*ema + (1-d)*w "
                                "after each optimizer step; evaluation uses it, and it is saved as out/adapter_ema "
                                "(or out/model_ema); 0: none (e.g. 0.999)", ge=0, lt=1, example=0.999)
    finetune: str = doc("lora", "what trains: lora (adapters on a frozen base) or full (every floating-point "
                                "parameter, fp32 master weights; the model is saved as an HF folder in out/model)",
                        choices=("lora", "full"))
    # adapters
    lora_r: int = doc(16, "LoRA rank", ge=1)
    lora_alpha: float = doc(32.0, "LoRA alpha (scaling alpha / r, or alpha / sqrt(r) with rslora)", gt=0)
    lora_dropout: float = doc(0.0, "dropout on the LoRA input", ge=0, lt=1)
    lora_targets: list[str] = doc(["q_proj", "k_proj", "v_proj", "o_proj"],
                                  "module-name suffixes to adapt, all-linear, or one regular expression over full "
                                  "module names (a vision tower's or merger's linears too)")
    rslora: bool = doc(False, "rank-stabilised LoRA scaling")
    modules_to_save: list[str] = doc([], "modules to train fully (e.g. lm_head): costly, reported loudly",
                                     example=["lm_head"])
    init_adapter: str = doc("", "continue training this saved adapter folder (loaded trainable)")
    router_z_loss_coef: float = doc(0.0, "mixture-of-experts: add this x the router z-loss (ST-MoE: the mean over "
                                         "tokens and layers of logsumexp(router logits)^2), logged as z_loss; 0: off",
                                    ge=0, example=0.001)
    eval_only: bool = doc(False, "train nothing: run the recipe's held-out evaluation once on the base (or "
                                 "init_adapter) and write out/eval.jsonl; needs eval_data or eval_split")
    quantize: str = doc("none", "quantize base linears as they load (nf4, int8 need bitsandbytes; ternary: "
                                "BitNet b1.58 {-1,0,+1} x absmean scale, 2 bits a weight, plain torch)",
                        choices=("none", "nf4", "int8", "ternary"))
    ternary_scale: str = doc("tensor", "quantize=ternary: one absmean scale per tensor or per output channel",
                             choices=("tensor", "channel"))
    ternary_act_bits: int = doc(0, "quantize=ternary: fake-quantize each base linear's input per token to this many "
                                   "bits (absmax, straight-through, as BitLinear: 8); 0: off", ge=0, le=16)

    def check(self) -> None:
        """Rules across fields (per-field bounds and choices are checked by `validate`)."""
        if self.report_to:
            from minitrain.trackers import check

            check(self.report_to)
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise UserError(f"device={shown(self.device)}: not a device — use auto, cpu, cuda or cuda:N")
        if self.gpu_mem:
            try:
                parse_bytes(self.gpu_mem)
            except UserError:
                raise UserError(f"gpu_mem={shown(self.gpu_mem)}: not a size — e.g. gpu_mem=12GiB") from None
        if self.extend and not self.resume:
            raise UserError("extend=true: extends a saved run — pass resume=true with it (and the new max_steps "
                            "or epochs)")
        if self.max_steps == 0:
            raise UserError("max_steps=0: would train nothing — give a number of optimizer steps, "
                            "max_steps=-1 to derive it from epochs, or eval_only=true to evaluate without training")
        if self.eval_only and not (self.eval_data or self.eval_split):
            raise UserError("eval_only=true: no held-out data to evaluate — pass eval_data=path/to/eval.jsonl "
                            "(or eval_split=0.1 of data)")
        if self.eval_only and self.resume:
            raise UserError("eval_only=true: evaluates without training, so there is nothing to resume — drop "
                            "resume=true (evaluate a saved adapter with init_adapter=run/adapter)")
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            raise UserError(f"warmup={format_value(self.warmup)}: a warmup of 1 or more counts optimizer "
                            f"steps and must be whole — e.g. warmup=100, or warmup=0.03 for a ratio")
        if any(w < 0 or not math.isfinite(w) for w in self.data_weights):
            raise UserError(f"data_weights={list(self.data_weights)}: weights must be finite and >= 0")
        if self.eval_split and self.eval_data:
            raise UserError(f"eval_split={format_value(self.eval_split)}: eval_data is given too — use one of them")
        for k in self.chat_template_kwargs:
            if k in ("messages", "add_generation_prompt", "tools", "documents"):
                raise UserError(f"chat_template_kwargs: {k!r} is set by minitrain itself — remove it")
        if self.ternary_act_bits == 1:
            raise UserError("ternary_act_bits=1: one bit cannot hold a signed value — use 8 (BitLinear's) or 0 (off)")
        if self.quantize != "ternary" and (self.ternary_act_bits or self.ternary_scale != "tensor"):
            key = "ternary_act_bits" if self.ternary_act_bits else "ternary_scale"
            raise UserError(f"{key}={format_value(getattr(self, key))}: applies to quantize=ternary only (this run has "
                            f"quantize={self.quantize}) — add quantize=ternary or drop {key}")
        if self.finetune == "full":
            if self.quantize != "none":
                raise UserError(f"quantize={self.quantize}: finetune=full trains every weight, and quantized weights "
                                f"cannot train — use quantize=none, or finetune=lora to train adapters on a "
                                f"quantized base")
            if self.init_adapter:
                raise UserError("init_adapter: continues a LoRA adapter, but finetune=full trains the weights "
                                "themselves — drop init_adapter, or use finetune=lora")
            return
        if not self.lora_targets and not self.modules_to_save and not self.init_adapter:
            raise UserError("lora_targets: empty, so nothing would train — name modules to adapt, "
                            "e.g. lora_targets=q_proj,v_proj (or all-linear)")


# ----------------------------------------------------------------------------- values and types


@dataclass
class SFTConfig(TrainConfig):
    """A causal SFT run (`recipes/sft_llama.py`, `recipes/sft_mistral.py`): `TrainConfig` plus packing."""

    packing: bool = doc(False, "pack each micro-batch's examples into rows of up to max_len tokens (positions "
                               "restart, attention stays inside each example; same loss, no padding)")


def parse_bytes(text: str) -> int:
    """`12GiB`, `12 GB`, `8000MiB`, `1.5GiB` -> bytes (GB = 1e9, GiB = 2**30; a bare number is GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise UserError(f"--gpu-mem {text}: not a size — e.g. --gpu-mem 12GiB or --gpu-mem 24GB")
    value, unit = float(m.group(1)), (m.group(2) or "GiB").upper()
    scale = {"B": 1, "K": 1e3, "KB": 1e3, "KI": 2**10, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MI": 2**20, "MIB": 2**20,
             "G": 1e9, "GB": 1e9, "GI": 2**30, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TI": 2**40, "TIB": 2**40}[unit]
    return int(value * scale)


def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of each dataclass field (string annotations evaluated)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """`(X, True)` for `Optional[X]` / `X | None`, else `(tp, False)`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def union_members(tp: Any) -> tuple[Any, ...]:
    """The members of a union other than `X | None` (`int | bool` -> `(int, bool)`), else `()`."""
    inner, _ = unwrap_optional(tp)
    if typing.get_origin(inner) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(inner) if a is not type(None))
    return ()


def checkpointed_blocks(setting: int | bool, blocks: int) -> int:
    """How many blocks `checkpointing=setting` wraps in a model of `blocks` blocks: true all, false
    none, N the first N (0 to `blocks`); UserError naming the key for an N the model does not have."""
    if isinstance(setting, bool):
        return blocks if setting else 0
    if not 0 <= setting <= blocks:
        raise UserError(f"checkpointing={setting}: the model has {blocks} blocks — give 0 to {blocks} (the first N "
                        f"blocks are checkpointed), or checkpointing=true for all of them")
    return setting


def type_name(tp: Any) -> str:
    """How a field type reads in help and errors: `int`, `list[str]`, `float | None`."""
    inner, optional = unwrap_optional(tp)
    if typing.get_origin(inner) is not None:
        name = str(inner).replace("typing.", "")
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} | None" if optional else name


def conforms(value: Any, tp: Any) -> bool:
    """Whether `value` is of field type `tp` (bool is not an int; an int is a float)."""
    inner, optional = unwrap_optional(tp)
    if value is None:
        return optional or tp is Any
    origin = typing.get_origin(inner)
    if inner is Any:
        return True
    if union_members(inner):
        return any(conforms(value, m) for m in union_members(inner))
    if inner is bool:
        return isinstance(value, bool)
    if inner is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if inner is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if inner in (list, tuple, dict, str):
        return isinstance(value, inner)
    if origin in (list, tuple):
        args = typing.get_args(inner)
        elem = args[0] if args else Any
        return isinstance(value, origin) and all(conforms(v, elem) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if origin is typing.Literal:
        return value in typing.get_args(inner)
    return isinstance(value, inner) if isinstance(inner, type) else True


def format_value(value: Any) -> str:
    """A value written the way the command line takes it back (`true`, `a,b`, `none`)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        plain = all(isinstance(v, str) and v and "," not in v and v.strip() == v and not v.startswith("[")
                    or isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        return ",".join(map(format_value, value)) if plain else json.dumps(list(value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def shown(text: str) -> str:
    """User text as it goes into a one-line message: quoted with escapes if it has a newline or the like."""
    return text if text.isprintable() else repr(text)


# ----------------------------------------------------------------------------- validation


def check_model_folder(folder: Any, key: str = "model") -> None:
    """One line for a `model=` (or `teacher=`) that is not set or names no folder."""
    if not folder:
        raise UserError(f"{key}: not set — pass {key}=path/to/hf_model_folder (config.json, *.safetensors, tokenizer)")
    if not Path(folder).is_dir():
        raise UserError(f"{folder}: no such model folder — pass {key}=path/to/hf_model_folder "
                        f"(config.json, *.safetensors, tokenizer)")


def check_paths(cfg: Any) -> None:
    """The folders and files a run reads, checked before anything heavy is imported (`minitrain.cli`):
    `model` / `teacher` folders, `data` / `eval_data` sources. The loaders check them again, deeper."""
    from minitrain.data.files import data_sources, missing_data

    for key in ("model", "teacher"):  # (not set: the recipe says so, with its own advice)
        if getattr(cfg, key, ""):
            check_model_folder(getattr(cfg, key), key)
    if hasattr(cfg, "model") and not cfg.model:
        return  # "model: not set" comes first, from the recipe
    for key in ("data", "eval_data"):
        value = getattr(cfg, key, "")
        for source in data_sources(value) if value else ():
            if not Path(source).exists():
                raise UserError(missing_data(source))


def validate(cfg: Any) -> None:
    """Check every field's type, bounds and choices, then the class's `check()`; UserError naming the key."""
    types_ = field_types(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        tp = types_[f.name]
        if not conforms(value, tp):
            raise UserError(f"{f.name}={shown(format_value(value))}: expected {type_name(tp)} — "
                            f"e.g. {f.name}={format_value(example(f))}")
        if value is None:
            continue
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"did you mean {f.name}={close[0]}?" if close else f"e.g. {f.name}={choices[0]}"
            raise UserError(f"{f.name}={shown(format_value(value))}: must be one of "
                            f"{' | '.join(map(str, choices))} — {hint}")
        for key, (sign, ok) in _BOUNDS.items():
            bound = f.metadata.get(key)
            if bound is None:
                continue
            if (isinstance(value, float) and not math.isfinite(value)) or not ok(value, bound):
                good = example(f)
                hint = (f"e.g. {f.name}={format_value(good)}" if good is not None and ok(good, bound)
                        else f"pass a value {sign} {bound}")
                raise UserError(f"{f.name}={format_value(value)}: must be {sign} {bound} — {hint}")
    check = getattr(cfg, "check", None)
    if callable(check):
        check()


def example(f: dataclasses.Field, current: Any = dataclasses.MISSING) -> Any:
    """The value an error suggests for field `f`: its `example`, else `current` (or the default)."""
    if "example" in f.metadata:
        return f.metadata["example"]
    return _default(f) if current is dataclasses.MISSING else current


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


# ----------------------------------------------------------------------------- JSON


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config's fields as a plain dict (lists copied)."""
    return dataclasses.asdict(cfg)


def to_json(cfg: Any, **extra: Any) -> str:
    """The resolved config as JSON text (what `out/config.json` holds), plus `extra` entries (the run's
    `trained_format`)."""
    return json.dumps({**to_dict(cfg), **extra}, indent=2, ensure_ascii=False, default=str) + "\n"


def from_json(text: str, cls: type[T], where: str = "config.json") -> T:
    """Read a config written by `to_json` back into `cls`, strictly (unknown keys, wrong types: UserError).

    Keys the file lacks take the class defaults, so a config written before a field was added
    still reads.
    """
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UserError(f"{where}: not valid JSON ({e}) — fix or delete the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object of config keys — fix or delete the file")
    data.pop("trained_format", None)  # what the run wrote beside its keys (minitrain.run.trained_format)
    types_ = field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} for {cls.__name__} — "
                        f"remove them (valid keys: {', '.join(types_)})")
    for key, value in data.items():
        inner = unwrap_optional(types_[key])[0]
        if isinstance(value, list) and (inner is tuple or typing.get_origin(inner) is tuple):
            value = data[key] = tuple(value)  # JSON has no tuples
        if not conforms(value, types_[key]):
            raise UserError(f"{where}: {key}={json.dumps(value)} is not {type_name(types_[key])} — "
                            f"fix or delete the file")
        if isinstance(value, int) and not isinstance(value, bool) and unwrap_optional(types_[key])[0] is float:
            data[key] = float(value)
    return cls(**data)
