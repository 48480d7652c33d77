"""HPSv2 / HPSv2.1 reward (Wu et al. 2023, "Human Preference Score v2", arXiv 2306.09341).

HPSv2 is an OpenCLIP ViT-H-14 (LAION-2B) fine-tuned on human preference pairs. Its score, as computed by
the official `hpsv2.img_score.score()`: `image_features @ text_features.T` on the diagonal, where both come
from open_clip's `CLIP.forward(..., output_dict=True)`, which L2-normalises them. So the score is the cosine
of image and prompt embeddings, without the logit scale (about 0.2-0.3 for typical generated images).

The official package needs `open_clip_torch` and torchvision; here the official checkpoint
(`HPS_v2.1_compressed.pt` or `HPS_v2_compressed.pt` in the hub repo `xswu/HPSv2`) is converted into a
`transformers.CLIPModel` (`glm_training.rewards.open_clip_convert`) and embedded with the project's
`ClipEmbedder`.

Preprocessing matches HPSv2's `preprocess_val`: `create_model_and_transforms(..., light_augmentation=True)`
builds open_clip's eval `image_transform(224, is_train=False, resize_longest_max=True)` with the OpenAI CLIP
mean/std, which is, in order: RGB, `ToTensor` (float in [0, 1]), `ResizeMaxSize` (bicubic resize of the
*float tensor* so the longest side is 224, each side `round(side * scale)`, then zero padding, split
`pad // 2` before and the rest after, to 224x224), normalisation. torchvision (>= 0.17) resizes tensors
with `interpolate(mode="bicubic", align_corners=False, antialias=True)` and no clamping for float input;
that is what `hpsv2_pixel_values` runs. An RGBA image is scored on its RGB channels (the official transform
keeps the alpha channel and then fails in the 3-channel model).

Texts: the tokenizer defaults to `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`'s `CLIPTokenizer`, the same BPE
vocabulary and merges as open_clip's `SimpleTokenizer` (<|startoftext|> 49406, <|endoftext|> 49407),
truncated to 77 tokens with the EOT kept last, as open_clip does. open_clip pads with id 0 and pools at
`argmax(ids)` (the EOT, the largest id); transformers pads with EOT and pools at the first EOT. Under the
causal mask the features at the EOT position do not depend on what follows it, so both pick the same
features. Text normalisation differs slightly: open_clip runs ftfy and HTML unescaping before collapsing
whitespace and lowercasing, which transformers' tokenizer does without the first two.

Options `checkpoint` and `model` (exactly one):
- `checkpoint`: an open_clip checkpoint file. An existing local path is used as is; an absolute path or
  one starting with "." or "~" must exist; any other string is read as `<owner>/<repo>/<path in repo>` on
  the Hugging Face hub and fetched with `hf_hub_download` (from the cache when offline). Default
  `xswu/HPSv2/HPS_v2.1_compressed.pt`; `xswu/HPSv2/HPS_v2_compressed.pt` is HPSv2.0. `arch` names its
  open_clip architecture. The file is read with `torch.load(weights_only=True)`.
- `model`: an already converted `CLIPModel` (local folder or hub id) loaded with `from_pretrained`; `arch`
  is then unused, and the default `checkpoint` gives way to it.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:  # transformers loads only when the reward is built
    from transformers import CLIPModel

from glm_training.rewards.clip_base import (
    OFFLINE_FIX,
    ClipEmbedder,
    check_batch_size,
    check_pairs,
    embed_prompts,
)
from glm_training.rewards.open_clip_convert import (
    clip_config,
    load_open_clip_into_transformers,
    unwrap_open_clip_checkpoint,
)
from glm_training.rewards.registry import (
    Reward,
    register_reward,
    resolve_weight_file,
    reward_dtype,
)

HPSV2_HUB_REPO = "xswu/HPSv2"
HPSV2_CHECKPOINT = f"{HPSV2_HUB_REPO}/HPS_v2.1_compressed.pt"
HPSV2_ARCH = "ViT-H-14"
HPSV2_TOKENIZER = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
# open_clip constants.py OPENAI_DATASET_MEAN / OPENAI_DATASET_STD (HPSv2 passes image_mean=None -> these).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def hpsv2_pixel_values(image: Image.Image, image_size: int) -> torch.Tensor:
    """HPSv2's eval preprocessing of one image: `pixels_chw` [3, image_size, image_size], float32.

    Longest side resized (bicubic, antialiased, on the [0, 1] float tensor) to `image_size`, the short
    side to `round(short * image_size / long)`; zero padding (black before normalisation) centres it,
    the odd pixel going after; then (x - mean) / std with the OpenAI CLIP statistics.
    """
    rgb_hwc = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    pixels_chw = torch.from_numpy(rgb_hwc).permute(2, 0, 1)
    height, width = pixels_chw.shape[1:]
    scale = image_size / max(height, width)
    if scale != 1.0:
        # Python's round (half to even), as open_clip's ResizeMaxSize computes the new size.
        new_height, new_width = round(height * scale), round(width * scale)
        pixels_chw = torch.nn.functional.interpolate(
            pixels_chw[None],
            size=(new_height, new_width),
            mode="bicubic",
            align_corners=False,
            antialias=True,
        )[0]
    # ResizeMaxSize skips the padding when no resize was needed; padding anyway only differs for a
    # non-square image whose long side already is `image_size`, which the official code cannot score.
    pad_h, pad_w = image_size - pixels_chw.shape[1], image_size - pixels_chw.shape[2]
    pixels_chw = torch.nn.functional.pad(
        pixels_chw, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
    )
    mean_c11 = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)
    std_c11 = torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    return (pixels_chw - mean_c11) / std_c11


def resolve_checkpoint(checkpoint: str) -> Path:
    """The local file of `checkpoint`: itself if it exists, else `<owner>/<repo>/<file>` from the hub."""
    return resolve_weight_file(checkpoint, what="hpsv2 checkpoint", example=HPSV2_CHECKPOINT)


class HpsEmbedder(ClipEmbedder):
    """`ClipEmbedder` over a given `CLIPModel` and tokenizer, with HPSv2's image preprocessing."""

    def __init__(self, model: CLIPModel, tokenizer: Any, *, device: str, dtype: str, batch_size: int) -> None:
        # Not ClipEmbedder.__init__, which loads a model folder: this model may come from a converted
        # open_clip checkpoint.
        check_batch_size(batch_size, "hpsv2")
        # Only the tokenizer is used: `pixel_values` below replaces the image processor.
        from transformers import CLIPProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        processor = CLIPProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tokenizer)
        self._attach(model, processor, device=device, dtype=dtype, batch_size=batch_size)
        self.image_size = model.config.vision_config.image_size

    @torch.no_grad()
    def pixel_values(self, images: list[Image.Image]) -> torch.Tensor:
        """HPSv2-preprocessed images `pixel_values_nchw`, float32 on CPU."""
        return torch.stack([hpsv2_pixel_values(image, self.image_size) for image in images])


def _load_tokenizer(tokenizer: str) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    except OSError as err:
        raise OSError(f"could not load the hpsv2 tokenizer {tokenizer!r}: {err}\nFix: {OFFLINE_FIX}") from err


def _check_eot_pooling(tokenizer: Any, model: CLIPModel) -> None:
    """open_clip pools text at argmax(ids); transformers at the first EOS: equal when EOS is the top id."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None or eos_id != max(tokenizer.get_vocab().values()):
        raise ValueError(
            f"hpsv2 tokenizer's end-of-text id {eos_id} is not its largest token id, so open_clip's "
            "argmax(ids) pooling would not pick it; use the CLIP BPE tokenizer (the default "
            f"{HPSV2_TOKENIZER!r})"
        )
    text_config = model.config.text_config
    # eos_token_id == 2 is transformers' legacy marker for argmax pooling, which is equivalent here.
    if text_config.eos_token_id not in (2, eos_id):
        raise ValueError(
            f"the hpsv2 model pools text at token id {text_config.eos_token_id} but the tokenizer ends "
            f"texts with {eos_id}; use the tokenizer the model was trained with"
        )
    if text_config.vocab_size <= eos_id:
        raise ValueError(
            f"the hpsv2 tokenizer's ids reach {eos_id} but the model's vocabulary has "
            f"{text_config.vocab_size} entries; use the tokenizer the model was trained with"
        )


@register_reward("hpsv2")
class Hpsv2Reward(Reward):
    """HPSv2(.1) preference score: cosine of the HPS CLIP's image and prompt embeddings, in [-1, 1].

    Args:
        checkpoint: open_clip checkpoint, a local path or `<owner>/<repo>/<file>` on the hub (see the
            module docstring). Default: HPSv2.1, unless `model` is given.
        model: alternative to `checkpoint`: a converted `CLIPModel` folder or hub id.
        arch: open_clip architecture of `checkpoint`: a name in `OPEN_CLIP_ARCHS` or CLIPConfig keyword
            arguments (tests use tiny ones).
        tokenizer: CLIP BPE tokenizer, hub id or folder.
        device: "auto" (this process's device), "cpu" or "cuda:N".
        dtype: weight dtype ("float32", "bfloat16", "float16"); the official scorer runs fp16 autocast.
        batch_size: images per forward pass.
    """

    approx_params = 986_000_000  # OpenCLIP ViT-H/14: the memory plan's figure
    retryable = True  # a transient failure (CUDA OOM, a busy device) is retried: reward.max_retries

    def __init__(
        self,
        checkpoint: str | None = HPSV2_CHECKPOINT,
        model: str | None = None,
        arch: str | Mapping[str, Any] = HPSV2_ARCH,
        tokenizer: str = HPSV2_TOKENIZER,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ) -> None:
        if model is not None and checkpoint == HPSV2_CHECKPOINT:
            checkpoint = None  # `model` alone replaces the default checkpoint
        if (checkpoint is None) == (model is None):
            fix = "set one of them to null" if model is not None else f"e.g. checkpoint={HPSV2_CHECKPOINT!r}"
            raise ValueError(
                "hpsv2 needs exactly one of `checkpoint` (an open_clip .pt file) and `model` (a converted "
                f"CLIPModel folder or hub id), got checkpoint={checkpoint!r}, model={model!r}: {fix}"
            )
        check_batch_size(batch_size, "hpsv2")
        reward_dtype(dtype)  # fail on a bad name before loading anything
        tokenizer_obj = _load_tokenizer(tokenizer)

        if checkpoint is not None:
            config = clip_config(arch)
            path = resolve_checkpoint(checkpoint)
            # weights_only: a .pt file is a pickle; this refuses anything but tensors and plain containers.
            try:
                loaded = torch.load(path, weights_only=True, map_location="cpu")
            except pickle.UnpicklingError as err:
                raise ValueError(
                    f"hpsv2 checkpoint {str(path)!r} holds objects other than tensors and plain containers, "
                    f"which weights_only loading refuses: {err}\nFix: re-save it from a trusted session as "
                    "torch.save({'state_dict': state_dict}, path)"
                ) from err
            if not isinstance(loaded, Mapping):
                raise ValueError(
                    f"hpsv2 checkpoint {str(path)!r} holds a {type(loaded).__name__}, not a dict"
                )
            clip = load_open_clip_into_transformers(unwrap_open_clip_checkpoint(loaded), config)
            del loaded
        else:
            if arch != HPSV2_ARCH:
                warnings.warn(
                    f"hpsv2: arch={arch!r} is ignored with `model` (its config.json decides)", stacklevel=2
                )
            try:
                from transformers import CLIPModel

                clip = CLIPModel.from_pretrained(model, dtype=reward_dtype(dtype))
            except OSError as err:
                raise OSError(f"could not load the hpsv2 model {model!r}: {err}\nFix: {OFFLINE_FIX}") from err
        _check_eot_pooling(tokenizer_obj, clip)
        self.embedder = HpsEmbedder(clip, tokenizer_obj, device=device, dtype=dtype, batch_size=batch_size)

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        check_pairs(images, prompts, "hpsv2")
        image_embeds_nd = self.embedder.embed_images(images)
        text_embeds_nd = embed_prompts(self.embedder, prompts)
        return (image_embeds_nd * text_embeds_nd).sum(dim=-1)
