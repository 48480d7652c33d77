"""The static terms of the device plan: weights, and the state training keeps for the trained parameters.

* weights of each component, by dtype and placement (the trained one sharded under FSDP, LoRA too:
  `fully_shard` shards frozen base weights);
* trainable parameters (LoRA adapters in float32, or the whole trained submodules, in float32 masters when
  the model keeps them), their gradients and the AdamW state (two tensors of the parameter's dtype), an EMA
  copy, the algorithm's policy copies (e.g. DiffusionNFT's old model) and, for full fine-tuning with KL,
  the frozen reference copy.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from glm_training.config.algorithms import algorithm_of
from glm_training.models.halves import ModelHalf
from glm_training.plan.components import DTYPE_BYTES, lora_params, lora_targets, not_loaded, numel
from glm_training.plan.report import Term, format_count


def has_reference(cfg: Any) -> bool:
    """Whether the run keeps a frozen reference copy of the trained component (full fine-tuning whose
    algorithm reads the base model, `algo.uses_reference()`: the KL's `beta > 0`; LoRA's reference is the base
    model with the adapters off)."""
    return not cfg.model.lora.enabled and cfg.algo.uses_reference()


def weight_terms(cfg: Any, modules: dict[str, nn.Module], trained_name: str, shard: int) -> list[Term]:
    """The weights of every loaded component: the trained one 1/shard per rank, the others replicated."""
    m = cfg.model
    wbytes = DTYPE_BYTES[m.dtype]
    skipped = not_loaded(cfg)
    terms = []
    for name, module in modules.items():
        if name in skipped:
            continue
        n = numel(module)
        sharded = name == trained_name and shard > 1  # LoRA too: fully_shard shards frozen base weights
        where = f"1/{shard} shard per rank" if sharded else "replicated"
        terms.append(
            Term(
                f"weights: {name}",
                n * wbytes / (shard if sharded else 1),
                f"{format_count(n)} params, {m.dtype}, {where}",
            )
        )
    return terms


def _trainable(cfg: Any, parts: list[nn.Module], shard: int) -> tuple[int, int, list[Term]]:
    """(trainable parameters, bytes each, the term they add beyond the weights: LoRA adapters or float32
    masters; none for full fine-tuning in the model's dtype)."""
    m = cfg.model
    wbytes = DTYPE_BYTES[m.dtype]
    if m.lora.enabled:
        n_train = sum(lora_params(p, list(m.lora.target_modules), m.lora.rank) for p in parts)
        pbytes, kind = 4, f"LoRA r{m.lora.rank}, float32"
        # FSDP shards the adapters with their layers; DDP keeps them whole.
        return n_train, pbytes, [Term("trainable (LoRA adapters)", n_train * pbytes / shard, kind)]
    n_train = sum(numel(p) for p in parts)
    if not m.keeps_master_weights():  # full fine-tuning in the model's dtype: counted in the weights
        return n_train, wbytes, []
    pbytes = 4
    # The trained parameters are float32 masters: 2 more bytes each than the weights term counted.
    master = Term(
        "float32 master weights",
        n_train * (pbytes - wbytes) / shard,
        f"full fine-tuning of a {m.dtype} model: the trained weights in float32 (beyond the above)",
    )
    return n_train, pbytes, [master]


def trained_state_terms(cfg: Any, trained: nn.Module, half: ModelHalf, shard: int) -> list[Term]:
    """What training keeps for the trained parameters, 1/shard per rank: the trainable parameters beyond
    the weights, gradients, AdamW state, EMA, the algorithm's policy copies and the KL reference."""
    n_train, pbytes, terms = _trainable(cfg, half.trained_parts(trained), shard)
    local = n_train / shard
    terms.append(
        Term(
            "gradients",
            local * pbytes,
            f"{n_train / 1e6:.1f}M trainable params{'' if shard == 1 else f', 1/{shard} per rank'}",
        )
    )
    terms.append(Term("optimizer state (AdamW)", 2 * local * pbytes, "exp_avg + exp_avg_sq"))
    if getattr(cfg.algo, "ema", False):
        terms.append(Term("EMA copy", local * pbytes, ""))
    for name in algorithm_of(cfg).policy_copies:
        # E.g. DiffusionNFT's old (sampling) model: a copy of the adapters, or a frozen copy of the module
        # (of its float32 masters when it has them); the trained weights' own dtype either way.
        copy_bytes = n_train * pbytes
        terms.append(Term(name, copy_bytes / shard, "copy of the trained weights"))
    if has_reference(cfg):
        terms.append(_reference_term(cfg, trained, shard))
    if getattr(getattr(cfg, "sampling", None), "sampler", "policy") == "folded":
        # The folded sampler's copies (pipeline/ar_sampler.py): each adapted weight, whole, held all run.
        targets = lora_targets(trained, list(cfg.model.lora.target_modules))
        folded = sum(sub.weight.numel() for sub in targets) * DTYPE_BYTES[cfg.model.dtype]
        terms.append(Term("folded sampling copies", folded, "sampling.sampler=folded"))
    return terms


def _reference_term(cfg: Any, trained: nn.Module, shard: int) -> Term:
    if shard > 1 and cfg.trainer.fsdp_reference_offload:
        return Term("KL reference copy", 0, "shards in host memory (fsdp_reference_offload)")
    # A copy of the whole component (the AR model's vision towers too).
    return Term(
        "KL reference copy",
        numel(trained) * DTYPE_BYTES[cfg.model.dtype] / shard,
        "frozen copy of the trained component",
    )
