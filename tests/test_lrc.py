"""minitrain.adapters.lrc: LoftQ-style low-rank correction of a quantized base, and recipes/lrc_llama.py.

References: the best rank-r approximation of E is E V_r V_r^T with V_r the top eigenvectors of
E^T E (Eckart & Young 1936), computed here with `torch.linalg.eigh`, not an SVD; its residual is
sqrt(sum of the dropped squared singular values). W comes from the transformers model's own
state dict, not from our reader. The loss gap is measured as the expected next-token loss under
the full-precision model's own predictions, so gap = KL(p_fp || p_model) >= 0, which shrinks
towards 0 as the model approaches the full-precision one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tok import corpus, make_bpe_tokenizer

from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.adapters.lrc import init_lrc, lrc_factors
from minitrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]
bnb = pytest.importorskip("bitsandbytes")


def best_rank_r(E: torch.Tensor, r: int) -> torch.Tensor:
    """E projected on its top-r right singular vectors, from an eigendecomposition of E^T E (float64)."""
    E = E.double()
    evals, evecs = torch.linalg.eigh(E.T @ E)  # ascending
    V = evecs[:, -r:]
    return E @ V @ V.T


@pytest.mark.parametrize("shape,r,scaling", [((24, 16), 4, 2.0), ((16, 40), 7, 0.5)])
def test_factors_are_the_truncated_svd_split_evenly(shape, r, scaling):
    g = torch.Generator().manual_seed(0)
    E = torch.randn(*shape, generator=g, dtype=torch.float64)
    A, B = lrc_factors(E, r, scaling)
    assert A.shape == (r, shape[1]) and B.shape == (shape[0], r) and A.dtype == torch.float32
    approx = scaling * (B.double() @ A.double())
    torch.testing.assert_close(approx, best_rank_r(E, r), rtol=1e-4, atol=1e-4)
    s = torch.linalg.svdvals(E)
    assert (E - approx).norm().item() == pytest.approx(s[r:].square().sum().sqrt().item(), rel=1e-4)
    # singular values split evenly: A A^T = B^T B = diag(S_r / scaling)
    torch.testing.assert_close((A @ A.T).double(), torch.diag(s[:r] / scaling), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close((B.T @ B).double(), torch.diag(s[:r] / scaling), rtol=1e-4, atol=1e-4)
    # each pair's sign is fixed (the largest |entry| of each B column positive), not left to the
    # SVD routine, so CPU and CUDA start from the same adapter (tests/test_cuda.py compares them)
    top = B.gather(0, B.abs().argmax(0, keepdim=True))
    assert (top > 0).all(), top


# ----------------------------------------------------------------------------- on a tiny LLaMA


@pytest.fixture(scope="module")
def folder(hf_causal) -> Path:
    # initializer_range 0.1: peaked next-token distributions, so quantization visibly moves them
    return hf_causal("lrc_llama", initializer_range=0.1)


def quantized(folder: Path, kind: str = "nf4", r: int = 16, targets="all-linear"):
    import models
    from minitrain.adapters.quant import quantize_hook
    from minitrain.weights import load_pretrained

    model = load_pretrained(folder, models.from_hf_config, tensor_hook=quantize_hook(kind, compute_dtype=torch.float32))
    cfg = LoRAConfig(r=r, alpha=2 * r, targets=targets)
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_each_adapter_is_the_best_rank_r_fit_of_its_quantization_error(folder, kind):
    model = quantized(folder, kind, r=6)
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A")}
    before = {n: m.dequantized_weight() for n, m in layers.items()}
    report = init_lrc(model, folder)
    assert {x.name for x in report} == set(layers)
    W = hf_weights(folder)
    for x in report:
        m = layers[x.name]
        E = W[f"{x.name}.weight"] - before[x.name]
        torch.testing.assert_close(m.delta_weight().double(), best_rank_r(E, 6), rtol=1e-3, atol=2e-5)
        assert torch.equal(m.dequantized_weight(), before[x.name])  # one step: the base is untouched
        assert x.error_before == pytest.approx((E.norm() / W[f"{x.name}.weight"].norm()).item(), rel=1e-4)
        assert 0 < x.error_after < x.error_before


def test_reads_only_the_needed_tensors_from_a_sharded_checkpoint(hf_causal, tmp_path, monkeypatch):
    import transformers

    import minitrain.adapters.lrc as lrc

    src = hf_causal("lrc_llama", initializer_range=0.1)
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    model = quantized(src, targets=["q_proj", "down_proj"])
    reads = []
    real = lrc.read_tensor
    monkeypatch.setattr(lrc, "read_tensor", lambda f, path, start, info: reads.append(info) or real(f, path, start, info))
    report = init_lrc(model, sharded)
    assert len(reads) == len(report) == 4  # 2 layers x (q_proj, down_proj); nothing else is read


def expected_losses(folder: Path, models_: dict[str, torch.nn.Module]) -> dict[str, float]:
    """Mean next-token loss of each model on the fp model's own predictions, H(p_fp, p_model)."""
    import models
    from minitrain.weights import load_pretrained

    fp = load_pretrained(folder, models.from_hf_config).eval()
    ids = torch.randint(4, 128, (6, 24), generator=torch.Generator().manual_seed(0))

    def logp(m):
        with torch.no_grad():
            return torch.log_softmax(m.output_projection(m(ids, None)), -1)

    lp = logp(fp)
    p = lp.exp()
    out = {"loss_fp": -(p * lp).sum(-1).mean().item()}
    for k, m in models_.items():
        out[k] = -(p * logp(m.eval())).sum(-1).mean().item()
    return out


def test_initial_loss_gap_to_full_precision_shrinks(folder):
    zero = quantized(folder)
    lrc1 = quantized(folder)
    init_lrc(lrc1, folder)
    lrc5 = quantized(folder)
    rep5 = init_lrc(lrc5, folder, iters=5)
    L = expected_losses(folder, {"loss_q_zero_init": zero, "loss_q_lrc_init": lrc1, "loss_q_loftq5": lrc5})
    gap0 = L["loss_q_zero_init"] - L["loss_fp"]
    gap1 = L["loss_q_lrc_init"] - L["loss_fp"]
    gap5 = L["loss_q_loftq5"] - L["loss_fp"]
    print({**L, "gap_ratio": gap1 / gap0, "gap_ratio_loftq5": gap5 / gap0})
    assert gap0 > 0 and 0 < gap1 < gap0 and gap5 < gap0
    # LoftQ iterations re-quantize the base: the base changed, and the weight error is lower still
    rep1 = init_lrc(quantized(folder), folder)
    assert sum(x.error_after for x in rep5) < sum(x.error_after for x in rep1)


def test_gradients_equal_with_and_without_nonreentrant_checkpointing(folder):
    from minitrain.train import enable_checkpointing

    model = quantized(folder, r=4, targets=["q_proj", "v_proj", "down_proj"])
    init_lrc(model, folder)
    model.train()
    assert not model.input_embeddings.weight.requires_grad
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def grads():
        model.zero_grad(set_to_none=True)
        h = model(ids, None)
        assert not model.input_embeddings(ids).requires_grad  # no input-requires-grad hack anywhere
        logits = model.output_projection(h[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1)).backward()
        params = dict(model.named_parameters())
        return {n: params[n].grad.clone() for n in names}

    plain = grads()
    assert enable_checkpointing(model) == 2
    ckpt = grads()
    for n in names:
        assert plain[n].abs().sum() > 0, n  # LRC-initialised: A and B both get gradients at step 0
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7)


def test_user_errors(folder, hf_causal, tmp_path):
    import models
    from minitrain.weights import load_pretrained

    fp = load_pretrained(folder, models.from_hf_config)
    apply_lora(fp, LoRAConfig(r=4, alpha=8, targets=["q_proj"]))
    with pytest.raises(UserError, match="no LoRA layer sits on a quantized base"):
        init_lrc(fp, folder)
    with pytest.raises(UserError, match="has a LoRA adapter of rank 16"):
        init_lrc(quantized(folder), folder, rank=8)
    with pytest.raises(UserError, match="iters=0"):
        init_lrc(quantized(folder), folder, iters=0)
    other = hf_causal("lrc_other", num_hidden_layers=1)
    with pytest.raises(UserError, match="has no model.layers.1"):
        init_lrc(quantized(folder), other)


# ----------------------------------------------------------------------------- the recipe


def test_recipe_smoke(folder, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    make_bpe_tokenizer(model)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(8, seed=5)))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = {"model": model, "data": data, "out": out, "max_steps": 2, "batch_size": 2, "lora_r": 4,
            "lora_alpha": 8, "checkpointing": "true", "device": "cpu"}
    p = subprocess.run([sys.executable, "-m", "minitrain", str(REPO / "recipes" / "lrc_llama.py"),
                        *[f"{k}={v}" for k, v in args.items()]], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "lrc: 14 adapters initialised to the rank-4 SVD" in p.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
