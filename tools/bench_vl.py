"""LoRA SFT on image rows: minitrain against TRL 1.x's SFTTrainer (its vision-language path), one thread.

    python tools/bench_vl.py [--repeats 3] [--steps 10] [--batch 4] [--accum 1] [--side 224]
                             [--layers 4] [--dim 256] [--vision-depth 4] [--vision-dim 128] [--vocab 32000]
    python tools/bench_vl.py --device cuda --shape qwen2_5_vl_7b --layers 4 --vision-depth 32 [--out r.json]

`--device cuda` (what `tools/gpu_check.py --parts vl` runs): the same two sides on the GPU in bf16 (minitrain's
`precision=bf16`, TRL's `bf16=True`, the weights saved in bf16), measured in images per second over steps 2..N
and the CUDA allocator's peak; `--shape qwen2_5_vl_7b` gives Qwen2.5-VL-7B's widths (language model 3584 wide,
MLP 18944, 28 heads / 4 KV heads, vocab 152064, untied head; tower 1280 wide, 16 heads, MLP 3420, out 3584, full
attention in blocks 7, 15, 23, 31), `--layers` / `--vision-depth` of its layers and blocks. `--out` writes the
medians as JSON.

Both sides train the same checkpoint on the same rows: a Qwen2.5-VL shape with random weights saved by
transformers (default: a 4-layer, 256-wide language model with a 32000-id vocabulary, a 4-block, 128-wide
tower with patches of 14 pixels, windows of 112 and full attention in blocks 1 and 3), the tokenizer of
demo/vl_colours (Qwen's special tokens), one `--side` x `--side` JPEG per row (224: 16 x 16 patches, 64
image tokens) and an answer of 4 to 40 words, exactly one epoch of the run; made once into `--cache`.
The same on both: fp32 on CPU, batch, accumulation, steps, LoRA r=16 / alpha 32 / dropout 0 on the language
model's q, k, v, o, gate, up, down (the tower frozen), the loss on the assistant turn only (a ChatML
template with `{% generation %}` markers: minitrain's `chat_template=`, TRL's `assistant_only_loss`),
AdamW at a constant 1e-4, no warmup, clipping at 1, no eval, no checkpoint during the run, no length grouping,
no gradient checkpointing, one thread (OMP_NUM_THREADS=1). Each side decodes each batch's images when it
collates it (minitrain: `collate_images`, the next micro-batch's in its one background thread while one trains,
`minitrain/data/prefetch.py`; TRL: its collator, from the paths, in the training thread: dataloader_num_workers=0).

Measured per run (each a fresh subprocess, `tools/bench.py`'s `timed_run`): images per CPU-second of the
child over steps 2..N (step 1 excluded: warm-up), peak RSS, and the share of those steps' CPU time spent
decoding and processing images (minitrain: `minitrain.data.images.load_image`, in whichever thread calls it;
TRL: its image processor with the file reads): the run's process is started by this file (`--worker`), which times that function
and then runs the side as usual (`minitrain.cli.run_cli` of recipes/sft.py; `trl.SFTTrainer`). Runs
interleaved mt, hf, hf, mt, ...; medians. For minitrain also the share of the steps' wall time the loop
waited for its batches (metrics.jsonl's `data_wait`, steps 2..N weighted by their time): what decoding ahead
left of the decoding share. Prints one Markdown row; figures belong in BENCHMARKS.md only from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench import timed_run  # noqa: E402

# ChatML whose contents may be strings or parts (TRL's); the assistant's text and <|im_end|> are the targets
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}{%- else %}"
    "{%- set ns = namespace(text='') %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{%- set ns.text = ns.text + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{%- elif part['type'] == 'text' %}{%- set ns.text = ns.text + part['text'] %}{%- endif %}{%- endfor %}"
    "{%- set text = ns.text %}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- text + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- text + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LM_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_TARGETS = r".*language_model.*\.(" + "|".join(LM_TARGETS) + ")"  # peft: the language model's, not the tower's
LR = 1e-4


def processor(model_dir, chat_template: str = TEMPLATE):
    """transformers' Qwen2.5-VL processor without its video processor (which needs torchvision; no video is
    read): the image processor and tokenizer of `model_dir`."""
    import transformers

    class ImagesOnly(transformers.Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    return ImagesOnly(image_processor=transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir),
                      tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir), video_processor=None,
                      chat_template=chat_template)


# ----------------------------------------------------------------------------- the checkpoint and rows (cached)


def prepare(a: argparse.Namespace) -> Path:
    """The cache folder: model/ (config, weights, tokenizer, preprocessor config), rows.jsonl, images/,
    template.jinja; made once per shape."""
    key = "-".join(str(getattr(a, k)) for k in ("steps", "batch", "accum", "side", "layers", "dim", "vision_depth",
                                               "vision_dim", "vocab", "seed", "shape"))
    root = Path(a.cache) / f"vl-{key}"
    if (root / "rows.jsonl").is_file():
        return root
    import numpy as np
    import torch
    import transformers
    from PIL import Image

    from make_vl_demo import COLOURS, QUESTION, make_tokenizer

    model = root / "model"
    make_tokenizer(model)
    (model / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
         "min_pixels": 56 * 56, "max_pixels": a.side * a.side}))
    ids = {t["content"]: t["id"] for t in json.loads((model / "tokenizer.json").read_text())["added_tokens"]}
    hd = a.dim // 4
    text = dict(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.dim * 11 // 4, num_hidden_layers=a.layers,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [hd // 8, hd * 3 // 16, hd // 2 - hd // 8 - hd * 3 // 16]})
    vision = dict(depth=a.vision_depth, hidden_size=a.vision_dim, intermediate_size=a.vision_dim * 2, num_heads=4,
                  out_hidden_size=a.dim, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=list(range(1, a.vision_depth, 2)))
    if a.shape == "qwen2_5_vl_7b":  # Qwen2.5-VL-7B's widths, `--layers` / `--vision-depth` of them
        text.update(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                    num_key_value_heads=4, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
        vision.update(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < a.vision_depth])
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                                        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(a.seed)
    built = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    (built.to(torch.bfloat16) if a.shape != "small" else built).save_pretrained(model)
    rng, np_rng = random.Random(a.seed), np.random.default_rng(a.seed)
    (root / "images").mkdir()
    rows = []
    for i in range(a.steps * a.batch * a.accum):  # one epoch of the run
        coarse = np_rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # a smooth picture (JPEG-like content)
        Image.fromarray(coarse).resize((a.side, a.side), Image.BICUBIC).save(root / "images" / f"{i:04d}.jpg",
                                                                              quality=90)
        answer = " ".join(rng.choice(list(COLOURS)) for _ in range(rng.randint(4, 40)))
        rows.append({"images": [str(root / "images" / f"{i:04d}.jpg")],
                     "messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}]})
    (root / "template.jinja").write_text(TEMPLATE)
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


# ----------------------------------------------------------------------------- the two sides (in their own process)


class DecodeClock:
    """Times the calls of the functions it wraps (`wrap`), nested calls once: each outermost call's (CPU
    seconds of the process when it ended, the CPU seconds of its thread). minitrain decodes in a background
    thread while the training thread computes, so the call's own thread's clock, not the process's."""

    def __init__(self):
        self.calls: list[tuple[float, float]] = []  # (list.append: atomic under the GIL)
        self.local = threading.local()  # the nesting depth of each thread

    def wrap(self, fn):
        def timed(*args, **kwargs):
            depth = getattr(self.local, "depth", 0)
            self.local.depth = depth + 1
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.local.depth = depth
                if not depth:
                    self.calls.append((time.process_time(), time.thread_time() - t))
        return timed


def mt_worker(spec: dict) -> int:
    """minitrain's run (`recipes/sft.py` through `run_cli`), its image decoding timed."""
    import minitrain.data.images as images
    from minitrain.cli import run_cli

    clock = DecodeClock()
    images.load_image = clock.wrap(images.load_image)  # `collate_images` reads it from the module
    root = Path(spec["root"])
    code = run_cli([str(ROOT / "recipes" / "sft.py"), f"model={root / 'model'}", f"data={root / 'rows.jsonl'}",
                    f"out={spec['out']}", f"chat_template={root / 'template.jinja'}",
                    f"max_steps={spec['steps']}", f"batch_size={spec['batch']}", f"grad_accum={spec['accum']}",
                    f"lr={LR}", "warmup=0", "schedule=constant", "weight_decay=0", "max_grad_norm=1.0", "lora_r=16",
                    "lora_alpha=32", "lora_dropout=0", f"lora_targets={','.join(LM_TARGETS)}", "group_by_length=false",
                    *(["device=cpu", "precision=fp32", "threads=1"] if spec["device"] == "cpu" else
                      ["device=cuda", "precision=bf16"]),
                    "max_len=4096", "data_cache=false", "save_every=0", "overwrite=true", f"seed={spec['seed']}"])
    Path(spec["out"], "decode.json").write_text(json.dumps(clock.calls))
    return code


def hf_worker(spec: dict) -> int:
    """TRL's SFTTrainer + peft on the same rows, its image processing (file reads included) timed."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    root, out = Path(spec["root"]), Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    clock = open(out / "steps.jsonl", "w", buffering=1)

    cuda = spec["device"] == "cuda"

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            peak = {"peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20} if cuda else {}
            clock.write(json.dumps({"step": state.global_step, **peak}) + "\n")

    proc = processor(root / "model")
    timer = DecodeClock()
    for name in ("fetch_images", "preprocess"):  # reading the files (paths in the rows), then processing them
        setattr(proc.image_processor, name, timer.wrap(getattr(proc.image_processor, name)))
    rows = [json.loads(line) for line in (root / "rows.jsonl").read_text().splitlines()]
    data = datasets.Dataset.from_list(rows)  # images as paths: read when a batch is collated
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        root / "model", dtype=torch.bfloat16 if cuda else torch.float32)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PEFT_TARGETS)
    args = trl.SFTConfig(
        output_dir=str(out / "trainer"), report_to=[], use_cpu=not cuda, bf16=cuda, max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=spec["accum"], learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        assistant_only_loss=True, max_length=None, gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", eval_strategy="no", seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=proc, peft_config=lora,
                             callbacks=[StepClock()])
    trainer.train()
    clock.close()
    (out / "decode.json").write_text(json.dumps(timer.calls))
    return 0


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.pop("CUDA_VISIBLE_DEVICES", None)
    return e


def run(side: str, a: argparse.Namespace, root: Path, rep: int) -> dict:
    """One run of `side` ("mt" or "hf") in a fresh process: images per CPU-second over steps 2..N, peak RSS,
    the decoding share of those steps' CPU time."""
    work = Path(a.cache) / f"{side}-{rep}"
    out = work / "out"
    spec = {"side": side, "root": str(root), "out": str(out), "steps": a.steps, "batch": a.batch, "accum": a.accum,
            "seed": a.seed, "device": a.device}
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    steps = out / ("metrics.jsonl" if side == "mt" else "steps.jsonl")
    r = timed_run([sys.executable, str(Path(__file__).resolve()), "--worker", str(work / "spec.json")], steps,
                  work / "log.txt", env())
    if r["rc"] != 0 or len(r["rows"]) < 2:
        raise SystemExit(f"{side} run {rep} failed (exit {r['rc']}); see {work / 'log.txt'}:\n"
                         + (work / "log.txt").read_text()[-3000:])
    per_step = a.batch * a.accum  # one image a row
    cpu = r["cpu"][-1] - r["cpu"][0]
    # the decoding done in steps 2..N: calls that ended between the child's CPU clock at step 1's line and at
    # the last (the same clock: the process's user + system seconds)
    late = sum(d for end, d in json.loads((out / "decode.json").read_text()) if r["cpu"][0] < end <= r["cpu"][-1])
    per_cpu = (lambda x: x / cpu) if cpu > 0 else (lambda x: float("nan"))  # a tiny run: steps within one tick
    s = {"side": side, "images_per_cpu_s": per_cpu(per_step * (len(r["rows"]) - 1)), "peak_rss_mb": r["peak_rss_mb"],
         "decode_share": per_cpu(late)}
    if a.device == "cuda":  # the GPU's figures: images per second of wall time, the allocator's peak
        wall = r["times"][-1] - r["times"][0]
        s["images_per_s"] = per_step * (len(r["rows"]) - 1) / wall if wall > 0 else float("nan")
        s["peak_mem_mb"] = max(row.get("peak_mem_mb", 0.0) for row in r["rows"])
    waited = ""
    if side == "mt":  # the loop's wait for its batches over steps 2..N: each step's data_wait share x its seconds
        later = r["rows"][1:]
        dts = [row["tokens"] / row["tokens_per_s"] for row in later]
        s["wait_share"] = sum(row["data_wait"] * dt for row, dt in zip(later, dts)) / sum(dts)
        waited = f", waiting for batches {s['wait_share']:.2%} of the steps' time"
    print(f"  {side} run {rep}: {s['images_per_cpu_s']:.1f} images/CPU-s, peak RSS {s['peak_rss_mb']:.0f} MiB, "
          f"image decoding {s['decode_share']:.1%} of the steps' CPU time{waited}", flush=True)
    return s


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--side", type=int, default=224, help="image side in pixels")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vision-depth", type=int, default=4)
    ap.add_argument("--vision-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default="/tmp/minitrain_bench_vl")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", choices=("small", "qwen2_5_vl_7b"), default="small",
                    help="small: --dim / --vision-dim / --vocab; qwen2_5_vl_7b: Qwen2.5-VL-7B's widths")
    ap.add_argument("--out", help="write the medians (both sides) here as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        spec = json.loads(Path(a.worker).read_text())
        return (mt_worker if spec["side"] == "mt" else hf_worker)(spec)
    root = prepare(a)
    results: dict[str, list[dict]] = {"mt": [], "hf": []}
    order = [s for i in range(a.repeats) for s in (("mt", "hf") if i % 2 == 0 else ("hf", "mt"))]
    for i, side in enumerate(order):
        results[side].append(run(side, a, root, i))
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "side"} for side, rs in results.items()}
    if a.out:
        Path(a.out).write_text(json.dumps(med))
    ratio = med["mt"]["images_per_cpu_s"] / med["hf"]["images_per_cpu_s"]
    print(f"| LoRA SFT on image rows (Qwen2.5-VL shape: {a.layers} x {a.dim} language model, {a.vision_depth} x "
          f"{a.vision_dim} tower; {a.side} px images, batch {a.batch} x accum {a.accum}, {a.steps} steps, 1 thread, "
          f"medians of {a.repeats}) | {med['mt']['images_per_cpu_s']:.2f} | {med['hf']['images_per_cpu_s']:.2f} | "
          f"**{ratio:.2f}x** | {med['mt']['peak_rss_mb']:.0f} / {med['hf']['peak_rss_mb']:.0f} MiB | "
          f"{med['mt']['decode_share']:.1%} / {med['hf']['decode_share']:.1%} | {med['mt']['wait_share']:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
