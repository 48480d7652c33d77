"""LAION aesthetic reward: the "improved aesthetic predictor" (Schuhmann, LAION 2022), as in DDPO / Flow-GRPO.

    score = MLP(normalize(CLIP_image_embedding(image)))

- CLIP: OpenAI CLIP ViT-L/14 (`openai/clip-vit-large-patch14`), image embedding after the visual
  projection (768-d), L2-normalised in float32. Preprocessing: 224 px bicubic resize of the short
  side, centre crop, OpenAI CLIP mean/std (the `CLIPProcessor` of the model, PIL backend).
- head: the MLP of christophschuhmann/improved-aesthetic-predictor's `simple_inference.py`, weights
  `sac+logos+ava1-l14-linearMSE.pth` (trained with MSE on SAC + LAION-Logos + AVA ratings, 1-10):
  Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64), Dropout(0.1),
  Linear(64, 16), Linear(16, 1), no activations (the "linear" in the file name), state-dict keys
  `layers.{0,2,4,6,7}.{weight,bias}`. The hidden widths are read from the weights, and the input
  width must equal the CLIP's projection dim. The head runs in float32 on CPU (it is ~1 MFLOP per
  image), as the original ran it in float32.

`head` resolution: an existing local file (.pth / .pt loaded with `torch.load(weights_only=True)`,
or .safetensors) is used as is; otherwise "owner/repo/path/in/repo" is a file in the Hugging Face
hub repo "owner/repo", fetched with `hf_hub_download` (from the cache when HF_HUB_OFFLINE=1). The
default is LAION's weights mirrored at `camenduru/improved-aesthetic-predictor`.

The original package was not used: it loads CLIP through OpenAI's `clip` package (torchvision) and
its MLP is a pytorch-lightning module; `transformers.CLIPModel` with the same weights and
preprocessing gives the same embedding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch import nn

from glm_training.rewards.clip_base import ClipEmbedder, check_batch_size
from glm_training.rewards.registry import Reward, register_reward, resolve_weight_file

AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "camenduru/improved-aesthetic-predictor/sac+logos+ava1-l14-linearMSE.pth"
AESTHETIC_LINEAR_KEYS = (0, 2, 4, 6, 7)  # indices of the Linear layers inside `layers`
HEAD_SUFFIXES = (".pth", ".pt", ".safetensors")


class AestheticMLP(nn.Module):
    """The improved aesthetic predictor's MLP; `widths` = (input, hidden1, hidden2, hidden3, hidden4).

    Original: widths (768, 1024, 128, 64, 16). Maps embeddings `embeds_nd` to scores `[N, 1]`.
    """

    def __init__(self, widths: tuple[int, int, int, int, int] = (768, 1024, 128, 64, 16)) -> None:
        super().__init__()
        w_in, w1, w2, w3, w4 = widths
        # Same layout as the original, so its state dict loads with strict key matching.
        self.layers = nn.Sequential(
            nn.Linear(w_in, w1),
            nn.Dropout(0.2),
            nn.Linear(w1, w2),
            nn.Dropout(0.2),
            nn.Linear(w2, w3),
            nn.Dropout(0.1),
            nn.Linear(w3, w4),
            nn.Linear(w4, 1),
        )

    def forward(self, embeds_nd: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds_nd)


def resolve_head_path(head: str) -> Path:
    """A local file for `head`: an existing path, or "owner/repo/filename" fetched from the hub cache."""
    if not Path(head).expanduser().is_file() and not head.endswith(HEAD_SUFFIXES):
        raise ValueError(f"aesthetic head {head!r} must be a {'/'.join(HEAD_SUFFIXES)} file")
    return resolve_weight_file(head, what="aesthetic head", example=AESTHETIC_HEAD)


def load_aesthetic_head(path: Path) -> AestheticMLP:
    """The MLP with the weights at `path`, widths read from them, in eval mode on CPU in float32."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state_dict = load_file(path)
    else:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    expected = {f"layers.{i}.{p}" for i in AESTHETIC_LINEAR_KEYS for p in ("weight", "bias")}
    if not isinstance(state_dict, dict) or set(state_dict) != expected:
        found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"aesthetic head {str(path)!r} is not an improved-aesthetic-predictor state dict: expected keys "
            f"{sorted(expected)}, found {found}"
        )
    weights = [state_dict[f"layers.{i}.weight"] for i in AESTHETIC_LINEAR_KEYS]
    widths = (weights[0].shape[1], *(w.shape[0] for w in weights[:4]))
    head = AestheticMLP(widths)  # type: ignore[arg-type]
    try:
        head.load_state_dict({k: v.float() for k, v in state_dict.items()})
    except RuntimeError as err:  # inconsistent layer shapes, or a final width other than 1
        raise ValueError(f"aesthetic head {str(path)!r} has inconsistent layer shapes: {err}") from err
    return head.eval().requires_grad_(False)


@register_reward("aesthetic")
class AestheticReward(Reward):
    """LAION improved aesthetic predictor on CLIP ViT-L/14 image embeddings (about 1-10, higher is better).

    Args:
        clip_model: hub id or local directory of the `CLIPModel` (with its `CLIPProcessor`) the head
            was trained on.
        head: the MLP weights: a local .pth/.safetensors file or "owner/repo/filename" on the hub.
        device: "auto" (this process's device), "cpu" or "cuda:N" for the CLIP.
        dtype: CLIP weight dtype ("float32", "bfloat16", "float16"); the head is always float32.
        batch_size: images per CLIP forward pass.
    """

    approx_params = 428_000_000  # CLIP ViT-L/14 + linear head: the memory plan's figure
    retryable = True  # a transient failure (CUDA OOM, a busy device) is retried: reward.max_retries

    def __init__(
        self,
        clip_model: str = AESTHETIC_CLIP,
        head: str = AESTHETIC_HEAD,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
    ) -> None:
        check_batch_size(batch_size, "aesthetic")
        # The head first: a wrong path fails before the 1.7 GB CLIP loads.
        self.head = load_aesthetic_head(resolve_head_path(head))
        self.embedder = ClipEmbedder(clip_model, device=device, dtype=dtype, batch_size=batch_size)
        head_width = self.head.layers[0].in_features
        if head_width != self.embedder.embed_dim:
            raise ValueError(
                f"aesthetic head {head!r} takes {head_width}-dim embeddings but CLIP {clip_model!r} "
                f"embeds images into {self.embedder.embed_dim} dims; pair the head with the CLIP it was "
                f"trained on ({AESTHETIC_HEAD!r} goes with {AESTHETIC_CLIP!r})"
            )

    @torch.no_grad()
    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        embeds_nd = self.embedder.embed_images(images)
        return self.head(embeds_nd).squeeze(-1).float()
