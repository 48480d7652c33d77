"""ImageReward (Xu et al. 2023, NeurIPS, arXiv 2304.05977): a human-preference reward for text-to-image.

The model is BLIP (a ViT-L/16 image encoder and a BERT-base text encoder whose layers cross-attend to
the image tokens, Salesforce BLIP's `med.py`) followed by an MLP on the text encoder's output at
position 0:

    image_embeds = ViT(pixels)                                 [N, 1 + (224/16)^2, 1024]
    feature      = BERT(prompt tokens, cross-attending image)[:, 0]         [N, 768]
    score        = (MLP(feature) - 0.16717362830052426) / 1.0333394966054072

exactly as `ImageReward.score` / `ImageReward.inference_rank` compute it (THUDM/ImageReward,
`ImageReward/ImageReward.py`); the mean/std are that file's constants. The MLP is
Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64), Dropout(0.1),
Linear(64, 16), Linear(16, 1), with no activations (the ReLUs are commented out upstream).

Loading. The official `image-reward` package pins old timm / fairscale and ships its own BLIP copy, so
the official weights (`ImageReward.pt` + `med_config.json` from the hub repo `THUDM/ImageReward`) are
loaded instead into transformers' maintained BLIP classes: `BlipVisionModel` for the timm-style ViT
and `BlipTextModel` (built with `is_decoder=True` so each layer has its cross-attention, run with
`is_decoder=False`, i.e. bidirectional self-attention: BLIP's "multimodal" encoder mode), plus a plain
`nn.Sequential` head whose indices match `mlp.layers.*`. `imagereward_to_transformers` renames the
keys (the timm -> transformers renames of transformers' `convert_blip_original_pytorch_to_hf.py`) and
fails on any missing or unknown key, unlike upstream's `load_state_dict(strict=False)`. Known unused
entries are dropped: the contrastive projections `blip.vision_proj` / `blip.text_proj` and the
`position_ids` buffer.

Sizes. The text sizes come from `med_config.json` (its `encoder_width` is ignored: BLIP overrides it
with the vision width). The vision sizes are read off the checkpoint's tensor shapes (width from
`cls_token`, patch size from the patch conv, image size from `pos_embed`: 197 positions = 224 px at
patch 16, depth from the block count), so a tiny checkpoint loads through the same path; the head
count is width / 64 (ViT's 64-wide heads: ViT-L has 1024 / 64 = 16), as no tensor shape records it.
The MLP sizes are read off its weights as well.

Inputs, as upstream: prompts tokenised by `bert-base-uncased` plus BLIP's `init_tokenizer` special
tokens (`[DEC]` as bos, `[ENC]` as an additional token), padded/truncated to 35 tokens. Position 0
keeps [CLS]: `ImageReward.score` does not swap in `[ENC]` (BLIP's ITM head does; ImageReward was
trained and is scored without that swap). Images: Resize(224, bicubic) of the short side, CenterCrop
224, RGB, ToTensor, Normalize with the OpenAI CLIP mean/std, re-implemented on PIL (torchvision's
integer rounding included) because torchvision is not a dependency.

Differences: scores are batched (upstream runs one image at a time; results agree to float
round-off); with `dtype="bfloat16"` the encoders run in bf16 but the head always runs in float32.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from glm_training.rewards.registry import Reward, register_reward, reward_device, reward_dtype

# `ImageReward.__init__` constants: the raw head output's mean and std over ImageReward's data.
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
# OpenAI CLIP's normalisation, which ImageReward's `_transform` uses.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_PROMPT_TOKENS = 35
CHECKPOINT_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
VIT_HEAD_DIM = 64
VIT_LAYER_NORM_EPS = 1e-6  # BLIP's ViT: partial(nn.LayerNorm, eps=1e-6)
# nn.Sequential indices of the head's Linear layers (the Dropouts sit at 1, 3 and 5).
MLP_LINEAR_INDICES = (0, 2, 4, 6, 7)
MLP_DROPOUTS = {1: 0.2, 3: 0.2, 5: 0.1}

_VISION_PREFIX = "blip.visual_encoder."
_TEXT_PREFIX = "blip.text_encoder."
_MLP_PREFIX = "mlp.layers."
# Entries of ImageReward.pt that the score never reads.
_IGNORED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
_IGNORED_KEYS = (_TEXT_PREFIX + "embeddings.position_ids",)

_VISION_TOP_RENAMES = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK_RENAMES = {
    f"{timm}.{param}": f"{hf}.{param}"
    for timm, hf in (
        ("norm1", "layer_norm1"),
        ("attn.qkv", "self_attn.qkv"),
        ("attn.proj", "self_attn.projection"),
        ("norm2", "layer_norm2"),
        ("mlp.fc1", "mlp.fc1"),
        ("mlp.fc2", "mlp.fc2"),
    )
    for param in ("weight", "bias")
}
_TEXT_TOP_KEYS = (
    "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight",
    "embeddings.LayerNorm.weight",
    "embeddings.LayerNorm.bias",
)
# med.py's BertLayer and transformers' BlipTextLayer share their parameter names.
_TEXT_LAYER_KEYS = tuple(
    f"{module}.{param}"
    for module in (
        *(
            f"{attention}.{part}"
            for attention in ("attention", "crossattention")
            for part in ("self.query", "self.key", "self.value", "output.dense", "output.LayerNorm")
        ),
        "intermediate.dense",
        "output.dense",
        "output.LayerNorm",
    )
    for param in ("weight", "bias")
)
_BLOCK_KEY = re.compile(r"(blocks|encoder\.layer)\.(\d+)\.(.+)")


def _split_block_key(key: str, container: str) -> tuple[int, str] | None:
    """(index, suffix) for `<container>.<index>.<suffix>`, else None."""
    match = _BLOCK_KEY.fullmatch(key)
    if match is None or match.group(1) != container:
        return None
    return int(match.group(2)), match.group(3)


def _format_keys(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def imagereward_to_transformers(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split an official `ImageReward.pt` state dict into transformers-named parts.

    Returns `(vision_sd, text_sd, mlp_sd)`, loadable with `strict=True` into `BlipVisionModel`,
    `BlipTextModel(add_pooling_layer=False)` and the head `nn.Sequential` (keys `0.weight` ...).
    Raises ValueError listing every unknown key and every key missing from the blocks/layers present
    (block indices must run 0..depth-1), so a truncated or foreign checkpoint fails before loading.
    """
    vision_sd: dict[str, torch.Tensor] = {}
    text_sd: dict[str, torch.Tensor] = {}
    mlp_sd: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    vision_blocks: set[int] = set()
    text_layers: set[int] = set()
    for key, tensor in state_dict.items():
        if key in _IGNORED_KEYS or key.startswith(_IGNORED_PREFIXES):
            continue
        if key.startswith(_VISION_PREFIX):
            name = key[len(_VISION_PREFIX) :]
            block = _split_block_key(name, "blocks")
            if name in _VISION_TOP_RENAMES:
                vision_sd[_VISION_TOP_RENAMES[name]] = tensor
            elif block is not None and block[1] in _VISION_BLOCK_RENAMES:
                vision_sd[f"encoder.layers.{block[0]}.{_VISION_BLOCK_RENAMES[block[1]]}"] = tensor
                vision_blocks.add(block[0])
            else:
                unknown.append(key)
        elif key.startswith(_TEXT_PREFIX):
            name = key[len(_TEXT_PREFIX) :]
            layer = _split_block_key(name, "encoder.layer")
            if name in _TEXT_TOP_KEYS:
                text_sd[name] = tensor
            elif layer is not None and layer[1] in _TEXT_LAYER_KEYS:
                text_sd[name] = tensor
                text_layers.add(layer[0])
            else:
                unknown.append(key)
        elif key.startswith(_MLP_PREFIX):
            name = key[len(_MLP_PREFIX) :]
            index, _, param = name.partition(".")
            if index.isdigit() and int(index) in MLP_LINEAR_INDICES and param in ("weight", "bias"):
                mlp_sd[name] = tensor
            else:
                unknown.append(key)
        else:
            unknown.append(key)

    # Every block up to the deepest one present must be complete (at least one of each).
    num_blocks = max(vision_blocks, default=0) + 1
    num_layers = max(text_layers, default=0) + 1
    expected = [_VISION_PREFIX + name for name in _VISION_TOP_RENAMES]
    expected += [
        f"{_VISION_PREFIX}blocks.{i}.{name}" for i in range(num_blocks) for name in _VISION_BLOCK_RENAMES
    ]
    expected += [_TEXT_PREFIX + name for name in _TEXT_TOP_KEYS]
    expected += [
        f"{_TEXT_PREFIX}encoder.layer.{i}.{name}" for i in range(num_layers) for name in _TEXT_LAYER_KEYS
    ]
    expected += [f"{_MLP_PREFIX}{i}.{param}" for i in MLP_LINEAR_INDICES for param in ("weight", "bias")]
    missing = [key for key in expected if key not in state_dict]
    if unknown or missing:
        raise ValueError(
            "not an ImageReward checkpoint in the official layout (THUDM/ImageReward ImageReward.pt): "
            f"missing keys [{_format_keys(missing)}]; unknown keys [{_format_keys(sorted(unknown))}]. "
            "Pass the folder or hub repo holding the original, unmodified ImageReward.pt."
        )
    return vision_sd, text_sd, mlp_sd


def vision_config_from_state_dict(vision_sd: dict[str, torch.Tensor]) -> Any:
    """`BlipVisionConfig` of the ViT whose transformers-named weights are `vision_sd`.

    Width, patch size, image size, depth and MLP width are read off the tensor shapes; the head count
    is width / 64 (ViT's head width) and LayerNorm eps is BLIP ViT's 1e-6.
    """
    from transformers import BlipVisionConfig

    hidden_size = vision_sd["embeddings.class_embedding"].shape[-1]
    patch_size = vision_sd["embeddings.patch_embedding.weight"].shape[-1]
    num_positions = vision_sd["embeddings.position_embedding"].shape[1]
    grid = math.isqrt(num_positions - 1)
    if grid * grid != num_positions - 1:
        raise ValueError(
            f"ImageReward pos_embed has {num_positions} positions, not 1 + a square grid of patches; "
            "the checkpoint is not a square-image ViT"
        )
    if hidden_size % VIT_HEAD_DIM:
        raise ValueError(
            f"ImageReward ViT width {hidden_size} is not a multiple of {VIT_HEAD_DIM}, the head width the "
            "head count is derived from; the checkpoint is not a standard ViT"
        )
    num_layers = 1 + max(int(key.split(".")[2]) for key in vision_sd if key.startswith("encoder.layers."))
    return BlipVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=vision_sd["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // VIT_HEAD_DIM,
        image_size=grid * patch_size,
        patch_size=patch_size,
        hidden_act="gelu",  # nn.GELU (erf form), as timm's ViT
        layer_norm_eps=VIT_LAYER_NORM_EPS,
        attention_dropout=0.0,
    )


def text_config_from_med_config(med_config: dict[str, Any], encoder_hidden_size: int) -> Any:
    """`BlipTextConfig` for BLIP's `med.py` BERT described by `med_config` (a BertConfig dict).

    `encoder_hidden_size` is the ViT width; `med_config["encoder_width"]` is ignored because
    BLIP_Pretrain overwrites it with the vision width.
    """
    from transformers import BlipTextConfig

    if not med_config.get("add_cross_attention", False):
        raise ValueError(
            "med_config.json has no `add_cross_attention: true`; ImageReward's text encoder cross-attends "
            "to the image, so this is not an ImageReward med_config.json"
        )
    if med_config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"med_config.json position_embedding_type={med_config['position_embedding_type']!r} is not "
            "supported; ImageReward uses 'absolute'"
        )
    try:
        return BlipTextConfig(
            vocab_size=med_config["vocab_size"],
            hidden_size=med_config["hidden_size"],
            encoder_hidden_size=encoder_hidden_size,
            intermediate_size=med_config["intermediate_size"],
            num_hidden_layers=med_config["num_hidden_layers"],
            num_attention_heads=med_config["num_attention_heads"],
            max_position_embeddings=med_config["max_position_embeddings"],
            hidden_act=med_config.get("hidden_act", "gelu"),
            layer_norm_eps=med_config.get("layer_norm_eps", 1e-12),
            pad_token_id=med_config.get("pad_token_id", 0),
            # Generation-only ids (BlipTextConfig's defaults are bert-base-uncased's): unused by the score.
            bos_token_id=None,
            eos_token_id=None,
            sep_token_id=None,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            is_decoder=True,  # builds the cross-attention layers; forward runs with is_decoder=False
            use_cache=False,
        )
    except KeyError as err:
        raise ValueError(
            f"med_config.json lacks {err.args[0]!r}; use the file from THUDM/ImageReward"
        ) from None


def mlp_head_from_state_dict(mlp_sd: dict[str, torch.Tensor]) -> nn.Sequential:
    """ImageReward's head (Linear/Dropout chain, no activations) sized from and loaded with `mlp_sd`."""
    layers: list[nn.Module] = []
    in_features = mlp_sd["0.weight"].shape[1]
    for index in range(max(MLP_LINEAR_INDICES) + 1):
        if index in MLP_DROPOUTS:
            layers.append(nn.Dropout(MLP_DROPOUTS[index]))
            continue
        out_features, fan_in = mlp_sd[f"{index}.weight"].shape
        if fan_in != in_features:
            raise ValueError(
                f"ImageReward mlp.layers.{index}.weight takes {fan_in} inputs but the previous layer gives "
                f"{in_features}; the head weights are inconsistent"
            )
        layers.append(nn.Linear(in_features, out_features))
        in_features = out_features
    if in_features != 1:
        raise ValueError(f"ImageReward head must end in one output, its last layer gives {in_features}")
    head = nn.Sequential(*layers)
    head.load_state_dict(mlp_sd, strict=True)
    return head.eval()


def normalize_imagereward(raw_n: torch.Tensor) -> torch.Tensor:
    """(raw - mean) / std with ImageReward's constants; `raw_n` is the head output, shape [N]."""
    return (raw_n - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


def imagereward_preprocess(images: list[Image.Image], image_size: int) -> torch.Tensor:
    """ImageReward's `_transform(image_size)` on PIL: float32 `pixel_values_n3hw`, H = W = image_size.

    Resize the short side to `image_size` (bicubic; long side `int(size * long / short)`), center crop
    with torchvision's offsets `int(round((side - size) / 2))`, convert to RGB (after the crop, as
    upstream), scale to [0, 1], normalise with the OpenAI CLIP mean/std.
    """
    arrays = []
    for image in images:
        width, height = image.size
        short, long = min(width, height), max(width, height)
        new_long = int(image_size * long / short)
        new_size = (image_size, new_long) if width <= height else (new_long, image_size)
        image = image.resize(new_size, Image.Resampling.BICUBIC)
        left = int(round((new_size[0] - image_size) / 2.0))
        top = int(round((new_size[1] - image_size) / 2.0))
        image = image.crop((left, top, left + image_size, top + image_size)).convert("RGB")
        arrays.append(np.asarray(image, dtype=np.float32) / np.float32(255.0))
    pixels_nhwc = torch.from_numpy(np.stack(arrays))
    mean = torch.tensor(CLIP_MEAN, dtype=torch.float32)
    std = torch.tensor(CLIP_STD, dtype=torch.float32)
    return ((pixels_nhwc - mean) / std).permute(0, 3, 1, 2).contiguous()


def imagereward_tokenizer(name_or_path: str) -> Any:
    """BERT WordPiece tokenizer with BLIP's `init_tokenizer` additions: `[DEC]` bos, `[ENC]` extra token."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(name_or_path)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def resolve_imagereward_files(model: str) -> tuple[Path, Path]:
    """Paths of (`ImageReward.pt`, `med_config.json`) in the local folder or hub repo `model`.

    A path to the `ImageReward.pt` file itself (as the official `load()` accepts) means its folder.
    """
    if os.path.isfile(model) and Path(model).name == CHECKPOINT_FILE:
        model = str(Path(model).parent)
    if os.path.isdir(model):
        paths = (Path(model) / CHECKPOINT_FILE, Path(model) / MED_CONFIG_FILE)
        absent = [path.name for path in paths if not path.is_file()]
        if absent:
            raise FileNotFoundError(
                f"ImageReward folder {model} lacks {absent}; it needs {CHECKPOINT_FILE} and "
                f"{MED_CONFIG_FILE} (both from the hub repo THUDM/ImageReward)"
            )
        return paths
    from huggingface_hub import hf_hub_download

    try:
        return tuple(Path(hf_hub_download(model, name)) for name in (CHECKPOINT_FILE, MED_CONFIG_FILE))
    except Exception as err:  # offline, unknown repo, bad id: each has its own huggingface_hub type
        raise OSError(
            f"could not get {CHECKPOINT_FILE} and {MED_CONFIG_FILE} from hub repo {model!r} "
            f"({type(err).__name__}: {err}); set `model` to a local folder holding both files, or "
            "download THUDM/ImageReward into the hub cache first"
        ) from err


@register_reward("imagereward")
class ImageRewardScorer(Reward):
    """ImageReward human-preference score, normalised as upstream (roughly zero mean, unit std).

    Args:
        model: hub repo id or local folder holding `ImageReward.pt` and `med_config.json`.
        tokenizer: hub id or local folder of the BERT WordPiece tokenizer (upstream: bert-base-uncased).
        device: "auto" (this rank's device), "cpu" or "cuda:N".
        dtype: weight dtype of the two encoders ("float32", "bfloat16", "float16"); the head is float32.
        batch_size: images per forward pass.
    """

    approx_params = 447_000_000  # BLIP ViT-L + BERT: the memory plan's figure
    retryable = True  # a transient failure (CUDA OOM, a busy device) is retried: reward.max_retries

    def __init__(
        self,
        model: str = "THUDM/ImageReward",
        tokenizer: str = "bert-base-uncased",
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"imagereward batch_size must be >= 1, got {batch_size}")
        from transformers import BlipTextModel, BlipVisionModel
        from transformers.initialization import no_init_weights

        self.device = reward_device(device)
        self.dtype = reward_dtype(dtype)
        self.batch_size = batch_size

        checkpoint_path, med_config_path = resolve_imagereward_files(model)
        state_dict = torch.load(checkpoint_path, weights_only=True, map_location="cpu")
        vision_sd, text_sd, mlp_sd = imagereward_to_transformers(state_dict)
        vision_config = vision_config_from_state_dict(vision_sd)
        med_config = json.loads(med_config_path.read_text())
        text_config = text_config_from_med_config(med_config, vision_config.hidden_size)
        self.image_size: int = vision_config.image_size

        self.tokenizer = imagereward_tokenizer(tokenizer)
        if len(self.tokenizer) > text_config.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer!r} has {len(self.tokenizer)} tokens with [DEC]/[ENC] but the "
                f"ImageReward text encoder embeds {text_config.vocab_size}; use bert-base-uncased (or a "
                "local copy of it)"
            )

        # Every parameter is overwritten by the strict loads below: skip the random init (seconds for ViT-L).
        with no_init_weights():
            self.vision = BlipVisionModel(vision_config)
            self.text = BlipTextModel(text_config, add_pooling_layer=False)
        try:
            self.vision.load_state_dict(vision_sd, strict=True)
            self.text.load_state_dict(text_sd, strict=True)
        except RuntimeError as err:
            raise ValueError(
                f"{checkpoint_path} does not fit the model built from its shapes and {med_config_path}: "
                f"{err}. Use the ImageReward.pt and med_config.json of the same ImageReward release."
            ) from None
        self.vision.to(self.device, self.dtype).eval()
        self.text.to(self.device, self.dtype).eval()
        self.head = mlp_head_from_state_dict(mlp_sd).to(self.device)
        if self.head[0].in_features != text_config.hidden_size:
            raise ValueError(
                f"ImageReward head takes {self.head[0].in_features} features but the text encoder is "
                f"{text_config.hidden_size} wide; checkpoint and med_config.json do not match"
            )

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(`input_ids_nl`, `attention_mask_nl`), L = 35, as `ImageReward.score` tokenises."""
        encoded = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt"
        )
        return encoded.input_ids, encoded.attention_mask

    @torch.no_grad()
    def score_inputs(
        self, pixel_values_n3hw: torch.Tensor, input_ids_nl: torch.Tensor, attention_mask_nl: torch.Tensor
    ) -> torch.Tensor:
        """Normalised scores, float32 [N] on the model device, of preprocessed images and token ids."""
        pixel_values_n3hw = pixel_values_n3hw.to(self.device, self.dtype)
        image_embeds_ntd = self.vision(pixel_values=pixel_values_n3hw).last_hidden_state
        # No encoder_attention_mask: every image token is valid (upstream passes all ones).
        text_output = self.text(
            input_ids=input_ids_nl.to(self.device),
            attention_mask=attention_mask_nl.to(self.device),
            encoder_hidden_states=image_embeds_ntd,
            is_decoder=False,
        )
        features_nd = text_output.last_hidden_state[:, 0, :].float()
        return normalize_imagereward(self.head(features_nd).squeeze(-1))

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        if not len(images) == len(prompts) == len(metadata):
            raise ValueError(
                f"imagereward got {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata"
            )
        scores = []
        for start in range(0, len(images), self.batch_size):
            stop = start + self.batch_size
            pixel_values_n3hw = imagereward_preprocess(images[start:stop], self.image_size)
            input_ids_nl, attention_mask_nl = self.tokenize(prompts[start:stop])
            scores.append(self.score_inputs(pixel_values_n3hw, input_ids_nl, attention_mask_nl).cpu())
        if not scores:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat(scores)
