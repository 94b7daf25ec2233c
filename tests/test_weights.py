"""minitrain.weights: loading HF-layout safetensors into a meta-built model, and saving them back.

References: `safetensors.torch.load_file` (what is in a file), `transformers` (who wrote / reads
HF checkpoints). The model here is a hand-written module with LLaMA's parameter names and shapes
(no forward), so these tests do not depend on models/; tests with models.from_hf_config are at
the end and skip until models/llama.py exists.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from minitrain.errors import UserError
from minitrain.weights import load_pretrained, save_pretrained, skip_init

CFG = dict(
    model_type="llama",
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


class Norm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, f = c["hidden_size"], c["intermediate_size"]
        hd = d // c["num_attention_heads"]
        kv = c["num_key_value_heads"] * hd
        self.self_attn = nn.Module()
        for n, (i, o) in dict(q_proj=(d, d), k_proj=(d, kv), v_proj=(d, kv), o_proj=(d, d)).items():
            setattr(self.self_attn, n, nn.Linear(i, o, bias=False))
        self.mlp = nn.Module()
        for n, (i, o) in dict(gate_proj=(d, f), up_proj=(d, f), down_proj=(f, d)).items():
            setattr(self.mlp, n, nn.Linear(i, o, bias=False))
        self.input_layernorm = Norm(d)
        self.post_attention_layernorm = Norm(d)


class LlamaShaped(nn.Module):
    """LLaMA's parameter names and shapes, nothing else: enough to test IO without models/."""

    def __init__(self, c: dict):
        super().__init__()
        if c.get("model_type") not in ("llama", "mistral"):
            raise ValueError(f"config.json: model_type {c.get('model_type')!r} is not supported — use llama")
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.model.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.model.norm = Norm(c["hidden_size"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def tie_weights(self) -> None:
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def random_model(seed: int = 0, **overrides) -> tuple[LlamaShaped, dict]:
    cfg = {**CFG, **overrides}
    torch.manual_seed(seed)
    m = LlamaShaped(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    m.tie_weights()
    return m, cfg


def write_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


# ----------------------------------------------------------------------------- round trips


def test_save_then_load_gives_same_tensors_frozen_and_attached(tmp_path):
    m, cfg = random_model()
    save_pretrained(m, tmp_path / "ck", cfg)
    assert sorted(os.listdir(tmp_path / "ck")) == ["config.json", "model.safetensors"]
    on_disk = load_file(tmp_path / "ck" / "model.safetensors")
    assert on_disk.keys() == m.state_dict().keys()
    for k, v in m.state_dict().items():
        assert torch.equal(on_disk[k], v), k

    got = load_pretrained(tmp_path / "ck", LlamaShaped)
    assert got.hf_config == cfg and got.source_dir == tmp_path / "ck"
    for k, v in got.state_dict().items():
        assert torch.equal(v, on_disk[k]), k
    for n, p in got.named_parameters():
        assert not p.requires_grad and not p.is_meta and p.device.type == "cpu", n


def test_load_casts_floating_tensors_only(tmp_path):
    m, cfg = random_model()
    t = state(m)
    t["model.norm.weight"] = t["model.norm.weight"].half()  # mixed stored dtypes
    write_checkpoint(tmp_path, t, cfg)
    got = load_pretrained(tmp_path, LlamaShaped, dtype=torch.bfloat16)
    for k, v in got.state_dict().items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, t[k].to(torch.bfloat16)), k
    kept = load_pretrained(tmp_path, LlamaShaped, dtype=None)
    assert kept.model.norm.weight.dtype == torch.float16 and kept.lm_head.weight.dtype == torch.float32


def test_sharded_save_is_hf_layout_and_loads_back(tmp_path):
    m, cfg = random_model()
    per_layer = sum(p.numel() * 4 for p in m.model.layers[0].parameters())
    save_pretrained(m, tmp_path / "ck", cfg, max_shard_bytes=per_layer)
    files = sorted(os.listdir(tmp_path / "ck"))
    shards = [f for f in files if f.endswith(".safetensors")]
    n = len(shards)
    assert n > 2 and "model.safetensors" not in files
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    merged: dict[str, torch.Tensor] = {}
    for s in shards:
        part = load_file(tmp_path / "ck" / s)
        assert sum(v.numel() * 4 for v in part.values()) <= per_layer or len(part) == 1
        for k in part:
            assert index["weight_map"][k] == s
        merged.update(part)
    assert index["weight_map"].keys() == merged.keys() == m.state_dict().keys()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in merged.values())

    got = load_pretrained(tmp_path / "ck", LlamaShaped)
    for k, v in got.state_dict().items():
        assert torch.equal(v, merged[k]), k


def test_save_casts_with_dtype_and_records_it(tmp_path):
    m, cfg = random_model()
    save_pretrained(m, tmp_path / "ck", cfg, dtype=torch.bfloat16)
    on_disk = load_file(tmp_path / "ck" / "model.safetensors")
    for k, v in m.state_dict().items():
        assert on_disk[k].dtype == torch.bfloat16 and torch.equal(on_disk[k], v.to(torch.bfloat16)), k
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert "torch_dtype" not in cfg  # the caller's dict is not changed


def test_tied_head_is_saved_once_and_retied_on_load(tmp_path):
    m, cfg = random_model(tie_word_embeddings=True)
    save_pretrained(m, tmp_path / "ck", cfg)
    on_disk = load_file(tmp_path / "ck" / "model.safetensors")
    assert "lm_head.weight" not in on_disk and "model.embed_tokens.weight" in on_disk
    got = load_pretrained(tmp_path / "ck", LlamaShaped)
    assert got.lm_head.weight is got.model.embed_tokens.weight
    assert torch.equal(got.lm_head.weight, on_disk["model.embed_tokens.weight"])


def test_tied_checkpoint_that_carries_the_head_is_accepted(tmp_path):
    m, cfg = random_model(tie_word_embeddings=True)
    t = state(m)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    write_checkpoint(tmp_path, t, cfg)
    got = load_pretrained(tmp_path, LlamaShaped)
    assert got.lm_head.weight is got.model.embed_tokens.weight


def test_tied_config_with_a_different_stored_head_is_refused(tmp_path):
    m, cfg = random_model(tie_word_embeddings=True)
    t = state(m)
    t["lm_head.weight"] = torch.randn_like(t["model.embed_tokens.weight"])
    write_checkpoint(tmp_path, t, cfg)
    with pytest.raises(UserError, match="lm_head.weight differs.*tie_word_embeddings"):
        load_pretrained(tmp_path, LlamaShaped)


def test_tensor_hook_may_take_tensors_over(tmp_path):
    m, cfg = random_model()
    write_checkpoint(tmp_path, state(m), cfg)
    seen: dict[str, torch.dtype] = {}

    def hook(model, key, t):
        seen[key] = t.dtype
        if key == "lm_head.weight":  # place it ourselves, scaled, to see the hook's choice win
            model.lm_head.weight = nn.Parameter(2 * t, requires_grad=False)
            return True
        return False

    got = load_pretrained(tmp_path, LlamaShaped, dtype=torch.bfloat16, tensor_hook=hook)
    assert seen.keys() == m.state_dict().keys() and set(seen.values()) == {torch.bfloat16}
    assert torch.equal(got.lm_head.weight, 2 * m.lm_head.weight.detach().to(torch.bfloat16))


def test_buffers_are_loaded_too(tmp_path):
    class WithBuffer(LlamaShaped):
        def __init__(self, c):
            super().__init__(c)
            self.register_buffer("scale", torch.zeros(3))

    m, cfg = random_model()
    t = {**state(m), "scale": torch.arange(3.0)}
    write_checkpoint(tmp_path, t, cfg)
    got = load_pretrained(tmp_path, WithBuffer)
    assert torch.equal(got.scale, torch.arange(3.0))


# ----------------------------------------------------------------------------- user errors


def test_missing_folder_config_and_bad_json(tmp_path):
    with pytest.raises(UserError, match=r"nope: no such model folder"):
        load_pretrained(tmp_path / "nope", LlamaShaped)
    with pytest.raises(UserError, match=r"config\.json: not found"):
        load_pretrained(tmp_path, LlamaShaped)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"config\.json: not valid JSON"):
        load_pretrained(tmp_path, LlamaShaped)


def test_build_value_error_becomes_user_error_naming_the_file(tmp_path):
    m, cfg = random_model()
    write_checkpoint(tmp_path, state(m), {**cfg, "model_type": "gpt2"})
    with pytest.raises(UserError) as e:
        load_pretrained(tmp_path, LlamaShaped)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: model_type 'gpt2' is not supported")


def test_no_weights_and_pickle_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    with pytest.raises(UserError, match="no model.safetensors"):
        load_pretrained(tmp_path, LlamaShaped)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(UserError, match=r"pickle weights \(pytorch_model.bin\).*convert"):
        load_pretrained(tmp_path, LlamaShaped)


def test_missing_shard_is_named(tmp_path):
    m, cfg = random_model()
    save_pretrained(m, tmp_path / "ck", cfg, max_shard_bytes=4096)
    second = sorted((tmp_path / "ck").glob("model-00002-of-*.safetensors"))[0]
    second.unlink()
    with pytest.raises(UserError, match=rf"shard \[{second.name}\] named in model.safetensors.index.json is missing"):
        load_pretrained(tmp_path / "ck", LlamaShaped)


@pytest.mark.parametrize("keep", [4, 100, -1])
def test_truncated_file_names_the_file(tmp_path, keep):
    m, cfg = random_model()
    save_pretrained(m, tmp_path / "ck", cfg)
    f = tmp_path / "ck" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep])  # inside the length, inside the header, one byte short of the data
    with pytest.raises(UserError, match=r"model\.safetensors: not a valid safetensors file.*truncated"):
        load_pretrained(tmp_path / "ck", LlamaShaped)


def test_corrupt_header_names_the_file(tmp_path):
    m, cfg = random_model()
    save_pretrained(m, tmp_path / "ck", cfg)
    f = tmp_path / "ck" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8] = ord("#")  # the header's opening brace
    f.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"model\.safetensors: not a valid safetensors file \(header is not JSON"):
        load_pretrained(tmp_path / "ck", LlamaShaped)


def test_wrong_shape_extra_and_missing_keys(tmp_path):
    m, cfg = random_model()
    t = state(m)
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 16)
    write_checkpoint(tmp_path / "shape", t, cfg)
    with pytest.raises(UserError, match=r"shape mismatches \[model\.layers\.0\.mlp\.up_proj\.weight: checkpoint \(7, 16\) vs model \(24, 16\)\]"):
        load_pretrained(tmp_path / "shape", LlamaShaped)

    t = {**state(m), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    write_checkpoint(tmp_path / "extra", t, cfg)
    with pytest.raises(UserError, match=r"unexpected keys \[model\.layers\.0\.self_attn\.rotary_emb\.inv_freq\]"):
        load_pretrained(tmp_path / "extra", LlamaShaped)

    t = state(m)
    del t["model.layers.1.post_attention_layernorm.weight"]
    write_checkpoint(tmp_path / "missing", t, cfg)
    with pytest.raises(UserError, match=r"missing keys \[model\.layers\.1\.post_attention_layernorm\.weight\]"):
        load_pretrained(tmp_path / "missing", LlamaShaped)

    # an untied config without lm_head.weight: the head is missing, not silently random
    t = state(m)
    del t["lm_head.weight"]
    write_checkpoint(tmp_path / "head", t, cfg)
    with pytest.raises(UserError, match=r"missing keys \[lm_head\.weight\]"):
        load_pretrained(tmp_path / "head", LlamaShaped)


def test_all_problems_in_one_error(tmp_path):
    m, cfg = random_model()
    t = state(m)
    del t["model.norm.weight"]
    t["extra.weight"] = torch.zeros(1)
    t["model.embed_tokens.weight"] = torch.zeros(3, 16)
    write_checkpoint(tmp_path, t, cfg)
    with pytest.raises(UserError) as e:
        load_pretrained(tmp_path, LlamaShaped)
    msg = str(e.value)
    assert "\n" not in msg and " — " in msg
    assert "missing keys [model.norm.weight]" in msg
    assert "unexpected keys [extra.weight]" in msg
    assert "model.embed_tokens.weight: checkpoint (3, 16) vs model (40, 16)" in msg


def test_save_refuses_quantized_or_unloaded_params(tmp_path):
    m, cfg = random_model()
    m.lm_head.weight = nn.Parameter(torch.zeros(40, 16, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(UserError, match="lm_head.weight is torch.uint8"):
        save_pretrained(m, tmp_path / "ck", cfg)
    with torch.device("meta"):
        meta = LlamaShaped(CFG)
    with pytest.raises(UserError, match="never loaded"):
        save_pretrained(meta, tmp_path / "ck", cfg)
    assert not (tmp_path / "ck").exists()


# ----------------------------------------------------------------------------- atomic saves


def test_a_new_folder_gets_the_usual_permissions(tmp_path):
    # a temporary folder made by mkdtemp is 0700: renamed into place, others could not read the model
    m, cfg = random_model()
    mask = os.umask(0o022)
    try:
        save_pretrained(m, tmp_path / "merged", cfg)
    finally:
        os.umask(mask)
    assert (tmp_path / "merged").stat().st_mode & 0o777 == 0o755


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    import minitrain.weights as w

    m, cfg = random_model()
    calls = []

    def flaky(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(w, "save_file", flaky)
    with pytest.raises(UserError, match=r"ck: cannot write the weights: disk full — "):
        save_pretrained(m, tmp_path / "ck", cfg, max_shard_bytes=4096)
    assert os.listdir(tmp_path) == []  # no target, no temporary folder


def test_save_into_existing_folder_keeps_other_files_and_drops_stale_shards(tmp_path):
    m, cfg = random_model()
    save_pretrained(m, tmp_path / "ck", cfg, max_shard_bytes=4096)
    (tmp_path / "ck" / "tokenizer.json").write_text("{}")
    m2, _ = random_model(seed=1)
    save_pretrained(m2, tmp_path / "ck", cfg)
    assert sorted(os.listdir(tmp_path / "ck")) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    got = load_pretrained(tmp_path / "ck", LlamaShaped)
    assert torch.equal(got.lm_head.weight, m2.lm_head.weight)
    # and back to sharded: the single file goes, the index stays
    save_pretrained(m, tmp_path / "ck", cfg, max_shard_bytes=4096)
    files = os.listdir(tmp_path / "ck")
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    assert torch.equal(load_pretrained(tmp_path / "ck", LlamaShaped).lm_head.weight, m.lm_head.weight)


def test_a_save_that_fails_while_moving_in_leaves_the_previous_save_whole(tmp_path, monkeypatch):
    # moved file by file, a failure after the first shard would pair new and old shards of one folder
    import minitrain.weights as w

    m, cfg = random_model()
    save_pretrained(m, tmp_path / "ck", cfg, max_shard_bytes=4096)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    assert len(before) > 3  # several shards, an index, the config
    real, calls = os.replace, []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(w.os, "replace", second_fails)
    with pytest.raises(UserError, match=r"ck: cannot write the weights: "):
        save_pretrained(random_model(seed=1)[0], tmp_path / "ck", cfg, max_shard_bytes=4096)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# ----------------------------------------------------------------------------- transformers as the reference


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard", [None, 8192])
def test_transformers_loads_what_we_save(tmp_path, tied, shard):
    transformers = pytest.importorskip("transformers")
    m, cfg = random_model(tie_word_embeddings=tied)
    kw = {} if shard is None else {"max_shard_bytes": shard}
    save_pretrained(m, tmp_path / "ck", cfg, **kw)
    assert (tmp_path / "ck" / "model.safetensors.index.json").exists() == (shard is not None)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32)
    ours = m.state_dict()
    theirs = hf.state_dict()
    assert theirs.keys() == ours.keys()
    for k in ours:
        assert torch.equal(theirs[k], ours[k]), k
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("tied", [False, True])
def test_we_load_transformers_sharded_saves(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    cfg = {k: v for k, v in CFG.items() if k != "model_type"}
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, "tie_word_embeddings": tied}))
    hf.save_pretrained(tmp_path, max_shard_size="8KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    got = load_pretrained(tmp_path, LlamaShaped)
    ours = got.state_dict()
    theirs = hf.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == tied


# ----------------------------------------------------------------------------- with models/ (once it exists)


def _models():
    try:
        import models.llama  # noqa: F401
        from models import from_hf_config
    except ImportError:
        pytest.skip("models/llama.py not written yet")
    return from_hf_config


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("w_llama", {}),
        ("w_tied", {"tie_word_embeddings": True}),
        ("w_mistral_gqa", {"model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 4}),
    ],
)
def test_models_family_loads_hf_checkpoint_key_for_key(hf_causal, name, overrides):
    from_hf_config = _models()
    folder = hf_causal(name, **overrides)
    model = load_pretrained(folder, from_hf_config)
    on_disk = load_file(folder / "model.safetensors")
    ours = model.state_dict()
    for k, v in on_disk.items():
        assert torch.equal(ours[k], v), k
    assert set(ours) - set(on_disk) <= {"lm_head.weight"}
    if overrides.get("tie_word_embeddings"):
        assert model.output_projection.weight is model.input_embeddings.weight


@pytest.mark.parametrize("old_layout", [False, True])
def test_t5_tied_embeddings_load_in_both_layouts(tmp_path, old_layout):
    """transformers 5 writes only `shared.weight`; older hub files also carry the encoder/decoder
    embeddings and the head as copies of it. Both load, tied, equal to transformers' tensors."""
    transformers = pytest.importorskip("transformers")
    try:
        import models.t5  # noqa: F401
        from models import from_hf_config
    except ImportError:
        pytest.skip("models/t5.py not written yet")
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(cfg)
    hf.save_pretrained(tmp_path)
    if old_layout:
        t = load_file(tmp_path / "model.safetensors")
        for k in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
            t[k] = t["shared.weight"].clone()
        save_file(t, tmp_path / "model.safetensors")
    model = load_pretrained(tmp_path, from_hf_config)
    ours, theirs = model.state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    assert model.output_projection.weight is model.input_embeddings.weight


def test_old_llama_saves_with_rotary_inv_freq_load(hf_causal, tmp_path):
    """Checkpoints saved by older transformers carry `rotary_emb.inv_freq`: derived, skipped by name
    (the family lists it in `ignore_checkpoint_keys`), while any other stray key is still an error."""
    import shutil

    import models

    src = hf_causal("inv_freq_llama")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    sd = load_file(src / "model.safetensors")
    extra = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.arange(8.0) for i in range(2)}
    save_file({**sd, **extra}, tmp_path / "model.safetensors")
    model = load_pretrained(tmp_path, models.from_hf_config)
    for k, v in sd.items():
        assert torch.equal(model.state_dict()[k], v), k
    save_file({**sd, "model.layers.0.self_attn.stray": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="unexpected keys.*stray"):
        load_pretrained(tmp_path, models.from_hf_config)


def test_skip_init_leaves_tensors_and_the_rng_alone_and_runs_everything_else():
    t = torch.full((4, 3), 7.0)
    rng = torch.get_rng_state()
    with skip_init():
        nn.init.normal_(t)
        nn.init.kaiming_uniform_(t, a=5**0.5)
        nn.init.zeros_(t)
        nn.init.xavier_normal_(t)  # not torch-function aware: its tensor method (normal_) is caught instead
        t.uniform_()
        lin = nn.Linear(3, 5)  # reset_parameters runs, draws nothing
        emb = nn.Embedding(6, 2, padding_idx=0)
        s = torch.ones(2) + 1  # anything else is unchanged
    assert torch.equal(torch.get_rng_state(), rng)
    assert (t == 7.0).all() and s.tolist() == [2.0, 2.0]
    assert lin.weight.shape == (5, 3) and emb.weight.shape == (6, 2)
    nn.init.zeros_(t)  # outside, initialisers work again
    assert (t == 0).all()


def test_meta_build_imports_no_python_decompositions(tmp_path):
    # building on meta used to import sympy through torch's Python refs: seconds before step 1
    import subprocess
    import sys

    code = ("import sys, torch; from minitrain.weights import _build_on_meta; from models import from_hf_config; "
            "from pathlib import Path; cfg = dict(model_type='llama', vocab_size=64, hidden_size=32, "
            "intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2); "
            "_build_on_meta(from_hf_config, cfg, Path('config.json')); print('sympy' in sys.modules)")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
