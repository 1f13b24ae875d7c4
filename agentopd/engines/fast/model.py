"""The fast engine's model runner: a Qwen3 / Qwen2 / Llama decoder stack over a flat token batch.

    runner = ModelRunner.from_hf(hf_model, device="cuda", dtype=torch.bfloat16)
    logits_SV = runner.forward(ids_N, batch, sample_idx_S)   # writes the batch's K/V into the page pool

The weights live in a few fused buffers per layer (QKV, gate|up) whose row slices are views
carrying the Hugging Face parameter names (`runner.params["model.layers.0.self_attn.q_proj.weight"]`),
so `load(state_dict)` copies new weights in place: captured CUDA graphs stay valid and nothing
is reallocated. The math follows transformers' modeling code op for op (fp32 RMSNorm, rotary
tables in fp32 cast to the model dtype, SDPA scale head_dim**-0.5), so an fp32 runner matches an
fp32 HF forward to rounding.

Attention reads K/V from the paged pool (`kv_cache.KVPool`) through `attention.paged_attention`
(torch reference on CPU, Triton on CUDA); `supports(config)` says whether a checkpoint's
architecture is one this runner implements (others fall back to the transformers engine).

Legend: N flat tokens of a step, S rows sampled, V vocabulary, Hq query heads, Hkv kv heads,
D head dim, E hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agentopd.engines.fast.attention import AttnBatch, paged_attention
from agentopd.engines.fast.kv_cache import store

ARCHITECTURES = ("qwen3", "qwen2", "llama")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load time


def supports(config: Any) -> str | None:
    """None when this runner implements `config`'s architecture, else why not (one line)."""
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} is not one of {ARCHITECTURES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "layers other than full attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE:
        return f"rope_type {rope_type!r} (position-dependent rotary frequencies)"
    return None


@dataclass
class Shape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    qk_norm: bool
    tied: bool


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in fp32, the product in the input dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x_NHD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    half = x_NHD.shape[-1] // 2
    rot = torch.cat((-x_NHD[..., half:], x_NHD[..., :half]), dim=-1)
    return x_NHD * cos_ND[:, None] + rot * sin_ND[:, None]


class ModelRunner:
    """Weights (fused buffers, HF-named views), rotary tables and the forward pass."""

    def __init__(self, shape: Shape, params: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor]],
                 inv_freq: torch.Tensor, rope_scale: float, max_len: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.shape, self.params, self.layers = shape, params, layers
        self.device, self.dtype = torch.device(device), dtype
        self.scale = shape.head_dim ** -0.5
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float().cpu()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_LD = (emb.cos() * rope_scale).to(device=self.device, dtype=dtype)
        self.sin_LD = (emb.sin() * rope_scale).to(device=self.device, dtype=dtype)
        self.embed = params["model.embed_tokens.weight"]
        self.norm = params["model.norm.weight"]
        self.lm_head = params["lm_head.weight"]
        self.k_cache: list[torch.Tensor] = []  # set by attach_cache: per layer [slots, Hkv, D]
        self.v_cache: list[torch.Tensor] = []
        from agentopd.engines.fast import triton_ops

        self.fused = self.device.type == "cuda" and triton_ops.available()  # Triton small-op kernels

    # ---- building -----------------------------------------------------------------------

    @classmethod
    def from_hf(cls, model: Any, *, device: Any, dtype: torch.dtype | None, max_len: int, share: bool = False) -> ModelRunner:
        """Copy a transformers model's weights into fused buffers on `device` (the model is not kept). With `share`
        the model keeps working on the same memory instead: its weights become the runner's (a tensor as it is, a
        fused one as a view into the fused buffer), one layer at a time, so one copy serves both (a teacher that
        plays and scores: agentopd.backends.teacher_weights) and the build never holds more than one extra layer.
        The model must already be on `device` in `dtype`."""
        why = supports(model.config)
        if why is not None:
            raise ValueError(f"the fast engine does not support this model: {why}")
        cfg = model.config
        sd = model.state_dict()
        dtype = dtype or next(iter(sd.values())).dtype
        if share:
            wrong = {f"{t.device}/{t.dtype}" for t in sd.values() if t.device != torch.device(device) or t.dtype != dtype}
            if wrong:
                raise ValueError(f"sharing a model's weights needs them on {device} in {dtype}, found {sorted(wrong)}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = Shape(
            layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, q_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, head_dim=head_dim, vocab=cfg.vocab_size, eps=cfg.rms_norm_eps,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in sd,
            tied="lm_head.weight" not in sd or sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr(),
        )
        params: dict[str, torch.Tensor] = {}
        layers = []

        def own(name: str) -> torch.Tensor:
            t = sd.pop(name) if share else sd[name].to(device=device, dtype=dtype).clone()
            params[name] = t
            return t

        def fused(names: list[str]) -> torch.Tensor:
            parts = [sd.pop(n) if share else sd[n] for n in names]
            buf = torch.cat(parts).to(device=device, dtype=dtype).contiguous()
            row = 0
            for n, p in zip(names, parts):
                params[n] = buf[row : row + p.shape[0]]  # a view: copy_ into it updates the fused buffer
                if share:  # the model's parameter now reads the view; its own storage goes with `parts`
                    model.get_parameter(n).data = params[n]
                row += p.shape[0]
            return buf

        own("model.embed_tokens.weight")
        own("model.norm.weight")
        if shape.tied:
            params["lm_head.weight"] = params["model.embed_tokens.weight"]
        else:
            own("lm_head.weight")
        for i in range(shape.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            layer = {
                "qkv": fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                "o": own(a + "o_proj.weight"),
                "gate_up": fused([m + "gate_proj.weight", m + "up_proj.weight"]),
                "down": own(m + "down_proj.weight"),
                "ln1": own(f"model.layers.{i}.input_layernorm.weight"),
                "ln2": own(f"model.layers.{i}.post_attention_layernorm.weight"),
            }
            if a + "q_proj.bias" in sd:
                layer["qkv_bias"] = fused([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
            if a + "o_proj.bias" in sd:
                layer["o_bias"] = own(a + "o_proj.bias")
            if shape.qk_norm:
                layer["q_norm"] = own(a + "q_norm.weight")
                layer["k_norm"] = own(a + "k_norm.weight")
            layers.append(layer)
        rotary = model.model.rotary_emb
        return cls(shape, params, layers, rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)),
                   max_len, device, dtype)

    def attach_cache(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    @torch.no_grad()
    def load(self, state_dict: dict[str, Any]) -> None:
        """Copy HF-named tensors into the weights in place (shapes must match; unknown names fail)."""
        unknown = sorted(set(state_dict) - set(self.params))
        if unknown:
            raise ValueError(f"update_weights: names not in the model's state_dict: {unknown[:5]}")
        for name, tensor in state_dict.items():
            own = self.params[name]
            if tuple(tensor.shape) != tuple(own.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, the model has {tuple(own.shape)}")
            own.copy_(tensor)

    # ---- the forward pass ---------------------------------------------------------------

    def forward(self, ids_N: torch.Tensor, batch: AttnBatch, sample_idx_S: torch.Tensor,
                out_SV: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the rows at `sample_idx_S` after running the flat batch (K/V written to the pool); into
        `out_SV` when given (captured graphs share one logits buffer)."""
        if self.fused:
            return self._logits(self._forward_fused(ids_N, batch, sample_idx_S), out_SV)
        s = self.shape
        n = ids_N.shape[0]
        cos_ND, sin_ND = self.cos_LD[batch.positions_N], self.sin_LD[batch.positions_N]
        h_NE = F.embedding(ids_N, self.embed)
        q_dim, kv_dim = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        for i, w in enumerate(self.layers):
            x_NE = rms_norm(h_NE, w["ln1"], s.eps)
            qkv = F.linear(x_NE, w["qkv"], w.get("qkv_bias"))
            q_NHD = qkv[:, :q_dim].view(n, s.q_heads, s.head_dim)
            k_NHD = qkv[:, q_dim : q_dim + kv_dim].view(n, s.kv_heads, s.head_dim)
            v_NHD = qkv[:, q_dim + kv_dim :].view(n, s.kv_heads, s.head_dim)
            if s.qk_norm:
                q_NHD = rms_norm(q_NHD, w["q_norm"], s.eps)
                k_NHD = rms_norm(k_NHD, w["k_norm"], s.eps)
            q_NHD = rotate(q_NHD, cos_ND, sin_ND)
            k_NHD = rotate(k_NHD, cos_ND, sin_ND)
            store(self.k_cache[i], batch.slots_N, k_NHD)
            store(self.v_cache[i], batch.slots_N, v_NHD)
            o_NHD = paged_attention(q_NHD, self.k_cache[i], self.v_cache[i], batch, self.scale)
            h_NE = h_NE + F.linear(o_NHD.reshape(n, q_dim), w["o"], w.get("o_bias"))
            x_NE = rms_norm(h_NE, w["ln2"], s.eps)
            gate, up = F.linear(x_NE, w["gate_up"]).chunk(2, dim=-1)
            h_NE = h_NE + F.linear(F.silu(gate) * up, w["down"])
        return self._logits(rms_norm(h_NE[sample_idx_S], self.norm, s.eps), out_SV)

    def _logits(self, h_SE: torch.Tensor, out_SV: torch.Tensor | None) -> torch.Tensor:
        logits_SV = F.linear(h_SE, self.lm_head)
        return logits_SV.float() if out_SV is None else out_SV.copy_(logits_SV)

    def _forward_fused(self, ids_N: torch.Tensor, batch: AttnBatch, sample_idx_S: torch.Tensor) -> torch.Tensor:
        """`forward` up to the final norm, with the small ops as fused Triton kernels (triton_ops.py): same math,
        ~10 launches a layer."""
        from agentopd.engines.fast import triton_ops as ops

        s = self.shape
        n = ids_N.shape[0]
        h_NE = F.embedding(ids_N, self.embed)
        x_NE = ops.rms_norm(h_NE, self.layers[0]["ln1"], s.eps)
        for i, w in enumerate(self.layers):
            qkv = F.linear(x_NE, w["qkv"], w.get("qkv_bias"))
            q_NHD = ops.qk_norm_rope_store(qkv, w.get("q_norm"), w.get("k_norm"), self.cos_LD, self.sin_LD,
                                           batch.positions_N, batch.slots_N, self.k_cache[i], self.v_cache[i],
                                           s.q_heads, s.kv_heads, s.eps)
            o_NHD = paged_attention(q_NHD, self.k_cache[i], self.v_cache[i], batch, self.scale)
            x_NE, h_NE = ops.add_rms_norm(F.linear(o_NHD.reshape(n, -1), w["o"], w.get("o_bias")), h_NE, w["ln2"], s.eps)
            down_NE = F.linear(ops.silu_mul(F.linear(x_NE, w["gate_up"])), w["down"])
            if i + 1 < len(self.layers):
                x_NE, h_NE = ops.add_rms_norm(down_NE, h_NE, self.layers[i + 1]["ln1"], s.eps)
        h_SE = h_NE[sample_idx_S] + down_NE[sample_idx_S]
        return ops.rms_norm(h_SE, self.norm, s.eps)
