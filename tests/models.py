"""Tiny stock HF models of every supported architecture, with randomised configs.

Hypothesis strategies draw configs that cover every option the adapters must respect; models
are perturbed away from their init (non-unit gains, non-zero biases) so that folding and
centring are really exercised.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers as tf
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lmc.canonical.exactness import (  # noqa: F401  (re-exported for tests)
    float64_rmsnorm,
    relative_error,
    sample_inputs,
    tiny_configs,
)

#: Every registered family, by the model type its tiny config has: the suites parametrised over it
#: test a family as soon as its adapter is registered (hf_lmc.canonical.adapters.ADAPTERS).
ARCHITECTURES = tuple(tiny_configs())


@st.composite
def gpt2_configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    return tf.GPT2Config(
        n_embd=heads * draw(st.sampled_from([2, 4, 6])),
        n_head=heads,
        n_layer=draw(st.integers(1, 3)),
        n_inner=draw(st.sampled_from([None, 12, 20])),
        vocab_size=draw(st.integers(5, 40)),
        n_positions=16,
        activation_function=draw(st.sampled_from(["gelu_new", "relu", "gelu"])),
        scale_attn_weights=draw(st.booleans()),
        scale_attn_by_inverse_layer_idx=draw(st.booleans()),
        layer_norm_epsilon=draw(st.sampled_from([1e-5, 1e-2])),
        tie_word_embeddings=draw(st.booleans()),
        bos_token_id=0,
        eos_token_id=0,
    )


@st.composite
def gpt_neox_configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    # (head_dim, rotary_pct) pairs with an even number of rotary dims, partial and full.
    head_dim, rotary_pct = draw(st.sampled_from([(8, 0.25), (8, 0.5), (4, 0.5), (4, 1.0), (8, 1.0)]))
    return tf.GPTNeoXConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_hidden_layers=draw(st.integers(1, 3)),
        intermediate_size=draw(st.sampled_from([8, 24])),
        vocab_size=draw(st.integers(5, 40)),
        max_position_embeddings=32,
        rotary_pct=rotary_pct,
        rotary_emb_base=draw(st.sampled_from([10000, 100])),
        use_parallel_residual=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        layer_norm_eps=draw(st.sampled_from([1e-5, 1e-2])),
        bos_token_id=0,
        eos_token_id=0,
    )


@st.composite
def llama_configs(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([2, 4, 6]))
    explicit_head_dim = draw(st.booleans())
    # An explicit head_dim decouples heads * head_dim from hidden_size (which HF still
    # requires to be a multiple of the number of heads).
    hidden = heads * (draw(st.sampled_from([2, 4, 6])) if explicit_head_dim else head_dim)
    return tf.LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim if explicit_head_dim else None,
        num_hidden_layers=draw(st.integers(1, 3)),
        intermediate_size=draw(st.sampled_from([8, 20])),
        vocab_size=draw(st.integers(5, 40)),
        max_position_embeddings=32,
        attention_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-2])),
        rope_parameters=draw(
            st.sampled_from(
                [
                    {"rope_type": "default", "rope_theta": 10000.0},
                    {"rope_type": "default", "rope_theta": 500.0},
                    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 16},
                ]
            ).map(dict)  # a fresh dict each time: configs update it in place
        ),
        bos_token_id=0,
        eos_token_id=0,
    )


@st.composite
def vit_configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    patch = draw(st.sampled_from([2, 4]))
    return tf.ViTConfig(
        hidden_size=heads * draw(st.sampled_from([2, 4])),
        num_attention_heads=heads,
        num_hidden_layers=draw(st.integers(1, 3)),
        intermediate_size=draw(st.sampled_from([8, 20])),
        image_size=patch * draw(st.sampled_from([2, 3])),
        patch_size=patch,
        num_channels=draw(st.sampled_from([1, 3])),
        num_labels=draw(st.integers(2, 10)),
        qkv_bias=draw(st.booleans()),
        layer_norm_eps=draw(st.sampled_from([1e-12, 1e-2])),
        hidden_act=draw(st.sampled_from(["gelu", "relu"])),
    )


CONFIGS = {"gpt2": gpt2_configs, "gpt_neox": gpt_neox_configs, "llama": llama_configs, "vit": vit_configs}
MODEL_CLASSES = {
    "gpt2": tf.GPT2LMHeadModel,
    "gpt_neox": tf.GPTNeoXForCausalLM,
    "llama": tf.LlamaForCausalLM,
    "vit": tf.ViTForImageClassification,
}


def build_model(config, seed: int = 0, dtype=torch.float64):
    """A stock model with every parameter moved away from its init."""
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.model_type](config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 1:  # a norm's gain
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.add_(0.3 * torch.randn_like(p))
    return model


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal LM's next-token loss from its logits, in their precision (the HF classes' ``.loss``
    is computed in float32 whatever the model's dtype, too coarse to hold float64 paths to)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def char_tokenizer_folder(folder, vocab_size):
    """A tiny character-level fast tokenizer saved like a real one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abc .\n")}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="."))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=".")
    fast.save_pretrained(folder)
    return folder


def transform_tensors(transform) -> dict[str, torch.Tensor]:
    """Every tensor of a :class:`hf_lmc.Transform`, by space and field path (for exact comparisons)."""
    return {f"{space}.{path}": value for space, element in transform.maps.items() for path, value in _fields(element)}


def _fields(element, prefix=""):
    for field in dataclasses.fields(element):
        value = getattr(element, field.name)
        if isinstance(value, torch.Tensor):
            yield prefix + field.name, value
        elif dataclasses.is_dataclass(value):
            yield from _fields(value, f"{prefix}{field.name}.")


def twin_folders(folder, arch: str, symmetry_seeds) -> tuple[object, list]:
    """A tiny ``arch`` model (seed 0) saved to ``folder/m0``, and the model moved by a random full
    symmetry per seed saved to ``m1``, ``m2``, ...: stock checkpoints whose merge computes it."""
    import hf_lmc
    from hf_lmc.canonical.exactness import tiny_configs

    model = build_model(tiny_configs()[arch], seed=0, dtype=torch.float32)
    canonical = hf_lmc.canonicalize(model)
    folders = [folder / "m0"]
    model.save_pretrained(folders[0])
    for k, seed in enumerate(symmetry_seeds, 1):
        twin = hf_lmc.to_hf(hf_lmc.random_symmetry(canonical.spec, seed=seed, dtype=torch.float32).apply(canonical))
        twin.save_pretrained(folder / f"m{k}")
        folders.append(folder / f"m{k}")
    return model, folders


def merged_error(folder, model) -> float:
    """Relative logit error of the checkpoint in ``folder`` against ``model`` (its stock class)."""
    merged = MODEL_CLASSES[model.config.model_type].from_pretrained(folder).eval()
    inputs = sample_inputs(model.config)
    return relative_error(logits(merged, inputs), logits(model, inputs))


class LargestOutput(TorchDispatchMode):
    """Records the most elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
