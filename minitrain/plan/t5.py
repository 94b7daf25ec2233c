"""The memory of T5 (`T5Shape`, `models/t5.py`): the decoder-only method over an encoder and a decoder.

The encoder runs rows x source-length tokens and the decoder rows x target-length tokens; each
decoder block also attends over the encoder output and keeps its cross-attention keys and values,
rows x source long (`T5Shape.block_saved`). T5 runs train with the checkpoint's `dropout_rate`
(0.1 for the published ones) and the recipe's `lora_dropout`: each dropout keeps its mask (bool on
CUDA, the input's dtype on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from minitrain.errors import UserError
from minitrain.plan.decoder import logits_terms, matches
from minitrain.plan.run_shape import DTYPE_BYTES, RunShape, Term, linears_bytes


@dataclass(frozen=True)
class T5Shape:
    """A T5 checkpoint's dims, under HF's `config.json` names (`models/t5.py`).

    v1.0: `feed_forward_proj="relu"` (`wi -> relu -> wo`), head tied to `shared` (the decoder
    output is scaled by d_model**-0.5 first: a scalar product, which keeps nothing for backward);
    v1.1 / FLAN-T5: "gated-gelu" (`gelu(wi_0 x) * wi_1 x -> wo`), own `lm_head`. Either way the head
    is a plain `nn.Linear` (`output_projection`), so a frozen one takes the loss's frozen-head path.
    """

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    relative_attention_num_buckets: int = 32
    dropout_rate: float = 0.1
    model_type: str = "t5"
    is_encoder_decoder: ClassVar[bool] = True
    EMBEDDINGS: ClassVar[tuple[str, ...]] = ("shared", "encoder.embed_tokens", "decoder.embed_tokens")

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str = "config.json") -> "T5Shape":
        """From a T5 `config.json` dict (transformers' T5Config defaults for the fields it may leave out)."""
        kw: dict[str, Any] = {}
        for k, default in (("vocab_size", 32128), ("d_model", 512), ("d_kv", 64), ("d_ff", 2048), ("num_layers", 6),
                           ("num_heads", 8), ("relative_attention_num_buckets", 32)):
            v = d.get(k, default)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"{where}: {k}: {v!r} is not a positive integer — not a T5 config.json")
            kw[k] = v
        dec = d.get("num_decoder_layers")
        if dec is not None and (not isinstance(dec, int) or isinstance(dec, bool) or dec <= 0):
            raise UserError(f"{where}: num_decoder_layers: {dec!r} is not a positive integer — fix the value")
        ff = d.get("feed_forward_proj", "relu")
        if not isinstance(ff, str) or not ff:
            raise UserError(f"{where}: feed_forward_proj: {ff!r} — use 'relu' (T5 v1.0) or 'gated-gelu' (v1.1)")
        return cls(**kw, num_decoder_layers=dec or kw["num_layers"], feed_forward_proj=ff,
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                   dropout_rate=float(d.get("dropout_rate", 0.1) or 0.0))

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def blocks(self) -> int:
        """The repeated blocks that `checkpointing` counts: the encoder's, then the decoder's."""
        return self.num_layers + self.num_decoder_layers

    @property
    def inner(self) -> int:
        return self.num_heads * self.d_kv

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    def linears(self, decoder: bool) -> dict[str, tuple[int, int]]:
        """One encoder (decoder) block's linears, by their name in the block: name -> (in, out)."""
        D, inner, F = self.d_model, self.inner, self.d_ff
        attn = ["layer.0.SelfAttention"] + (["layer.1.EncDecAttention"] if decoder else [])
        out: dict[str, tuple[int, int]] = {}
        for a in attn:
            out.update({f"{a}.q": (D, inner), f"{a}.k": (D, inner), f"{a}.v": (D, inner), f"{a}.o": (inner, D)})
        ff = f"layer.{len(attn)}.DenseReluDense"
        out.update({f"{ff}.{w}": (D, F) for w in (("wi_0", "wi_1") if self.is_gated else ("wi",))})
        out[f"{ff}.wo"] = (F, D)
        return out

    def adapted(self, run: RunShape, decoder: bool) -> list[str]:
        """The block linears LoRA wraps for the run's target suffixes (`q`, `wi_0`, ... or all-linear)."""
        if "all-linear" in run.lora_targets:
            return list(self.linears(decoder))
        return [n for n in self.linears(decoder) if any(matches(n, t) for t in run.lora_targets)]

    def _stacks(self) -> tuple[tuple[int, bool], tuple[int, bool]]:
        return (self.num_layers, False), (self.num_decoder_layers, True)

    def num_params(self) -> int:
        D, V = self.d_model, self.vocab_size
        linears = sum(L * sum(i * o for i, o in self.linears(dec).values()) for L, dec in self._stacks())
        norms = (2 * self.num_layers + 3 * self.num_decoder_layers + 2) * D
        return linears + V * D * (1 if self.tie_word_embeddings else 2) + norms + self._bias_tables()

    def _bias_tables(self) -> int:
        return 2 * self.relative_attention_num_buckets * self.num_heads  # block 0 of each stack

    def describe(self) -> str:
        return (f"{self.num_layers} encoder + {self.num_decoder_layers} decoder layers, d_model {self.d_model}, "
                f"{self.feed_forward_proj} d_ff {self.d_ff}, vocab {self.vocab_size:,}"
                + (", tied head" if self.tie_word_embeddings else ""))

    # -- persistent terms

    def weight_terms(self, run: RunShape) -> list[Term]:
        """Block linears (by format), shared embedding (+ lm_head when untied), norms, position-bias tables."""
        s, D, V = run.s, self.d_model, self.vocab_size
        b, f = linears_bytes([(i, o, L) for L, dec in self._stacks() for i, o in self.linears(dec).values()], run)
        heads = 1 if self.tie_word_embeddings else 2
        norms = 2 * self.num_layers + 3 * self.num_decoder_layers + 2
        return [Term("weights: block linears", b, f),
                Term("weights: embeddings + head", heads * V * D * s,
                     f"{heads} x {V:,} x {D:,} x {s} B" + (" (tied)" if heads == 1 else "")),
                Term("weights: norms", norms * D * s, f"{norms} x {D:,} x {s} B"),
                Term("weights: relative position bias", self._bias_tables() * s,
                     f"2 stacks x {self.relative_attention_num_buckets} buckets x {self.num_heads} heads x {s} B")]

    def trainable_tensors(self, run: RunShape) -> list[int]:
        """LoRA A and B of every adapted linear; `shared` / `lm_head` / final norms in modules_to_save."""
        out = []
        for L, dec in self._stacks():
            lin = self.linears(dec)
            for name in self.adapted(run, dec):
                i, o = lin[name]
                out += [run.rank(i, o) * i, o * run.rank(i, o)] * L
        full = set()  # a tied head is `shared` itself: one tensor
        for m in run.modules_to_save:
            if any(matches(e, m) for e in self.EMBEDDINGS):
                full.add("shared")
            if matches("lm_head", m):
                full.add("shared" if self.tie_word_embeddings else "lm_head")
            if matches("encoder.final_layer_norm", m) or matches("decoder.final_layer_norm", m):
                full.add(m)
        return out + [self.d_model if n.endswith("final_layer_norm") else self.vocab_size * self.d_model
                      for n in sorted(full)]

    def adapted_summary(self, run: RunShape) -> str:
        return (f"{len(self.adapted(run, False))} linears x {self.num_layers} encoder blocks + "
                f"{len(self.adapted(run, True))} x {self.num_decoder_layers} decoder blocks")

    # -- activations

    def _tokens(self, run: RunShape) -> tuple[int, int]:
        """(encoder tokens, decoder tokens) of one micro-batch."""
        return run.rows * run.seq, run.rows * (run.target_seq or run.seq)

    def _own_copies(self, run: RunShape) -> bool:
        """Whether every adapter keeps its own copy of its input (autocast casts, or lora_dropout)."""
        return run.cast_copies or run.lora_dropout > 0

    def _kept_inputs(self, run: RunShape, decoder: bool) -> set[str]:
        """Linear inputs kept once and shared when adapters do not copy them (no frozen base keeps its own)."""
        names = set() if self._own_copies(run) else set(self.adapted(run, decoder))
        kept = {_t5_input(n) for n in names}
        if not self.is_gated and self.dropout_rate == 0:
            kept.discard("ff")  # relu keeps its output, wo's input, already
        return kept

    def block_saved(self, run: RunShape, decoder: bool) -> list[Term]:
        """What one encoder (decoder) block keeps for backward, read off the autograd graph of
        `models/t5.py` + `minitrain/adapters/lora.py` (no checkpointing; the test enumerates it).

        Per query token (n = rows x source length in the encoder, rows x target length in the
        decoder), s = compute bytes, m = a dropout mask's bytes per element, I = heads x d_kv,
        F = d_ff, k = keys per query (self: the block's own length, cross: the source length):

        - D x 4 + 4 per layer norm (2, decoder 3): its fp32 input (`x.float()`, kept by `pow`), rsqrt;
        - attention: q, k, v (3 x I x s; cross-attention's k and v are source-length rows, per
          decoder block); per key and head: softmax's fp32 probs (4) and their compute-dtype copy
          that `probs @ v` keeps when s < 4, or with dropout its mask and the dropped probs (m + s);
        - feed-forward: relu keeps its output (F x s), gated-gelu gelu's input, its output and
          wi_1's output (3 x F x s); with dropout + a mask (F x m) and D x m per residual branch;
        - inputs of the adapted linears: fp32 runs without lora_dropout share them (q/k/v read one
          normed x, o the attention output, wi* another normed x, wo the feed-forward product,
          cross-attention k/v the encoder output, counted once per run in `_model_saved`); under
          autocast (fp32 adapters) or with lora_dropout every adapter keeps its own copy (x s, + a
          fp32-input mask with lora_dropout); B's input (r x s); under autocast each adapter's
          A and B weights cast to the compute dtype (r x (in + out) x s, per block).
        """
        s, D, inner, F, H, r = run.s, self.d_model, self.inner, self.d_ff, self.num_heads, run.lora_r
        enc_n, dec_n = self._tokens(run)
        n, keys = (dec_n, run.target_seq or run.seq) if decoder else (enc_n, run.seq)
        drop = self.dropout_rate > 0
        m = run.mask_bytes(s)
        per_key = 4 + ((m + s) if drop else (s if s < 4 else 0))
        sub = 3 if decoder else 2
        terms = [Term("norm inputs (fp32) + rsqrt", n * sub * (D * 4 + 4), f"{sub} x (D x 4 + 4) per token"),
                 Term("self-attention q, k, v", n * 3 * inner * s, "3 x I x s per token"),
                 Term("self-attention probs", n * H * keys * per_key, f"heads x {keys} keys x {per_key} B per token")]
        if decoder:
            terms += [Term("cross-attention q (+ k, v over the source)", (dec_n + 2 * enc_n) * inner * s,
                           "I x s per target token + 2 x I x s per source token"),
                      Term("cross-attention probs", n * H * run.seq * per_key,
                           f"heads x {run.seq} source keys x {per_key} B per token")]
        ff = 3 if self.is_gated else 1
        terms.append(Term("feed-forward " + ("gelu in, out, wi_1 out" if self.is_gated else "relu out"),
                          n * (ff * F * s + (F * m if drop else 0)), f"{ff} x F x s" + (" + F x m" if drop else "")
                          + " per token"))
        if drop:
            terms.append(Term("dropout masks (residual branches)", n * sub * D * m, f"{sub} x D x {m} per token"))
        rows = {"h_sa": n, "attn_sa": n, "h_ca": n, "attn_ca": n, "enc": enc_n, "h_ff": n, "ff": n}
        width = {"h_sa": D, "attn_sa": inner, "h_ca": D, "attn_ca": inner, "enc": D, "h_ff": D, "ff": F}
        adapted = self.adapted(run, decoder)
        lin = self.linears(decoder)
        inputs = [_t5_input(name) for name in adapted]
        if self._own_copies(run):
            mask = run.mask_bytes(DTYPE_BYTES[run.adapter_dtype]) if run.lora_dropout > 0 else 0
            b = sum(rows[k] * width[k] * (s + mask) for k in inputs)
            how = "own copy per adapter" + (f" + lora_dropout mask ({mask} B)" if mask else "")
        else:
            b, how = 0, "shared"
        shared = self._kept_inputs(run, decoder) - {"enc"}
        b += sum(rows[k] * width[k] * s for k in shared)
        if b:
            terms.append(Term("linear inputs kept for adapter grads", b, f"{how}, x {s} B"))
        if adapted:
            terms.append(Term("LoRA B inputs", sum(rows[k] for k in inputs) * r * s,
                              f"{len(adapted)} x r x {s} per row"))
        if run.cast_copies and adapted:
            terms.append(Term("LoRA weights cast by autocast", sum(r * sum(lin[x]) for x in adapted) * s,
                              "r x (in + out) x s per adapter"))
        return terms

    def _model_saved(self, run: RunShape) -> list[Term]:
        """Kept once per forward, outside the blocks: batch tensors, the two final norms (+ dropout
        masks), and the encoder output when cross-attention adapters share it."""
        s, D = run.s, self.d_model
        enc_n, dec_n = self._tokens(run)
        terms = [Term("batch tensors (ids, masks, labels)", (2 * enc_n + 3 * dec_n) * 8,
                      "2 x int64 per source + 3 per target token"),
                 Term("encoder final norm input (fp32)", enc_n * (D * 4 + 4), "D x 4 + 4 per source token"),
                 Term("decoder final norm input (fp32)", dec_n * (D * 4 + 4), "D x 4 + 4 per target token")]
        if self.dropout_rate > 0:
            m = run.mask_bytes(s)
            terms.append(Term("final dropout masks", (enc_n + dec_n) * D * m, f"D x {m} per token"))
        if "enc" in self._kept_inputs(run, decoder=True):
            terms.append(Term("encoder output (cross-attention adapters' input)", enc_n * D * s,
                              "source tokens x D x s"))
        return terms

    def _bias(self, run: RunShape, decoder: bool) -> Term:
        """The fp32 attention bias (position bias + mask) every block of a stack takes as an input:
        rows x heads x length^2 (the encoder's without a padding mask: one for all rows), and the
        decoder's cross-attention mask (rows x source)."""
        if decoder:
            T = run.target_seq or run.seq
            return Term("decoder attention biases (fp32, block inputs)",
                        run.rows * (self.num_heads * T * T + run.seq) * 4, "rows x (heads x T^2 + S) x 4")
        return Term("encoder attention bias (fp32, block input)",
                    (run.rows if run.mask else 1) * self.num_heads * run.seq ** 2 * 4, "rows x heads x S^2 x 4")

    def _block_backward(self, run: RunShape, decoder: bool) -> list[Term]:
        """One block's backward working set beyond its saved tensors (measured on the CPU): the larger
        of the feed-forward's (2 x F x s, F x 4 for an adapted wo under autocast) and the attention's
        (per key and head: the probs' gradient in fp32 and the scores' gradient, 2 x 4, + s when
        s < 4; less the feed-forward's saved tensors, freed by then as backward runs the block in
        reverse), plus the incoming gradient of the residual (D x s)."""
        s, D, F, H = run.s, self.d_model, self.d_ff, self.num_heads
        enc_n, dec_n = self._tokens(run)
        n = dec_n if decoder else enc_n
        keys = max(run.target_seq or run.seq, run.seq) if decoder else run.seq
        cast = run.cast_copies and any(x.endswith(".wo") for x in self.adapted(run, decoder))
        ff = max(2 * F * s, F * 4 if cast else 0)
        attn = max(0, H * keys * (8 + (s if s < 4 else 0)) - (3 if self.is_gated else 1) * F * s)
        terms = [Term("block backward: " + ("feed-forward" if ff >= attn else "attention") + " grads",
                      n * (max(ff, attn) + D * s), f"max({ff:,}, {attn:,}) + D x s B per token")]
        return terms + self._dequantized(run)

    def _block_forward(self, run: RunShape, decoder: bool) -> list[Term]:
        """One block's forward working set beyond what it keeps, when checkpointing recomputes it: the
        scores before softmax (fp32, + their compute-dtype matmul output when s < 4) or the
        feed-forward's product / fp32 adapter cast (F x s, F x 4), plus the output (D x s)."""
        s, D, F, H = run.s, self.d_model, self.d_ff, self.num_heads
        enc_n, dec_n = self._tokens(run)
        n = dec_n if decoder else enc_n
        keys = max(run.target_seq or run.seq, run.seq) if decoder else run.seq
        wo = any(x.endswith(".wo") for x in self.adapted(run, decoder))
        ff = F * s + (F * 4 if wo and run.cast_copies else 0)
        attn = H * keys * (4 + (s if s < 4 else 0))
        work = Term("block forward (recompute) working set", n * (max(ff, attn) + D * s),
                    f"max({ff:,}, {attn:,}) + D x s B per token")
        return [work] + self._dequantized(run)

    def _dequantized(self, run: RunShape) -> list[Term]:
        if run.quantize != "nf4":
            return []
        big = max(i * o for i, o in self.linears(True).values())
        return [Term("4-bit weight dequantized for a matmul", big * run.s, "largest linear x s")]

    def _recomputed(self, run: RunShape, saved: list[Term], decoder: bool) -> list[Term]:
        """Checkpointing: one block's saved tensors recomputed, + its larger forward or backward working set."""
        fwd, bwd = self._block_forward(run, decoder), self._block_backward(run, decoder)
        worst = fwd if sum(t.bytes for t in fwd) > sum(t.bytes for t in bwd) else bwd
        name = "decoder" if decoder else "encoder"
        return [Term(f"one {name} block recomputed", sum(t.bytes for t in saved), "block_saved")] + worst

    def moments(self, run: RunShape) -> tuple[dict[str, list[Term]], list[str]]:
        """The candidate peaks: end of forward and loss backward (everything the two stacks keep +
        the chunked loss over the decoder's tokens), the first decoder and the first encoder block
        backward (the decoder's activations are gone by the encoder's)."""
        s, D = run.s, self.d_model
        Le, Ld = self.num_layers, self.num_decoder_layers
        enc_n, dec_n = self._tokens(run)
        enc, dec = self.block_saved(run, False), self.block_saved(run, True)
        enc_b, dec_b = sum(t.bytes for t in enc), sum(t.bytes for t in dec)
        msaved = self._model_saved(run)
        lfwd, lbwd, _ = logits_terms(self, replace(run, seq=run.target_seq or run.seq))
        batch = [t for t in msaved if t.name.startswith("batch")]
        # checkpointing's first k blocks in module order: the encoder's, then the decoder's
        k = run.checkpointed(Le + Ld)
        ke, kd = min(k, Le), max(0, k - Le)
        enc_in = [Term(f"encoder block inputs x {ke} (checkpointing)", ke * enc_n * D * s,
                       f"{ke} x N_src x D x {s}"), self._bias(run, False)] if ke else []
        dec_in = [Term(f"decoder block inputs x {kd} (checkpointing)", kd * dec_n * D * s,
                       f"{kd} x N_tgt x D x {s}")] if kd else []
        if kd and not any(t.name.startswith("encoder output") for t in msaved):
            dec_in.append(Term("encoder output (decoder blocks' input)", enc_n * D * s, "N_src x D x s"))
        dec_in += [self._bias(run, True)] if kd else []
        enc_kept = enc_in + ([Term(f"saved activations x {Le - ke} encoder blocks", (Le - ke) * enc_b,
                                   f"{Le - ke} x {enc_b / enc_n:,.0f} B per source token")] if ke < Le else [])
        dec_kept = dec_in + ([Term(f"saved activations x {Ld - kd} decoder blocks", (Ld - kd) * dec_b,
                                   f"{Ld - kd} x {dec_b / dec_n:,.0f} B per target token")] if kd < Ld else [])
        enc_grad = Term("grad of the encoder output (summed over cross-attentions)", enc_n * D * s, "N_src x D x s")
        front = [t for t in msaved if not t.name.startswith("decoder final")]
        moments = {
            "end of forward (loss forward)": msaved + enc_kept + dec_kept + lfwd,
            "loss backward": msaved + enc_kept + dec_kept + lbwd,
            "last decoder block backward": front + enc_kept + dec_kept + [enc_grad]
            + (self._recomputed(run, dec, True) if kd == Ld else self._block_backward(run, True)),
            "last encoder block backward": batch + enc_kept + [enc_grad]
            + (self._recomputed(run, enc, False) if ke == Le else self._block_backward(run, False)),
        }
        if 0 < kd < Ld:  # the last checkpointed decoder block recomputed, the decoder blocks after it freed
            moments["last checkpointed decoder block backward"] = (front + enc_kept + dec_in + [enc_grad]
                                                                   + self._recomputed(run, dec, True))
        if 0 < ke < Le:  # the same in the encoder, the decoder done
            moments["last checkpointed encoder block backward"] = (batch + enc_in + [enc_grad]
                                                                   + self._recomputed(run, enc, False))
        notes = []
        if self.dropout_rate > 0 or run.lora_dropout > 0:
            notes.append(f"dropout_rate={self.dropout_rate}, lora_dropout={run.lora_dropout}: dropout masks counted "
                         f"({run.mask_bytes(1)} B per element on {run.device})")
        return moments, notes


def _t5_input(name: str) -> str:
    """Which activation a T5 block linear reads (`layer.1.EncDecAttention.k` -> the encoder output)."""
    leaf = name.rsplit(".", 1)[-1]
    if "DenseReluDense" in name:
        return "ff" if leaf == "wo" else "h_ff"
    cross = "EncDecAttention" in name
    if leaf == "o":
        return "attn_ca" if cross else "attn_sa"
    if cross:
        return "h_ca" if leaf == "q" else "enc"
    return "h_sa"
