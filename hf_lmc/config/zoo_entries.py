"""The zoo's entries: each small architecture's config and how its members are trained.

Declared apart from :mod:`hf_lmc.io.zoo` (which trains and caches members, with torch and
transformers) so that what only names an entry -- a recipe's ``zoo:NAME/seedK`` checked before
any work -- loads neither.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

DATA_VERSION = 1  # bump when the shipped corpus or its split changes: it is part of the cache key


@dataclass(frozen=True)
class ZooEntry:
    """One zoo architecture: its config and how a member is trained."""

    name: str
    model_type: str
    config: dict = field(hash=False)
    steps: int = 600
    batch_size: int = 32
    seq_len: int = 64
    lr: float = 3e-3
    warmup: int = 50
    data: str = "shakespeare"  # LMs: shakespeare; ViT: digits or mnist
    patience: int | None = None  # evaluations without improvement before stopping (None: train all steps)
    eval_every: int = 100  # steps between validation losses (with patience)
    vocab_size: int | None = None  # LMs: None reads characters; N a byte-level BPE of N tokens (lm_tokenizer)
    shift: int = 0  # ViT: each training image moved by up to this many pixels each way, drawn per image and step

    def scaled(self, **changes) -> ZooEntry:
        """A copy with some settings changed (e.g. fewer steps for a quick test)."""
        config = {**self.config, **changes.pop("config", {})}
        return dataclasses.replace(self, config=config, **changes)

    def key(self, seed: int) -> str:
        settings = dataclasses.asdict(self)
        for name in _LATER_FIELDS:  # fields added later enter the key only when set, so older caches stay valid
            if settings[name] == _FIELD_DEFAULTS[name]:
                del settings[name]
        blob = json.dumps([settings, seed, DATA_VERSION], sort_keys=True)
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}-seed{seed}"


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ZooEntry)}
_LATER_FIELDS = ("data", "patience", "eval_every", "vocab_size", "shift")

ZOO: dict[str, ZooEntry] = {
    "gpt2": ZooEntry(
        "gpt2",
        "gpt2",
        {
            "n_embd": 128,
            "n_layer": 4,
            "n_head": 4,
            "n_positions": 64,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
    "pythia": ZooEntry(
        "pythia",
        "gpt_neox",
        {
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "intermediate_size": 512,
            "rotary_pct": 0.25,
            "use_parallel_residual": True,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
        },
    ),
    "llama": ZooEntry(
        "llama",
        "llama",
        {
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 344,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
        },
    ),
    "vit": ZooEntry(
        "vit",
        "vit",
        {
            "image_size": 8,
            "patch_size": 2,
            "num_channels": 1,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "num_labels": 10,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
        },
        steps=800,
        batch_size=64,
        lr=2e-3,
    ),
}
