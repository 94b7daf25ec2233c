"""How much of a quantized base's next-token loss gap the low-rank-correction initialisation closes.

    python tools/lrc_gap.py                                   # the table in BENCHMARKS.md
    python tools/lrc_gap.py --models qwen3 --kinds ternary --ranks 4,16,full --calibration 4

For each model, base format (ternary, nf4) and adapter rank r (every linear but the head, "full" =
each layer's min(out, in)), the model is loaded quantized (fp32 compute), given LoRA adapters,
and its loss measured three ways: adapters at zero (plain QLoRA's start), adapters at the SVD of
the quantization error (`init_lrc`), and at the activation-weighted SVD (`init_lrc(calibrate=)`,
`--calibration` batches that are not the evaluation batches). Then

    gap(start)  = loss(quantized + adapters at start) - loss(full precision)
    closed      = 1 - gap(LRC) / gap(zero)                 (1.0: the full-precision loss again)

Models (all built here, nothing downloaded):
- `llama`, `qwen3`: tiny random models with a fixed seed (vocab 256, hidden 128, 4 layers, 4 heads,
  2 kv heads of 32, intermediate 352; weights N(0, 0.1^2), norms 1 + N(0, 0.1^2): peaked next-token
  distributions). No data means anything to them, so the loss is the cross-entropy against the
  full-precision model's own next-token distribution on random token ids, and the gap is
  KL(p_fp || p_quantized) >= 0 (tests/test_lrc.py measures it the same way).
- `demo`: the committed, briefly pre-trained tiny Mistral (`demo/model`, LLaMA blocks with a
  window, hidden 128, 4 layers), whose loss is the real next-token loss on the assistant tokens of
  `demo/sft_train.jsonl` (the last 64 rows; calibration: the first ones).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models  # noqa: E402
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters  # noqa: E402
from minitrain.adapters.lrc import init_lrc, lrc_ranks  # noqa: E402
from minitrain.adapters.quant import quantize_hook  # noqa: E402
from minitrain.data.collate import collate_causal  # noqa: E402
from minitrain.objectives.sft import sft  # noqa: E402
from minitrain.weights import load_pretrained, save_pretrained  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=256,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def random_model(folder: Path, model_type: str, seed: int = 0) -> Path:
    """Save a tiny random `model_type` checkpoint (fixed seed) built by our own model code."""
    config = {**TINY, "model_type": model_type}
    torch.manual_seed(seed)
    model = models.from_hf_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    return save_pretrained(model, folder, config)


def kl_loss(folder: Path, calibration: int) -> tuple[Callable[[torch.nn.Module], float], Callable]:
    """(loss, calibrate) for a random model: H(p_fp, p_model) on 8 x 64 random ids; calibration on
    `calibration` other batches of 4 x 64."""
    V = TINY["vocab_size"]
    ids = torch.randint(4, V, (8, 64), generator=torch.Generator().manual_seed(0))
    calib = torch.randint(4, V, (calibration, 4, 64), generator=torch.Generator().manual_seed(1))

    def logp(m):
        with torch.no_grad():
            return torch.log_softmax(m.output_projection(m(ids, None)).float(), -1)

    p_fp = logp(load_pretrained(folder, models.from_hf_config).eval()).exp()
    return (lambda m: -(p_fp * logp(m.eval())).sum(-1).mean().item()), (lambda m: [m(b, None) for b in calib])


def data_loss(folder: Path, data: Path, calibration: int) -> tuple[Callable, Callable]:
    """(loss, calibrate) for a trained model: the SFT loss on the last 64 rows of `data`, calibration on the first."""
    from minitrain.data.readers import read_sft
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    with contextlib.redirect_stdout(io.StringIO()):
        rows = list(read_sft(data, tok, max_len=256))
    evals = [collate_causal(rows[-64:][i:i + 16], pad_id=tok.pad_id) for i in range(0, 64, 16)]
    calib = [collate_causal(rows[i:i + 8], pad_id=tok.pad_id) for i in range(0, 8 * calibration, 8)]

    def loss(m):
        m.eval()
        with torch.no_grad():
            total = [sft(m, b) for b in evals]
        return (sum(t[0] for t in total) / sum(t[1] for t in total)).item()

    return loss, lambda m: [m(b["input_ids"], b["attention_mask"]) for b in calib]


def quantized(folder: Path, kind: str, rank: str) -> torch.nn.Module:
    """`folder` loaded with `kind` base linears and LoRA on every linear but the head, at `rank`."""
    model = load_pretrained(folder, models.from_hf_config, tensor_hook=quantize_hook(kind, torch.float32))
    r, pattern = lrc_ranks(model, "all-linear", 10**9 if rank == "full" else int(rank))
    cfg = LoRAConfig(r=r, alpha=r, targets="all-linear", rank_pattern=pattern)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model


def measure(name: str, folder: Path, loss, calibrate, kinds: list[str], ranks: list[str]) -> list[str]:
    """Markdown table rows for one model."""
    fp = loss(load_pretrained(folder, models.from_hf_config))
    rows = []
    for kind in kinds:
        zero = loss(quantized(folder, kind, ranks[0])) - fp  # B = 0: the rank does not matter
        for rank in ranks:
            m = quantized(folder, kind, rank)
            init_lrc(m, folder)
            plain = loss(m) - fp
            m = quantized(folder, kind, rank)
            init_lrc(m, folder, calibrate=calibrate)
            calibrated = loss(m) - fp
            rows.append(f"| {name} | {kind} | {rank} | {fp:.4f} | {zero:.4f} | {plain:.4f} | {1 - plain / zero:.1%} "
                        f"| {calibrated:.4f} | {1 - calibrated / zero:.1%} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama,qwen3,demo", help="llama, qwen3 (random, fixed seed), demo (trained)")
    ap.add_argument("--kinds", default="ternary,nf4", help="base formats (nf4 needs bitsandbytes)")
    ap.add_argument("--ranks", default="4,8,16,32,full", help="adapter ranks; full = min(out, in) per layer")
    ap.add_argument("--calibration", type=int, default=4, help="calibration batches for the activation-aware init")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kinds, ranks = args.kinds.split(","), args.ranks.split(",")
    print("| model | base | rank | loss fp | gap zero-init | gap LRC | closed | gap LRC calibrated | closed |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "demo":
                folder = ROOT / "demo" / "model"
                loss, calibrate = data_loss(folder, ROOT / "demo" / "sft_train.jsonl", args.calibration)
            else:
                folder = random_model(Path(tmp) / name, name)
                loss, calibrate = kl_loss(folder, args.calibration)
            measure(name, folder, loss, calibrate, kinds, ranks)


if __name__ == "__main__":
    main()
