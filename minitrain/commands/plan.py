"""Predict a recipe's peak GPU memory before running it, and what to change to make it fit.

    minitrain plan RECIPE.py key=value ... [--gpu-mem 12GiB] [--seq N] [--targets N] [--device cuda|cpu] [--all]
                         [--world N] [--parallel ddp|fsdp]

The recipe's config is loaded exactly as `python -m minitrain RECIPE.py key=value ...` would
(`minitrain.cli.load_recipe` + `resolve_config` + `validate`: a recipe's demo settings apply
only when no model, data or eval_data is named); of the model only `config.json`
is read, never the weights. The memory model is `minitrain.plan` (its docstring says what is
counted and how); it models LLaMA, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and T5 (source rows `max_len` or `--seq` long,
target rows `max_target_len`). The device is the recipe's (`device=cpu` plans a CPU run:
its smaller loss chunk, no CUDA context) unless `--device` says otherwise. The worst case is planned: every row `max_len` long (or `--seq`),
every position a target (or `--targets` per micro-batch). `--all` also prints the other candidate
peak moments. `--world N` plans one rank of N under torchrun (rank 0: its share of the batch), with
the recipe's `parallel=` key (ddp: the whole model on every rank; fsdp: FSDP2's 1/N shards, the gathered
blocks and root, the embeddings and head by rows, the reduce-scatter buffers; `minitrain.plan.sharded`)
unless `--parallel` says otherwise;
`--gpu-mem` is then one rank's device. Exit code: 0 fits (or no --gpu-mem), 1 does not fit, 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


from minitrain.config import parse_bytes
from minitrain.errors import UserError
from minitrain.plan.predict import predict, run_shape, shape_from_hf, suggestions
from minitrain.plan.run_shape import RESERVE_CONTEXT, RESERVE_SLACK, fmt_bytes

USAGE = ("usage: minitrain plan RECIPE [key=value ...] [--gpu-mem 12GiB] [--seq N] [--targets N] "
         "[--device cuda|cpu] [--all] [--world N] [--parallel ddp|fsdp]")
OPTIONS = {"--gpu-mem": str, "--seq": int, "--targets": int, "--device": str, "--world": int, "--parallel": str}


def parse_args(argv: list[str]) -> tuple[str, list[str], dict]:
    """(recipe path, key=value overrides, options)."""
    opts: dict = {"--all": False, "--device": None, "--world": 1, "--parallel": None}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if a == "--all":
            opts["--all"] = True
        elif name in OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{name}: needs a value — {USAGE}")
                i += 1
                value = argv[i]
            try:
                opts[name] = OPTIONS[name](value)
            except ValueError:
                raise UserError(f"{name} {value}: expected {OPTIONS[name].__name__} — {USAGE}") from None
        elif a in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        else:
            rest.append(a)
        i += 1
    if not rest or "=" in rest[0] or rest[0].startswith("-"):
        raise UserError(f"no recipe given — {USAGE}")
    if opts["--device"] not in (None, "cuda", "cpu"):
        raise UserError(f"--device {opts['--device']}: use cuda or cpu")
    if opts["--world"] < 1:
        raise UserError(f"--world {opts['--world']}: the number of ranks, 1 or more")
    if opts["--parallel"] not in (None, "ddp", "fsdp"):
        raise UserError(f"--parallel {opts['--parallel']}: use ddp or fsdp")
    return rest[0], rest[1:], opts


def load_config(path: str, overrides: list[str], opts: dict | None = None):
    """The recipe's config with the overrides; `--parallel` sets `parallel`, and a world the
    batch cannot feed is refused as torchrun would (`minitrain.parallel.distributed.check`)."""
    import dataclasses

    from minitrain.parallel import distributed
    from minitrain.cli import load_recipe, recipe_path, resolve_config
    from minitrain.config import validate

    cfg, _ = resolve_config(load_recipe(recipe_path(path)), overrides)
    validate(cfg)
    opts = opts or {}
    if opts.get("--parallel"):
        cfg = dataclasses.replace(cfg, parallel=opts["--parallel"])
    world = opts.get("--world", 1)
    if world > 1 or getattr(cfg, "parallel", "ddp") == "fsdp":
        distributed.check(cfg, world, under_torchrun=True)
    return cfg


def read_model_config(cfg) -> tuple[dict, Path]:
    if not cfg.model:
        raise UserError("model: not set — pass model=path/to/hf_model_folder (only its config.json is read)")
    path = Path(cfg.model) / "config.json"
    if not path.is_file():
        raise UserError(f"{path}: not found — pass model=a folder holding the model's config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8")), path
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({e}) — fix the file") from None


def plan_device(cfg, given: str | None) -> str:
    """The device planned for: `--device` when given, else the recipe's `device` (cpu for `device=cpu`;
    cuda for cuda, cuda:N and auto, since a plan is mostly asked for a GPU)."""
    if given:
        return given
    return "cpu" if str(getattr(cfg, "device", "auto")).startswith("cpu") else "cuda"


def checkpointing_text(k: int, blocks: int) -> str:
    """`checkpointing on`, `off`, or `on the first 3 of 32 blocks`."""
    return f"checkpointing {'off' if not k else 'on' if k == blocks else f'on the first {k} of {blocks} blocks'}"


def row(name: str, nbytes: int, formula: str = "", indent: int = 2) -> str:
    return f"{' ' * indent}{name:<44}{fmt_bytes(nbytes):>12}   {formula}"


def render(cfg, path: str, overrides: list[str], opts: dict) -> tuple[str, bool]:
    """The report text and whether it fits (True when no --gpu-mem is given)."""
    hf, config_path = read_model_config(cfg)
    opts = {**opts, "--device": plan_device(cfg, opts["--device"])}
    model = shape_from_hf(hf, where=str(config_path))
    run = run_shape(cfg, device=opts["--device"], seq=opts.get("--seq"), targets=opts.get("--targets"),
                    world=opts.get("--world", 1))
    plan = predict(model, run)
    lines = [f"plan: {path} {' '.join(overrides)}".rstrip(),
             f"model: {config_path} ({model.model_type}, {model.num_params() / 1e9:.2f}B params, {model.describe()})",
             f"run: {opts['--device']}, {run.compute} compute, "
             + ("full fine-tuning: every weight trains, fp32 master weights, " if run.full else
                f"base {run.quantize if run.quantize != 'none' else run.compute}, LoRA {run.rank_text} on "
                f"{','.join(run.lora_targets)}, ")
             + checkpointing_text(run.checkpointed(model.blocks), model.blocks)
             + (f", {'KTO' if run.reference_rows else 'DPO'} reference: {run.dpo_reference}"
                if run.dpo_reference not in (None, "none") else "")
             + (", no reference (orpo / cpo / simpo: one forward per pair)" if run.dpo_reference == "none" else ""),
             f"micro-batch: {run.rows} rows x "
             + (f"{run.seq} source + {run.target_seq or run.seq} target tokens" if model.is_encoder_decoder
                else f"{run.seq} tokens")
             + (f" ({run.rows // 2} pair{'s' if run.rows > 2 else ''}, chosen + rejected in one forward)"
                if run.dpo_reference and not run.reference_rows else "")
             + (f" (KTO: the reference scores {run.reference_rows} rows, these and their KL rows; the KL rows' "
                f"policy forward has no graph)" if run.reference_rows else "")
             + (f", {run.targets} targets" if run.targets is not None else ", every position a target (worst case)"),
             *([f"per rank: rank 0 of {run.world} ({run.parallel}), {-(-run.rows // run.world)} of the {run.rows} rows"
                + (": FSDP2 shards parameters, gradients and optimizer state 1/N" if run.parallel == "fsdp"
                   else ": the whole model on every rank")]
               if run.world > 1 or run.parallel == "fsdp" else []),
             ""]
    lines.append("  persistent")
    for t in plan.persistent:
        lines.append(row(t.name, t.bytes, t.formula, 4))
    lines.append(row("persistent total", plan.persistent_bytes))
    moments = list(plan.moments) if opts["--all"] else [plan.peak_moment]
    for m in moments:
        mark = " (the peak)" if m == plan.peak_moment else ""
        lines.append(f"  activations and transients at: {m}{mark}")
        for t in plan.moments[m]:
            lines.append(row(t.name, t.bytes, t.formula, 4))
        lines.append(row(f"total at {m}", plan.moment_bytes(m)))
    for n in plan.notes:
        lines.append(f"  note: {n}")
    lines.append("")
    lines.append(row("predicted peak (torch.cuda.max_memory_allocated)", plan.peak, "", 0))
    needed = plan.peak * (1 + RESERVE_SLACK) + RESERVE_CONTEXT
    lines.append(row(f"+ CUDA context ~{fmt_bytes(RESERVE_CONTEXT)} + {RESERVE_SLACK:.0%} allocator slack",
                     int(needed), "", 0))
    fits = True
    gpu = opts.get("--gpu-mem")
    if gpu:
        budget = parse_bytes(gpu)
        fits = needed <= budget
        spare = budget - needed
        lines.append(f"verdict: {'FITS' if fits else 'DOES NOT FIT'} in {fmt_bytes(budget)} "
                     f"({fmt_bytes(needed)} needed, {fmt_bytes(abs(spare))} {'spare' if fits else 'short'})")
    else:
        lines.append("verdict: pass --gpu-mem 12GiB (your GPU's memory) for a verdict")
    tips = suggestions(model, run, cfg.batch_size, cfg.grad_accum)
    if tips:
        lines.append("to use less memory (one change at a time, predicted saving -> new peak + reserve):")
        for keys, saving, peak in sorted(tips, key=lambda t: -t[1]):
            new_needed = peak * (1 + RESERVE_SLACK) + RESERVE_CONTEXT
            ok = "" if not gpu else ("  fits" if new_needed <= parse_bytes(gpu) else "  still too big")
            lines.append(f"  {keys:<58} saves {fmt_bytes(saving):>10} -> {fmt_bytes(new_needed)}{ok}")
    return "\n".join(lines), fits


def main(argv: list[str]) -> int:
    try:
        path, overrides, opts = parse_args(argv)
        cfg = load_config(path, overrides, opts)
        text, fits = render(cfg, path, overrides, opts)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if fits else 1

