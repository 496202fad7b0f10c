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


def save_tiny_gguf(path: Path, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    """A random Llama GGUF file as llama.cpp's converter lays one out (needs the gguf package):
    Q4_1 layer matrices, a Q8_0 token embedding that the output shares, float32 norms, and a
    byte-level BPE vocabulary of 256 bytes, <|im_start|>, <|im_end|> (EOS) and one merge."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Quant
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = [*bytes_to_unicode().values(), "<|im_start|>", "<|im_end|>", "Ġt"]
    ffn, head_dim = 2 * hidden, hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 1])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)

    def matrix(name: str, rows: int, columns: int, quant=Quant.Q4_1) -> None:
        values = rng.standard_normal((rows, columns)).astype(np.float32) * 0.2
        writer.add_tensor(name, gguf.quants.quantize(values, quant), raw_dtype=quant)

    matrix("token_embd.weight", len(tokens), hidden, Quant.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        block = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"{block}{norm}.weight", np.ones(hidden, dtype=np.float32))
        for name, rows, columns in (
            ("attn_q", heads * head_dim, hidden),
            ("attn_k", kv_heads * head_dim, hidden),
            ("attn_v", kv_heads * head_dim, hidden),
            ("attn_output", hidden, heads * head_dim),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ):
            matrix(f"{block}{name}.weight", rows, columns)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
