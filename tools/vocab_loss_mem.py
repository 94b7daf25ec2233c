"""Peak memory of the causal-LM loss at large vocabularies: minitrain's chunked loss against
transformers' (full logits, then `ForCausalLMLoss`).

    python tools/vocab_loss_mem.py [--tokens 512] [--cases qwen,gemma2,gemma3]

Cases (vocabulary, hidden size, final-logit cap): `qwen` 151,936 x 1024 (Qwen3-0.6B), `gemma2`
256,000 x 2304 with Gemma 2's cap of 30 (Gemma 2 2B), `gemma3` 262,144 x 1152 (Gemma 3 1B). One row
of `--tokens` tokens, every position a target (the worst case), fp32, the head frozen (as under
LoRA) and the final hidden states requiring a gradient (as in training). Each side runs in a
fresh interpreter: after building the head and the hidden states it resets the kernel's RSS
high-water mark (VmHWM), runs the loss forward + backward, and reports

- peak RSS during the loss - RSS just before it;
- peak bytes allocated (minitrain.plan.measure.measure_peak_allocated: torch.profiler's memory events),
  which does not depend on the allocator's habits or the machine's load.

transformers' side is what its causal-LM models do: `logits = lm_head(hidden)` (Gemma 2:
`tanh(logits / cap) * cap`), then `ForCausalLMLoss` (logits upcast to fp32, cross-entropy).
minitrain's is `chunked_cross_entropy_sum` over the model's `output_projection` (Gemma 2's is a
`SoftcappedLinear`). Not a test: about a minute per case on one CPU core, ~3 GB for 256k.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {"qwen": (151936, 1024, None), "gemma2": (256000, 2304, 30.0), "gemma3": (262144, 1152, None)}


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(side: str, case: str, tokens: int) -> dict:
    """One side's loss forward + backward; the figures as a dict (run in a fresh interpreter)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from minitrain.objectives.losses import chunked_cross_entropy_sum, shift_labels
    from minitrain.plan.measure import measure_peak_allocated
    from models.layers import SoftcappedLinear

    torch.manual_seed(0)
    V, D, cap = CASES[case]
    head = SoftcappedLinear(D, V, cap) if cap else torch.nn.Linear(D, V, bias=False)
    head.requires_grad_(False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02)
    hidden = torch.empty(1, tokens, D).normal_().requires_grad_(True)
    labels = torch.randint(0, V, (1, tokens))

    if side == "minitrain":
        def step():
            loss, _ = chunked_cross_entropy_sum(hidden, head, shift_labels(labels))
            loss.backward()
    else:
        from transformers.loss.loss_utils import ForCausalLMLoss

        def step():
            logits = torch.nn.functional.linear(hidden, head.weight)  # the model's lm_head
            if cap:
                logits = torch.tanh(logits / cap) * cap  # Gemma2ForCausalLM.forward
            ForCausalLMLoss(logits, labels, V, num_items_in_batch=torch.tensor(tokens - 1)).backward()

    step()  # warm-up: kernels and the allocator's first blocks
    hidden.grad = None
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
    before = rss("VmRSS:")
    step()
    peak_rss = rss("VmHWM:") - before
    hidden.grad = None
    allocated, _ = measure_peak_allocated(step)
    return {"side": side, "case": case, "vocab": V, "hidden": D, "cap": cap, "tokens": tokens,
            "peak_rss_mib": peak_rss / 2**20, "peak_allocated_mib": allocated / 2**20}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--child", nargs=3, metavar=("SIDE", "CASE", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    print("| case | vocab x hidden | tokens | transformers: peak RSS / allocated | minitrain: peak RSS / allocated |")
    print("|---|---|---|---|---|")
    for case in args.cases.split(","):
        got = {}
        for side in ("transformers", "minitrain"):
            out = subprocess.run([sys.executable, __file__, "--child", side, case, str(args.tokens)],
                                 capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            got[side] = json.loads(out.stdout.strip().splitlines()[-1])
        V, D, cap = CASES[case]
        cells = [f"{got[s]['peak_rss_mib']:,.0f} / {got[s]['peak_allocated_mib']:,.0f} MiB" for s in got]
        print(f"| {case}{f' (cap {cap:g})' if cap else ''} | {V:,} x {D:,} | {args.tokens} | {cells[0]} | {cells[1]} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
