"""What only a GPU can show (skipped without CUDA; `tools/gpu_check.py` runs this file first).

- bf16 autocast on CUDA: the LoRA SFT loss and adapter gradients close to fp32's;
- per-block `torch.compile` with non-reentrant checkpointing gives eager's gradients;
- a ternary base (minitrain.adapters.ternary) with LRC adapters: CUDA equals CPU, compiled equals eager;
- packed rows through FlexAttention (`attention=flex`) under per-block torch.compile: the SFT loss and
  adapter gradients equal the padded batch's (GQA, a sliding window shorter than the sequences);
- nf4 / int8 QLoRA on CUDA: logits and adapter gradients equal peft + bitsandbytes (transformers'
  `BitsAndBytesConfig` loading of the same checkpoint) with the same adapter values;
- FSDP2 on one GPU (torchrun, NCCL) over an nf4 base trains the adapter the plain QLoRA run trains;
- with flash-linear-attention installed (the `kernels` extra), its kernels on Qwen3.5's DeltaNet layers give the
  torch path's logits and gradients on padded and packed rows.
"""

from __future__ import annotations

import pytest
import torch

import models
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.objectives.sft import sft
from minitrain.train import compile_blocks, enable_checkpointing
from minitrain.weights import load_pretrained

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _batch(device, vocab=128, b=2, t=24):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[:, :8] = -100
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    labels[1, -5:] = -100
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def _policy(folder, device, **kw):
    model = load_pretrained(folder, models.from_hf_config, device=device, **kw)
    cfg = LoRAConfig(r=4, alpha=8, targets=TARGETS)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.train()


def _grads(model, batch, amp=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
        loss, n, _ = sft(model, batch)
    (loss / n).backward()
    return (loss / n).detach().float(), {k: p.grad.float().clone() for k, p in model.named_parameters()
                                         if p.requires_grad}


def test_bf16_autocast_close_to_fp32(hf_causal):
    model = _policy(hf_causal("cuda_llama"), "cuda")
    batch = _batch("cuda")
    l32, g32 = _grads(model, batch)
    l16, g16 = _grads(model, batch, torch.bfloat16)
    assert abs(float(l16 - l32)) < 2e-2 * abs(float(l32))
    for k in g32:
        cos = torch.nn.functional.cosine_similarity(g16[k].flatten(), g32[k].flatten(), dim=0)
        assert cos > 0.99, k


def test_compiled_checkpointed_blocks_give_eager_gradients(hf_causal):
    folder = hf_causal("cuda_llama")
    batch = _batch("cuda")
    eager = _policy(folder, "cuda")
    l0, g0 = _grads(eager, batch)
    model = _policy(folder, "cuda")
    enable_checkpointing(model)
    compile_blocks(model)
    for _ in range(2):  # the second call runs the compiled graphs already built
        l1, g1 = _grads(model, batch)
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-4)



def test_packed_rows_through_compiled_flex_attention_equal_the_padded_batch(hf_causal):
    """FlexAttention's forward and backward (only CUDA has the backward) under per-block torch.compile,
    with checkpointing: a packed batch's loss sum, count and adapter gradients equal the padded batch's,
    eager SDPA (each sequence alone in its row). fp32; GQA and a window of 4 in sequences up to 11."""
    from minitrain.data.collate import collate_causal
    from minitrain.data.packing import collate_packed_causal
    from minitrain.device import resolve_attention

    folder = hf_causal("cuda_mistral_window", model_type="mistral", num_key_value_heads=2, sliding_window=4)
    g = torch.Generator().manual_seed(0)
    examples = []
    for n in (5, 11, 3, 8, 7, 2):
        ids = torch.randint(3, 128, (n,), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})
    padded = {k: v.to("cuda") for k, v in collate_causal(examples, pad_id=0).items()}
    packed = {k: v.to("cuda") if torch.is_tensor(v) else v
              for k, v in collate_packed_causal(examples, pad_id=0, max_len=16).items()}
    assert packed["input_ids"].numel() < padded["input_ids"].numel()

    reference = _policy(folder, "cuda")
    l0, g0 = _grads(reference, padded)
    model = _policy(folder, "cuda")
    model.packed_attention = resolve_attention("auto", model, torch.device("cuda"), compiled=True)
    assert model.packed_attention == "flex"
    enable_checkpointing(model)
    compile_blocks(model)
    for _ in range(2):  # the second call runs the compiled graphs already built
        l1, g1 = _grads(model, packed)
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-4)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-3)
    model.packed_attention = "sdpa"  # the dense mask, same compiled blocks: the same values
    l2, g2 = _grads(model, packed)
    torch.testing.assert_close(l2, l0, atol=1e-5, rtol=1e-4)
    # bf16 autocast over the fp32 residual stream (q / k rotated in fp32, v in bf16): flex gets one
    # dtype, and the loss and gradients stay close to fp32's, as in test_bf16_autocast_close_to_fp32
    model.packed_attention = "flex"
    for _ in range(2):
        l3, g3 = _grads(model, packed, torch.bfloat16)
    assert abs(float(l3 - l0)) < 2e-2 * abs(float(l0))
    for k in g0:
        assert torch.nn.functional.cosine_similarity(g3[k].flatten(), g0[k].flatten(), dim=0) > 0.99, k


def test_ternary_lrc_on_cuda_equals_cpu_and_compiles(hf_causal):
    """Field report 004's setup on CUDA: a Qwen3 with a ternary base and BitLinear's 8-bit activations,
    LRC adapters, checkpointed and compiled blocks. fp32: the CUDA loss and gradients equal the CPU's;
    compiled + checkpointed give eager's; bf16 autocast stays close to fp32."""
    from minitrain.adapters.lrc import init_lrc
    from minitrain.adapters.quant import quantize_hook

    folder = hf_causal("cuda_qwen3", model_type="qwen3", num_key_value_heads=2, head_dim=16)

    def build(device):
        model = load_pretrained(folder, models.from_hf_config, device=device,
                                tensor_hook=quantize_hook("ternary", torch.float32, act_bits=8))
        cfg = LoRAConfig(r=4, alpha=8, targets=TARGETS)
        apply_lora(model, cfg)
        freeze_for_adapters(model, cfg)
        init_lrc(model, folder)
        return model.train()

    batch = _batch("cuda")
    cpu = build("cpu")
    cpu.zero_grad(set_to_none=True)
    loss, n, _ = sft(cpu, {k: v.cpu() for k, v in batch.items()})
    (loss / n).backward()
    l_cpu, g_cpu = (loss / n).detach(), {k: p.grad.clone() for k, p in cpu.named_parameters() if p.requires_grad}
    eager = build("cuda")
    l0, g0 = _grads(eager, batch)
    torch.testing.assert_close(l0.cpu(), l_cpu, atol=1e-4, rtol=1e-4)
    for k in g0:
        torch.testing.assert_close(g0[k].cpu(), g_cpu[k], atol=1e-4, rtol=1e-3)
    model = build("cuda")
    enable_checkpointing(model)
    compile_blocks(model)
    for _ in range(2):  # the second call runs the compiled graphs already built
        l1, g1 = _grads(model, batch)
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-4)
    lb, gb = _grads(model, batch, torch.bfloat16)
    assert abs(lb - l0) / l0 < 0.02
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in gb.values()]),
                                                torch.cat([g.flatten() for g in g0.values()]), dim=0)
    assert cos > 0.98, cos


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_matches_peft_and_bitsandbytes(hf_causal, kind):
    bnb = pytest.importorskip("bitsandbytes")  # noqa: F841
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from minitrain.adapters.quant import quantize_hook
    from minitrain.objectives.losses import shift_labels

    folder = hf_causal("cuda_llama")
    cd = torch.float32
    ours = _policy(folder, "cuda", tensor_hook=quantize_hook(kind, compute_dtype=cd))
    q = (transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=cd,
                                         bnb_4bit_use_double_quant=True) if kind == "nf4"
         else transformers.BitsAndBytesConfig(load_in_8bit=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=cd, device_map="cuda")
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_" in n:
                p.copy_(mine[n.replace("base_model.model.", "").replace(".default", "")])
    hf.train()
    batch = _batch("cuda")
    l_ours, g_ours = _grads(ours, batch)
    hf.zero_grad(set_to_none=True)
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    y = shift_labels(batch["labels"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    loss.backward()
    torch.testing.assert_close(l_ours, loss.detach(), atol=1e-4, rtol=1e-4)
    for n, p in hf.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(g_ours[n.replace("base_model.model.", "").replace(".default", "")],
                                       p.grad.float(), atol=1e-4, rtol=1e-3)


def test_one_gpu_fsdp_qlora_equals_plain_qlora(tiny_model, tmp_path):
    """FSDP2 on one GPU (torchrun, one process, NCCL) over an nf4 base trains the same adapter as the
    plain QLoRA run: the sharded load, the quantized blocks under fully_shard and the reduce on CUDA."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file
    from test_distributed import REPO, cli_args, max_abs_diff

    def args(out, *extra):  # the CPU tests' run, on the GPU
        return [a if a != "device=cpu" else "device=cuda" for a in cli_args(tiny_model, out, "quantize=nf4", "lr=1e-2", *extra)]

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    plain = [sys.executable, "-m", "minitrain", *args(tmp_path / "plain")]
    fsdp = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "minitrain",
            *args(tmp_path / "fsdp", "parallel=fsdp")]
    for cmd in (plain, fsdp):
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    want, got = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("plain", "fsdp"))
    assert max_abs_diff(got, want) <= 1e-5
    assert max(float(t.abs().max()) for k, t in got.items() if "lora_B" in k) > 1e-3  # it trained


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_flex_attention_head_dims_forward_and_backward(head_dim):
    """Whether FlexAttention (compiled, as the engine runs it) takes a head dim, bf16, and gives SDPA's
    output and input gradients with the dense mask of the same packed rows (two documents, GQA,
    a window of 48). Head dim 96 is Phi-3's, 256 Gemma's."""
    from models.layers import Documents, document_mask

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T = 2, 4, 2, 256
    doc = torch.cat([torch.zeros(B, 100, dtype=torch.long), torch.ones(B, T - 100, dtype=torch.long)], 1).cuda()
    pos = torch.cat([torch.arange(100), torch.arange(T - 100)]).expand(B, T).cuda()
    q, k, v = (torch.randn(B, h, T, head_dim, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for h in (H, Hkv, Hkv))
    docs = Documents.build(doc, pos, 48)
    attend = torch.compile(lambda q, k, v: docs.attend(q, k, v))
    out = attend(q, k, v)
    out.float().square().sum().backward()
    flex = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mask = document_mask(doc, pos, 48)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref.float().square().sum().backward()
    for a, b in zip(flex, [ref.detach().float()] + [t.grad.float() for t in (q, k, v)]):
        assert (a - b).norm() / b.norm() < 2e-2, head_dim


@pytest.mark.skipif(not __import__("minitrain.kernels", fromlist=["x"]).fla_installed(),
                    reason="needs flash-linear-attention (the kernels extra)")
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_fla_kernels_equal_torch_path(hf_causal, amp):
    """fla's chunked kernels on Qwen3.5's Gated DeltaNet layers (`minitrain.kernels`, kernels=auto on CUDA) give
    the torch path's logits and gradients on a left-padded batch over several chunks and on a packed row of
    three documents: each sequence restarts the scan and the convolution where the torch path does. fp32:
    within 2e-3 of the largest value (Triton's dots in tf32), bf16 autocast: 3e-2 (the kernels scan in bf16
    inputs, the torch path in fp32). Head dims of 32: fla's kernels want at least 16."""
    from minitrain.kernels import FlaDeltaNet, attach
    from test_qwen3_5 import QWEN35

    folder = hf_causal("qwen3_5_fla", **{**QWEN35, "hidden_size": 128, "linear_key_head_dim": 32,
                                         "linear_value_head_dim": 32, "head_dim": 32})
    model = load_pretrained(folder, models.from_hf_config, device="cuda").requires_grad_(True).train()
    g = torch.Generator().manual_seed(0)
    padded = torch.randint(3, 128, (2, 200), generator=g), torch.ones(2, 200, dtype=torch.long)
    padded[1][1, :57] = 0
    lengths = [70, 101, 25]
    packed = dict(document_ids=torch.cat([torch.full((1, n), i + 1) for i, n in enumerate(lengths)], 1),
                  position_ids=torch.cat([torch.arange(n)[None] for n in lengths], 1))
    cases = [((padded[0], padded[1]), {}), ((torch.randint(3, 128, (1, sum(lengths)), generator=g), None), packed)]
    tol = 2e-3 if amp is None else 3e-2

    def run(args, kw):
        model.zero_grad(set_to_none=True)
        args = [a.cuda() if a is not None else None for a in args]
        with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
            out = model(*args, **{k: v.cuda() for k, v in kw.items()}).float()
        (out * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        return out.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    for args, kw in cases:
        attach(model, None)
        ref, ref_grads = run(args, kw)
        attach(model, FlaDeltaNet())
        out, grads = run(args, kw)
        real = args[1].cuda().bool() if args[1] is not None else torch.ones_like(ref[..., 0], dtype=torch.bool)
        assert float((out[real] - ref[real]).abs().max() / ref[real].abs().max()) <= tol
        for name, grad in grads.items():
            assert float((grad - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp(min=1e-12)) <= tol, name
