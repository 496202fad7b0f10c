"""Tiny random model pairs for tests and smoke runs: built in seconds, saved in Hugging Face
format so they take exactly the loading path a user's own models take."""

from __future__ import annotations

from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"


def byte_tokenizer(extra_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer with no merges: 256 byte tokens, then EOS (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(sorted(alphabet))}
    for token in (EOS_TOKEN, *extra_tokens):
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def llama_config(vocab_size: int, hidden: int, layers: int, max_positions: int = 512):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=256,
        bos_token_id=256,
        pad_token_id=256,
        tie_word_embeddings=False,
    )


def save_pair(
    directory: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    draft_layers: int = 1,
    sharpness: float = 20.0,
    late_layer_scale: float = 0.5,
    seed: int = 0,
    mismatched: bool = False,
    max_positions: int = 512,
) -> tuple[Path, Path]:
    """A random target and a draft made of the target's first draft_layers layers, so the two
    agree often but not always. sharpness scales the output layer so that a few tokens hold
    most of the mass, as in trained models; late_layer_scale shrinks what the target's later
    layers add, which raises agreement (0.5 gives ~0.6 greedy agreement and ~0.8 overlap
    sum(min(p, q)) at temperature 1). mismatched gives the draft another vocabulary."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = byte_tokenizer()
    target = LlamaForCausalLM(llama_config(len(tokenizer), hidden, layers, max_positions)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpness)
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(late_layer_scale)
            layer.mlp.down_proj.weight.mul_(late_layer_scale)
    target_dir, draft_dir = directory / "target", directory / "draft"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)

    draft_tokenizer = byte_tokenizer(("<|extra|>",)) if mismatched else tokenizer
    draft = LlamaForCausalLM(llama_config(len(draft_tokenizer), hidden, draft_layers, max_positions)).eval()
    if not mismatched:
        own = draft.state_dict()
        draft.load_state_dict({name: target.state_dict()[name] for name in own})
    draft.save_pretrained(draft_dir)
    draft_tokenizer.save_pretrained(draft_dir)
    return target_dir, draft_dir
