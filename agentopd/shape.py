"""A model's shape: what the memory plan and the FLOPs count read of a model, one record with one parameter count.

    shape = ModelShape.from_ref(ref)              # a folder's config.json (a hub id's through transformers' cache)
    shape = ModelShape.from_hf_config(cfg_json)   # a config.json as a dict; ModelShape.of_model(module) for a loaded model
    shape.params                                  # every parameter: the embedding table once when tied, the head when not
    shape.compute_params                          # what runs at every token (agentopd.flops): params less the input table

The count is arithmetic over config.json (no weights, no meta-device build), for the decoder every run here trains
and serves (Qwen3: attention with q/k norms, SwiGLU MLP, two norms a layer, a final norm); another architecture is
approximated by the same formula (no biases). `of_model` reads the same fields from a loaded model's config, so a
model has one count wherever it is asked for. agentopd.memory_plan sizes memory with `params`; agentopd.flops
counts compute with `compute_params`, `layers` and `q` (heads x head_dim).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TRAIN_FACTOR = 3  # forward + backward = 3 forwards


@dataclass(frozen=True)
class ModelShape:
    """A decoder's config.json fields (L layers, H hidden, heads, kv heads, head_dim, I intermediate, V vocab rows)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> ModelShape:
        c = c.get("text_config", c)
        heads = int(c["num_attention_heads"])
        return cls(layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                   intermediate=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
                   tied=bool(c.get("tie_word_embeddings", False)))  # fmt: skip

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_ref(cls, ref: str | Path) -> ModelShape:
        """A model folder's config.json, or a hub id's config through transformers' cache."""
        return cls.from_hf_config(config_of(ref))

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> ModelShape:
        """The shape of a loaded causal LM (a transformers PreTrainedModel): its config's, counted the same way."""
        return cls.from_hf_config(model.config.to_dict())

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params(self) -> int:
        """Decoder (attention with q/k norms, SwiGLU MLP, two norms a layer) + final norm + embeddings (+ head)."""
        h = self.hidden
        layer = 2 * h * self.q + 2 * h * self.kv + 2 * self.head_dim + 3 * h * self.intermediate + 2 * h
        return self.layers * layer + h + self.vocab * h * (1 if self.tied else 2)

    @property
    def linear_params(self) -> int:
        """The decoder layers' projections (q, k, v, o; gate, up, down): what teacher.linear_dtype=fp8 holds in one byte."""
        h = self.hidden
        return self.layers * (2 * h * self.q + 2 * h * self.kv + 3 * h * self.intermediate)

    @property
    def compute_params(self) -> int:
        """N of agentopd.flops: every parameter but the input embedding table, with the output head's V x H (its matmul
        runs at every position, tied to the embedding or not)."""
        return self.params if self.tied else self.params - self.vocab * self.hidden

    # ---- memory (agentopd.memory_plan) ----
    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv * element_bytes  # K and V, bf16 (fp8: 1 byte; KVPool.bytes_per_token)

    def layer_activation_bytes(self, residual_bytes: int) -> int:
        """a (agentopd.memory_plan's docstring): what backward keeps per token of one decoder layer."""
        return 2 * residual_bytes * self.hidden + 4 * self.hidden + 6 * self.q + 6 * self.kv + 8 * self.intermediate

    # ---- compute (agentopd.flops) ----
    def forward(self, length: int, start: int = 0) -> float:
        """FLOPs of the positions start..length-1 of one causal sequence (positions before `start` in a KV cache)."""
        assert 0 <= start <= length, (start, length)
        n = length - start
        keys = (length * (length + 1) - start * (start + 1)) // 2  # sum of (p + 1) over p in [start, length)
        return float(2 * self.compute_params * n + 4 * self.layers * self.q * keys)

    def forwards(self, lengths: Iterable[int]) -> float:
        return sum(self.forward(n) for n in lengths)

    def train(self, length: int) -> float:
        return TRAIN_FACTOR * self.forward(length)


def config_of(ref: str | Path) -> dict[str, Any]:
    """A model folder's config.json as a dict, or a hub id's config through transformers' cache."""
    if Path(ref).is_dir():
        return json.loads((Path(ref) / "config.json").read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(ref)).to_dict()


def stored_in_bf16(ref: str | Path) -> bool:
    """Is the checkpoint stored in bf16 (real ones, an imported GGUF; the embedded models are fp32)? Where it is, an
    engine or a teacher on a CPU holds it so (RunContext.inference_dtype, agentopd.memory_host)."""
    config = config_of(ref)
    return (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"
