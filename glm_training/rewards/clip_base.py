"""Shared CLIP embedder (Radford et al. 2021, arXiv 2103.00020) for the CLIP-based rewards.

PickScore, CLIPScore and the LAION aesthetic predictor all score images through the embeddings of a
CLIP: `ClipEmbedder` loads a `transformers.CLIPModel` with its `CLIPProcessor` once, and returns
L2-normalised float32 embeddings of images and texts, batched.

Preprocessing is the processor's own: images are converted to RGB, resized (bicubic, PIL) so the
short side is the model's input size, centre-cropped to a square, rescaled to [0, 1] and normalised
with the processor's mean/std (the OpenAI CLIP mean/std for the default models). The PIL backend is
used because the torchvision one needs torchvision, which this project does not install. Texts are
tokenised with BOS/EOS and truncated to the text model's context (77 tokens) rather than rejected,
as PickScore's and Flow-GRPO's inference code do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from PIL import Image

from glm_training.rewards.registry import reward_device, reward_dtype

OFFLINE_FIX = (
    "pass a local directory written by save_pretrained, or a hub id already in the Hugging Face cache "
    "(download it once with `hf download <id>` on a machine with network access)"
)


def check_batch_size(batch_size: int, reward: str) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{reward} batch_size must be a positive integer, got {batch_size!r}")


def check_pairs(images: list[Image.Image], prompts: list[str], reward: str) -> None:
    if len(images) != len(prompts):
        raise ValueError(
            f"{reward} scores image/prompt pairs: got {len(images)} images and {len(prompts)} prompts"
        )


if TYPE_CHECKING:  # transformers loads only when a scorer is built
    from transformers import CLIPModel, CLIPProcessor


class ClipEmbedder:
    """A frozen CLIP on `reward_device(device)` in `reward_dtype(dtype)` that embeds images and texts.

    Args:
        model: hub id or local directory of a `CLIPModel` checkpoint.
        processor: hub id or local directory of its `CLIPProcessor` (tokenizer + image processor);
            None uses `model`. PickScore ships its weights without a processor and borrows the one of
            the CLIP it was fine-tuned from.
        device: "auto" (this process's device), "cpu" or "cuda:N".
        dtype: weight dtype name ("float32", "bfloat16", "float16"); embeddings are float32 anyway.
        batch_size: images (or texts) per forward pass.

    Subclasses with another preprocessing override `pixel_values`; subclasses whose model is not a folder
    (HPSv2's converted open_clip weights) call `_attach` with the loaded model instead of `__init__`.
    """

    def __init__(
        self,
        model: str,
        *,
        processor: str | None = None,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ) -> None:
        # Imported here so that registering the rewards (importing this module) stays cheap.
        from transformers import CLIPModel, CLIPProcessor

        check_batch_size(batch_size, "CLIP")
        processor = model if processor is None else processor
        try:
            # Loaded in float32 and cast in `_attach`, so that the logit scale is read unrounded.
            clip = CLIPModel.from_pretrained(model, dtype=torch.float32)
        except OSError as err:
            raise OSError(f"could not load the CLIP model {model!r}: {err}\nFix: {OFFLINE_FIX}") from err
        try:
            clip_processor = CLIPProcessor.from_pretrained(processor, backend="pil")
        except OSError as err:
            raise OSError(
                f"could not load the CLIP processor {processor!r}: {err}\nFix: {OFFLINE_FIX}"
            ) from err
        self._attach(clip, clip_processor, device=device, dtype=dtype, batch_size=batch_size)

    def _attach(
        self, model: CLIPModel, processor: CLIPProcessor, *, device: str, dtype: str, batch_size: int
    ) -> None:
        """Take a loaded `CLIPModel` and `CLIPProcessor`: place, cast and freeze the model."""
        self.device = reward_device(device)
        self.dtype = reward_dtype(dtype)
        self.batch_size = batch_size
        # Read before the cast: in bf16, logit_scale = 4.6052 rounds to 4.5938 and exp() loses 1.1%.
        self._logit_scale = float(model.logit_scale.detach().float())
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.processor = processor
        self.max_text_tokens = model.config.text_config.max_position_embeddings

    @property
    def embed_dim(self) -> int:
        """Width D of the joint image-text embedding space (the projection dim: 768 for ViT-L/14)."""
        return self.model.config.projection_dim

    @property
    def logit_scale(self) -> float:
        """The learned log-temperature: CLIP's logits are `exp(logit_scale) * cos(image, text)`."""
        return self._logit_scale

    @torch.no_grad()
    def pixel_values(self, images: list[Image.Image]) -> torch.Tensor:
        """Preprocessed images `pixel_values_nchw`, float32 on CPU."""
        return self.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]

    @torch.no_grad()
    def embed_images(self, images: list[Image.Image]) -> torch.Tensor:
        """L2-normalised image embeddings `embeds_nd`, float32 on CPU, N = len(images)."""
        chunks = []
        for start in range(0, len(images), self.batch_size):
            pixels_nchw = self.pixel_values(images[start : start + self.batch_size])
            pixels_nchw = pixels_nchw.to(device=self.device, dtype=self.dtype)
            chunks.append(self.model.get_image_features(pixel_values=pixels_nchw).pooler_output)
        return self._normalised(chunks)

    @torch.no_grad()
    def embed_texts(self, texts: list[str]) -> torch.Tensor:
        """L2-normalised text embeddings `embeds_nd`, float32 on CPU; texts past 77 tokens are truncated."""
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            tokens = self.processor.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_text_tokens,
                return_tensors="pt",
            ).to(self.device)
            chunks.append(
                self.model.get_text_features(
                    input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
                ).pooler_output
            )
        return self._normalised(chunks)

    def _normalised(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        if not chunks:
            return torch.zeros(0, self.embed_dim)
        # Normalise in float32: a bf16 norm would cost ~3 significant digits on every score.
        embeds_nd = torch.cat(chunks).float()
        return torch.nn.functional.normalize(embeds_nd, dim=-1).cpu()


def embed_prompts(embedder: ClipEmbedder, prompts: list[str]) -> torch.Tensor:
    """Text embeddings `embeds_nd` aligned with `prompts`, each distinct prompt encoded once.

    GRPO batches hold each prompt once per group member, so this saves (group size - 1) / group size
    of the text forward passes.
    """
    unique = list(dict.fromkeys(prompts))
    index = {prompt: i for i, prompt in enumerate(unique)}
    return embedder.embed_texts(unique)[[index[prompt] for prompt in prompts]]
