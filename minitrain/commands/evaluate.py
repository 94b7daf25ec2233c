"""Score a model (and an adapter) on lm-evaluation-harness tasks, with minitrain's own model code.

    minitrain evaluate --model minitrain --model_args pretrained=path/to/base,adapter=runs/sft/adapter \\
        --tasks my_task --include_path my_tasks/ [--limit 100] [--num_fewshot 0] [--batch_size 8] \\
        [--output_path results.json]

The flags are lm-eval's own (`lm_eval --model hf ...` becomes `minitrain evaluate --model
minitrain ...`): lm-eval 0.4 finds model classes only in its own package, so this script registers
ours under the name `minitrain` (`MinitrainLM`, lm-eval's `TemplateLM` over
`minitrain.evaluate.harness.HarnessLM`) and calls lm-eval's `simple_evaluate`. From Python, after this
file's `register()`, `lm_eval.simple_evaluate(model="minitrain", model_args="pretrained=...,adapter=...")`
works too.

model_args: `pretrained` (an HF-format folder), `adapter` (a PEFT-format adapter folder, e.g. a run's
`out/adapter`; refused if the run trained it on another base), `quantize` (none, nf4, int8, ternary:
the base as a QLoRA / LRC run loaded it), `dtype` (float32, the default, bfloat16, float16), `device`
(cpu, cuda, auto), `max_length`, `batch_size`. Tasks are read from local files: a task whose
`dataset_path` is on the Hugging Face Hub is refused before anything loads (minitrain runs offline;
`--allow_hub` lets lm-eval download it). Needs the `eval` extra: pip install 'minitrain[eval]'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


import torch

import models
from minitrain.checkpoint import check_adapter_base
from minitrain.errors import UserError

LOCAL_BUILDERS = ("json", "csv", "parquet", "arrow", "text")  # `datasets` builders that read local files
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("lm-evaluation-harness is not installed — pip install 'minitrain[eval]' "
                        "(or pip install 'lm_eval>=0.4,<0.5')") from None


def load(pretrained: str, adapter: str | None = None, *, quantize: str = "none", dtype: str = "float32",
         device: str = "cpu") -> tuple[torch.nn.Module, object]:
    """Our model of folder `pretrained` (quantized as asked) with `adapter` applied (frozen), and its tokenizer."""
    from minitrain.adapters.peft_format import load_adapter
    from minitrain.config import TrainConfig
    from minitrain.run import load_model

    if dtype not in DTYPES:
        raise UserError(f"dtype={dtype}: not one of {', '.join(DTYPES)}")
    if adapter is not None and not Path(adapter).is_dir():
        raise UserError(f"adapter={adapter}: no such adapter folder — pass a PEFT-format folder such as a run's "
                        f"out/adapter")
    if not Path(pretrained).is_dir():
        raise UserError(f"pretrained={pretrained}: no such model folder — pass an HF-format folder (config.json, "
                        f"*.safetensors, tokenizer)")
    if adapter is not None:
        check_adapter_base(adapter, pretrained)  # before minutes of loading
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    if quantize not in ("none", "nf4", "int8", "ternary"):
        raise UserError(f"quantize={quantize}: not one of none, nf4, int8, ternary")
    cfg = TrainConfig(model=pretrained, quantize=quantize, precision=precision, device=device)
    try:
        model, tok = load_model(cfg, models.from_hf_config)
    except ValueError as e:  # config.json of a family we do not load
        raise UserError(f"pretrained={pretrained}: {e}") from None
    if adapter is not None:
        load_adapter(model, adapter)
    return model.eval(), tok


def register():
    """Register `MinitrainLM` with lm-eval as `minitrain` and return it (lm_eval imported only when asked for)."""
    import lm_eval.models  # noqa: F401  lm-eval's own names first (it registers them on this import)
    from lm_eval.api.registry import model_registry, register_model

    from minitrain.evaluate.harness import HarnessLM

    if "minitrain" in model_registry:
        return model_registry.get("minitrain")

    @register_model("minitrain")
    class MinitrainLM(HarnessLM):
        """lm-eval's `--model minitrain`: model_args pretrained=DIR[,adapter=DIR,quantize=,dtype=,device=,
        max_length=,batch_size=]."""

        def __init__(self, pretrained: str, adapter: str | None = None, quantize: str = "none",
                     dtype: str = "float32", device: str | None = "cpu", batch_size: int | str = 8,
                     max_length: int | None = None, max_batch_size: int | None = None, **_: object):
            model, tok = load(pretrained, adapter or None, quantize=quantize, dtype=dtype, device=device or "cpu")
            if str(batch_size) == "auto":
                batch_size = 8
            super().__init__(model, tok, models.family(model).generate, batch_size=int(batch_size),
                             max_length=int(max_length) if max_length else None)

    return MinitrainLM


def hub_tasks(task_manager, names: list[str]) -> list[tuple[str, str]]:
    """(task, dataset_path) of each named task (groups and tags opened) whose data comes from the Hub."""
    from lm_eval.tasks._index import Kind

    index, found, seen = task_manager.task_index, [], set()

    def visit(name: str) -> None:
        if name in seen or name not in index:
            return
        seen.add(name)
        entry = index[name]
        cfg = entry.cfg or {}
        if entry.kind == Kind.TAG:
            for other in index.values():
                if name in other.tags:
                    visit(other.name)
            return
        if entry.kind == Kind.GROUP:
            for sub in cfg.get("task", []):
                visit(sub if isinstance(sub, str) else sub.get("task", ""))
            return
        path = cfg.get("dataset_path")
        if path and path not in LOCAL_BUILDERS and not Path(path).exists():
            found.append((name, str(path)))

    for n in names:
        visit(n)
    return found


def evaluate(model_args: str, tasks: list[str], *, include_path: str | None = None, num_fewshot: int | None = None,
             limit: float | None = None, batch_size: int = 8, device: str = "cpu", allow_hub: bool = False,
             log_samples: bool = False) -> dict:
    """lm-eval's `simple_evaluate` with our model; returns its results dict."""
    _require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import simple_parse_args_string

    if include_path is not None and not Path(include_path).exists():
        raise UserError(f"--include_path {include_path}: no such folder or file")
    # lm-eval's own ~10,000 task files take seconds to index: only when a task is not in --include_path
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.task_index and not Path(t).is_file() for t in tasks):
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.task_index and not Path(t).is_file()]
    if unknown:
        raise UserError(f"--tasks: unknown task {unknown[0]!r} — name a task of lm-eval or of a file under "
                        f"--include_path (a YAML task config)")
    if not allow_hub:
        hub = hub_tasks(manager, tasks)
        if hub:
            name, path = hub[0]
            raise UserError(f"--tasks {name}: reads its data from the Hugging Face Hub (dataset_path: {path}) — "
                            f"minitrain evaluates offline: write a local task file (dataset_path: json, "
                            f"dataset_kwargs: {{data_files: ...}}) and pass --include_path, or --allow_hub")
    args = simple_parse_args_string(model_args)
    if "pretrained" not in args:
        raise UserError("--model_args: no pretrained= — e.g. --model_args pretrained=path/to/model,adapter=run/adapter")
    cls = register()
    lm = cls(**{"batch_size": batch_size, "device": device, **args})
    return simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                           log_samples=log_samples, batch_size=batch_size)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="minitrain evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="minitrain", help="minitrain (the only model class this script runs)")
    p.add_argument("--model_args", required=True, help="pretrained=DIR[,adapter=DIR,quantize=,dtype=,device=]")
    p.add_argument("--tasks", required=True, help="comma-separated task names (or YAML task files)")
    p.add_argument("--include_path", default=None, help="a folder of local task YAML files")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="examples per task (a fraction below 1)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--output_path", default=None, help="write the results JSON here")
    p.add_argument("--log_samples", action="store_true", help="keep per-example outputs in the results")
    p.add_argument("--allow_hub", action="store_true", help="let lm-eval download tasks' data from the Hub")
    args = p.parse_args(argv)
    try:
        if args.model != "minitrain":
            raise UserError(f"--model {args.model}: this script runs minitrain's model class — use lm_eval itself "
                            f"for --model {args.model}")
        results = evaluate(args.model_args, [t for t in args.tasks.split(",") if t], include_path=args.include_path,
                           num_fewshot=args.num_fewshot, limit=args.limit, batch_size=args.batch_size,
                           device=args.device, allow_hub=args.allow_hub, log_samples=args.log_samples)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output_path:
        Path(args.output_path).write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
        print(f"results: {args.output_path}")
    return 0

