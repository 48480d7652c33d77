"""Convert open_clip CLIP checkpoints (Ilharco et al. 2021, LAION's OpenCLIP) to `transformers.CLIPModel`.

open_clip's ViT CLIP and transformers' `CLIPModel` compute the same function: pre-LayerNorm transformer
blocks, a class token pooled after `ln_post` for images, the EOT token pooled after `ln_final` under a
causal mask for texts, and bias-free projections into the joint space. Only the parameter names and three
layouts differ, so a checkpoint converts with pure tensor renames:

- attention: open_clip blocks use `nn.MultiheadAttention`, whose fused `in_proj_weight` [3W, W] and
  `in_proj_bias` [3W] stack the query, key and value projections in that order; transformers keeps
  separate `q_proj` / `k_proj` / `v_proj` linears.
- projections: open_clip applies `visual.proj` and `text_projection` as `x @ proj` with shape [W, E];
  transformers' `visual_projection` / `text_projection` are `nn.Linear(W, E)` with weight [E, W], the
  transpose.
- embeddings: open_clip's `visual.positional_embedding` [1 + G*G, W] and `positional_embedding` [L, W]
  are bare parameters; transformers wraps them in `nn.Embedding` (`.weight`).

Checked against open_clip's source (mlfoundations/open_clip `src/open_clip/model.py`, `transformer.py`):
`VisionTransformer` (conv1 without bias, class_embedding [W], positional_embedding, ln_pre, transformer,
ln_post applied before pooling the class token, proj [W, E] used as `pooled @ self.proj`),
`ResidualAttentionBlock` (ln_1, attn = nn.MultiheadAttention, ls_1 = Identity without layer scale, ln_2,
mlp.c_fc, nn.GELU, mlp.c_proj), and `CLIP.encode_text` (token_embedding, positional_embedding, the causal
`attn_mask` buffer registered with persistent=False, ln_final, features at `text.argmax(-1)`,
`@ text_projection` [W, E]); the ViT-H-14 sizes are those of `model_configs/ViT-H-14.json`. The key
names were matched against transformers 5.23's `modeling_clip.py` (note its `pre_layrnorm` spelling).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # transformers loads only when a model is converted
    from transformers import CLIPConfig, CLIPModel

# CLIPConfig keyword arguments of open_clip architectures. ViT-H-14 (open_clip model_configs/ViT-H-14.json):
# embed_dim 1024; vision width 1280, 32 layers, head_width 80 (-> 16 heads), patch 14, image 224, mlp_ratio 4;
# text width 1024, 24 layers, 16 heads, context 77, vocab 49408. open_clip builds these with nn.GELU (exact,
# quick_gelu is off for LAION models) and nn.LayerNorm's default eps 1e-5. The token ids are those of
# OpenAI's BPE vocabulary (<|startoftext|> 49406, <|endoftext|> 49407, the largest id, so the "first EOS"
# pooling of transformers picks the same position as open_clip's argmax pooling).
OPEN_CLIP_ARCHS: dict[str, dict[str, Any]] = {
    "ViT-H-14": {
        "projection_dim": 1024,
        "vision_config": {
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "patch_size": 14,
            "image_size": 224,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-5,
        },
        "text_config": {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "max_position_embeddings": 77,
            "vocab_size": 49408,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-5,
            "bos_token_id": 49406,
            "eos_token_id": 49407,
            "pad_token_id": 49407,
        },
    },
}

# Keys an open_clip checkpoint may hold that carry no weights: the text tower's causal mask (a constant,
# rebuilt by transformers; non-persistent in current open_clip, persistent in some forks).
IGNORED_OPEN_CLIP_KEYS = frozenset({"attn_mask"})

_Kind = Literal["copy", "transpose", "split_qkv"]


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One open_clip tensor <-> one or three transformers tensors."""

    open_clip: str
    transformers: tuple[str, ...]
    kind: _Kind


def clip_config(arch: str | Mapping[str, Any]) -> CLIPConfig:
    """The `CLIPConfig` of an architecture: a name in `OPEN_CLIP_ARCHS`, or CLIPConfig keyword arguments."""
    from transformers import CLIPConfig

    if isinstance(arch, str):
        if arch not in OPEN_CLIP_ARCHS:
            raise ValueError(
                f"unknown open_clip architecture {arch!r}; known: {sorted(OPEN_CLIP_ARCHS)}, or pass a "
                "mapping of CLIPConfig keyword arguments (projection_dim, vision_config, text_config)"
            )
        arch = OPEN_CLIP_ARCHS[arch]
    if not isinstance(arch, Mapping):
        raise TypeError(f"arch must be an architecture name or a mapping, got {type(arch).__name__}")
    return CLIPConfig(
        **{key: dict(value) if isinstance(value, Mapping) else value for key, value in arch.items()}
    )


def _block_rules(open_clip_prefix: str, transformers_prefix: str) -> list[_Rule]:
    oc, tf = open_clip_prefix, transformers_prefix
    rules = [
        _Rule(
            f"{oc}.attn.in_proj_{param}",
            tuple(f"{tf}.self_attn.{name}_proj.{param}" for name in ("q", "k", "v")),
            "split_qkv",
        )
        for param in ("weight", "bias")
    ]
    renames = {"ln_1": "layer_norm1", "attn.out_proj": "self_attn.out_proj", "ln_2": "layer_norm2"}
    renames |= {"mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for oc_name, tf_name in renames.items():
        for param in ("weight", "bias"):
            rules.append(_Rule(f"{oc}.{oc_name}.{param}", (f"{tf}.{tf_name}.{param}",), "copy"))
    return rules


def conversion_rules(config: CLIPConfig) -> list[_Rule]:
    """Every open_clip key of a ViT CLIP with `config`'s layer counts and its transformers counterpart(s)."""

    def copy(oc: str, tf: str) -> _Rule:
        return _Rule(oc, (tf,), "copy")

    def layer_norm(oc: str, tf: str) -> list[_Rule]:
        return [copy(f"{oc}.{param}", f"{tf}.{param}") for param in ("weight", "bias")]

    rules = [
        copy("visual.conv1.weight", "vision_model.embeddings.patch_embedding.weight"),
        copy("visual.class_embedding", "vision_model.embeddings.class_embedding"),
        copy("visual.positional_embedding", "vision_model.embeddings.position_embedding.weight"),
        *layer_norm("visual.ln_pre", "vision_model.pre_layrnorm"),
        *layer_norm("visual.ln_post", "vision_model.post_layernorm"),
        _Rule("visual.proj", ("visual_projection.weight",), "transpose"),
        copy("token_embedding.weight", "text_model.embeddings.token_embedding.weight"),
        copy("positional_embedding", "text_model.embeddings.position_embedding.weight"),
        *layer_norm("ln_final", "text_model.final_layer_norm"),
        _Rule("text_projection", ("text_projection.weight",), "transpose"),
        copy("logit_scale", "logit_scale"),
    ]
    for index in range(config.vision_config.num_hidden_layers):
        rules += _block_rules(f"visual.transformer.resblocks.{index}", f"vision_model.encoder.layers.{index}")
    for index in range(config.text_config.num_hidden_layers):
        rules += _block_rules(f"transformer.resblocks.{index}", f"text_model.encoder.layers.{index}")
    return rules


def expected_shapes(config: CLIPConfig) -> dict[str, torch.Size]:
    """Shapes of the persistent tensors of `CLIPModel(config)`, from a weightless (meta) instance."""
    from transformers import CLIPModel

    with torch.device("meta"):
        model = CLIPModel(config)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def unwrap_open_clip_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The bare state dict of a loaded open_clip / HPSv2 checkpoint file.

    open_clip's training loop saves {"epoch", "name", "state_dict", "optimizer", ...} and HPSv2's
    `score()` loads `checkpoint["state_dict"]`; checkpoints saved from a DistributedDataParallel model
    prefix every key with "module." (open_clip's `load_checkpoint` strips it, and so does this).
    """
    state_dict = checkpoint.get("state_dict", checkpoint)
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise ValueError("the checkpoint holds no state dict (expected tensors, or a 'state_dict' entry)")
    if all(key.startswith("module.") for key in state_dict):
        state_dict = {key.removeprefix("module."): value for key, value in state_dict.items()}
    non_tensors = sorted(key for key, value in state_dict.items() if not isinstance(value, torch.Tensor))
    if non_tensors:
        raise ValueError(f"the checkpoint's state dict has non-tensor entries {non_tensors[:5]}")
    return dict(state_dict)


def _key_report(what: str, keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
    return f"{len(keys)} {what}: {shown}"


def open_clip_to_transformers(
    state_dict: Mapping[str, torch.Tensor], config: CLIPConfig
) -> dict[str, torch.Tensor]:
    """An open_clip ViT CLIP state dict as the state dict of `CLIPModel(config)`.

    Args:
        state_dict: open_clip parameter name -> tensor (see `unwrap_open_clip_checkpoint` for files).
        config: the target architecture; its layer counts decide which keys are expected.

    Returns:
        transformers parameter name -> tensor, every key of `CLIPModel(config).state_dict()` present with
        its shape. Dtypes are kept.

    Raises:
        ValueError: keys missing from or unknown to the mapping (both listed), or a shape that does not
            match `config` (usually the wrong `arch`).
    """
    rules = conversion_rules(config)
    known = {rule.open_clip for rule in rules}
    missing = sorted(known - set(state_dict))
    unmapped = sorted(set(state_dict) - known - IGNORED_OPEN_CLIP_KEYS)
    if missing or unmapped:
        problems = []
        if missing:
            problems.append(_key_report("open_clip keys missing from the checkpoint", missing))
        if unmapped:
            problems.append(_key_report("checkpoint keys with no transformers counterpart", unmapped))
        raise ValueError(
            "the checkpoint is not an open_clip ViT CLIP with this architecture's layer counts "
            f"(vision {config.vision_config.num_hidden_layers}, text {config.text_config.num_hidden_layers} "
            "layers): " + "; ".join(problems) + ". Fix: pass the matching `arch`, or an open_clip "
            "checkpoint of a plain ViT CLIP (no custom text tower, attentional pooler or layer scale)."
        )

    converted: dict[str, torch.Tensor] = {}
    for rule in rules:
        tensor = state_dict[rule.open_clip]
        if rule.kind == "copy":
            converted[rule.transformers[0]] = tensor
        elif rule.kind == "transpose":
            converted[rule.transformers[0]] = tensor.t().contiguous()
        else:
            if tensor.shape[0] % 3:
                raise ValueError(f"{rule.open_clip} has shape {tuple(tensor.shape)}: not a fused q/k/v")
            for name, part in zip(rule.transformers, tensor.chunk(3, dim=0)):
                converted[name] = part.contiguous()

    shapes = expected_shapes(config)
    assert set(shapes) == set(converted), "conversion_rules out of step with CLIPModel's parameters"
    wrong = [
        f"{name} {tuple(converted[name].shape)} (config wants {tuple(shape)})"
        for name, shape in shapes.items()
        if converted[name].shape != shape
    ]
    if wrong:
        raise ValueError(
            "the checkpoint's tensor shapes do not match the architecture: "
            + _key_report("mismatches", wrong)
            + ". Fix: pass the `arch` the checkpoint was trained with."
        )
    return converted


def transformers_to_open_clip(
    state_dict: Mapping[str, torch.Tensor], config: CLIPConfig
) -> dict[str, torch.Tensor]:
    """The inverse of `open_clip_to_transformers`: a `CLIPModel(config)` state dict in open_clip names.

    Raises ValueError naming the transformers keys that are missing or have no open_clip counterpart.
    """
    rules = conversion_rules(config)
    known = {name for rule in rules for name in rule.transformers}
    missing = sorted(known - set(state_dict))
    unmapped = sorted(set(state_dict) - known)
    if missing or unmapped:
        problems = []
        if missing:
            problems.append(_key_report("transformers keys missing", missing))
        if unmapped:
            problems.append(_key_report("transformers keys with no open_clip counterpart", unmapped))
        raise ValueError("cannot convert to open_clip: " + "; ".join(problems))

    converted: dict[str, torch.Tensor] = {}
    for rule in rules:
        tensors = [state_dict[name] for name in rule.transformers]
        if rule.kind == "copy":
            converted[rule.open_clip] = tensors[0]
        elif rule.kind == "transpose":
            converted[rule.open_clip] = tensors[0].t().contiguous()
        else:
            converted[rule.open_clip] = torch.cat(tensors, dim=0)
    return converted


def load_open_clip_into_transformers(state_dict: Mapping[str, torch.Tensor], config: CLIPConfig) -> CLIPModel:
    """A `CLIPModel(config)` holding the converted open_clip weights (in their dtype, on CPU).

    The model is built without initialising its weights (a ViT-H-14 random init costs tens of seconds on
    CPU) and the converted tensors are assigned in place of the empty ones.
    """
    from accelerate import init_empty_weights
    from transformers import CLIPModel

    converted = open_clip_to_transformers(state_dict, config)
    # Buffers (position ids) are built for real: they are not in the state dict.
    with init_empty_weights(include_buffers=False):
        model = CLIPModel(config)
    model.load_state_dict(converted, strict=True, assign=True)
    return model.eval()
