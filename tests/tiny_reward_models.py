"""Tiny random reward models for offline tests: a CLIP (model, BPE tokenizer, PIL image processor).

Everything is built from configs with random weights and written with `save_pretrained`, so the
rewards under test load it through the real `from_pretrained` path, from real files, offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

# A few merges so multi-character tokens exist too; every merge result is in the vocabulary.
_TINY_MERGES = ("t h", "th e</w>", "c a", "ca t</w>", "d o", "do g</w>")
TINY_CLIP_MAX_LENGTH = 77


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode character table (byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _write_tiny_tokenizer_files(path: Path) -> tuple[int, int, int]:
    """Write vocab.json / merges.txt; returns (vocab_size, bos_id, eos_id)."""
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [char + "</w>" for char in alphabet]
    tokens += ["".join(merge.split()) for merge in _TINY_MERGES]
    # Specials last, as in OpenAI's CLIP (49406 / 49407): the eos id is then also the argmax id.
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(_TINY_MERGES) + "\n", encoding="utf-8")
    return len(vocab), vocab["<|startoftext|>"], vocab["<|endoftext|>"]


def save_tiny_clip(path: Path, *, seed: int = 0, projection_dim: int = 16, image_size: int = 32) -> Path:
    """Save a tiny random `CLIPModel` + `CLIPProcessor` (BPE tokenizer, PIL image processor) at `path`.

    `CLIPModel.from_pretrained(path)` and `CLIPProcessor.from_pretrained(path)` load it offline. The
    image processor resizes the short side to `image_size` and centre-crops `image_size` squares with
    the OpenAI CLIP mean/std; texts are padded/truncated to 77 tokens like the real CLIP.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size, bos_id, eos_id = _write_tiny_tokenizer_files(path)
    tokenizer = CLIPTokenizer.from_pretrained(path, model_max_length=TINY_CLIP_MAX_LENGTH)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)

    config = CLIPConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": TINY_CLIP_MAX_LENGTH,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": 8,
        },
        projection_dim=projection_dim,
    )
    torch.manual_seed(seed)
    CLIPModel(config).eval().save_pretrained(path)
    return path
