"""Random Hugging Face Llama checkpoints written with `save_pretrained`, for tests."""

import json

import numpy as np

SPECIALS = ["<unk>", "<s>", "</s>"]
WORDS = [f"w{i}" for i in range(40)]


def make_hf_model(tmp_path, *, heads=4, kv_heads=4, tie=False, rope_scaling=None,
                  layers=2, hidden=64, vocab=300, seed=0, shard_size=None):
    """Saves a random LlamaForCausalLM; every tensor (norms too) perturbed so a wrong
    mapping shows. Returns (directory, the torch model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 16,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1,
                  eos_token_id=2, rope_theta=10000.0)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = {"rope_type": "llama3", **rope_scaling}
        kwargs["rope_theta"] = 500000.0
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.15 * torch.randn_like(p))
    out = tmp_path / f"hf-{seed}"
    save_kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(out, **save_kwargs)
    return out, model


def write_tokenizer_json(directory):
    """A small word-level tokenizer.json with a BOS-adding post-processor, like Llama's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def read_json(path):
    return json.loads(path.read_text())


def random_ids(seed, n, vocab):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()
