"""Export trained GLM-Image checkpoints as a standalone `diffusers.GlmImagePipeline` folder.

A checkpoint (`glm_training/checkpoint/`) holds only the weights that trained: the LoRA adapters (peft) or
the fine-tuned parameters of one half of GLM-Image, the DiT `transformer` (Flow-GRPO, `train_dit.py`) or the
AR `vision_language_encoder` (GRPO/DAPO, `train_ar.py`). The export re-reads the run's base model
(`model.name`), puts the trained weights back in, and writes a complete pipeline folder with `save_pretrained`
that plain diffusers loads, with no project code:

    python -m glm_training.export --checkpoint outputs/dit-run --output exported/glm-image-dit
    python -m glm_training.export --checkpoint outputs/dit-run --checkpoint outputs/ar-run \
        --output exported/both

    from diffusers import GlmImagePipeline
    pipe = GlmImagePipeline.from_pretrained("exported/both")

`--checkpoint` takes a step folder (`<output_dir>/checkpoints/step-NNNNNN/`) or a run folder (its newest
checkpoint). Two checkpoints, one DiT run and one AR run of the same base model, are combined into one folder.

LoRA formats:

* `merged` (default): the adapters are merged into the base weights with peft's own merge (`merge_and_unload`
  semantics: W <- W + (alpha / r) * B @ A per adapted layer, then the LoRA layers are replaced by their base
  layers), so the folder is an ordinary GLM-Image.
* `separate`: the base weights are saved untouched and each component's adapters go to
  `<output>/lora/<component>/`, in the format its library loads: the DiT's through diffusers'
  `save_lora_adapter` (`pytorch_lora_weights.safetensors`, LoRA config in the file's metadata), the AR model's
  in peft's adapter format (`adapter_model.safetensors` + `adapter_config.json`, as transformers' adapter
  `save_pretrained` writes it).
  Load them with::

      from diffusers import GlmImagePipeline

      pipe = GlmImagePipeline.from_pretrained(out)
      # DiT adapters, present if a LoRA DiT checkpoint was exported:
      pipe.transformer.load_lora_adapter(
          f"{out}/lora/transformer", weight_name="pytorch_lora_weights.safetensors", prefix=None
      )
      # AR adapters, present if a LoRA AR checkpoint was exported:
      pipe.vision_language_encoder.load_adapter(f"{out}/lora/vision_language_encoder")

  Full fine-tuning checkpoints have no adapters; their weights always go into the pipeline itself.

`--ema` exports the EMA weights (`algo.ema=true` runs) instead of the trained ones. `export_info.json` in the
folder records the source checkpoints, their steps and components, the LoRA format and whether EMA was used.

The folder is written into a temporary sibling and renamed into place when complete; an existing `--output`
is refused unless `--overwrite`, and is then replaced only once the new folder is complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from glm_training.checkpoint import (
    EMA_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointInfo,
    read_checkpoint,
    read_trained_weights,
)
from glm_training.models.lora import add_lora_adapters, merge_lora_adapters, save_lora_adapters

if TYPE_CHECKING:
    from diffusers import GlmImagePipeline

logger = logging.getLogger("glm_training.export")  # not "__main__" under `python -m`

EXPORT_INFO_FILE = "export_info.json"
LORA_DIR = "lora"
LORA_FORMATS = ("merged", "separate")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def inspect_checkpoints(checkpoints: list[Path], *, use_ema: bool = False) -> list[CheckpointInfo]:
    """Read and cross-check the checkpoints of one export; every input error surfaces here, before loading."""
    if not 1 <= len(checkpoints) <= 2:
        raise CheckpointError(
            f"give one checkpoint, or two (one DiT run and one AR run) to combine; got {len(checkpoints)}."
        )
    infos = [read_checkpoint(path) for path in checkpoints]
    if len(infos) == 2:
        first, second = infos
        if first.component == second.component:
            raise CheckpointError(
                f"both checkpoints train the {first.component} ({first.pipeline_component}): "
                f"'{first.path}' and '{second.path}'; two checkpoints combine one DiT run (train_dit.py) "
                "and one AR run (train_ar.py). Export them one at a time."
            )
        if _base_model(first) != _base_model(second):
            raise CheckpointError(
                f"the checkpoints were trained from different base models: {_base_model(first)} "
                f"('{first.path}') vs {_base_model(second)} ('{second.path}'); only runs of the same "
                "model.name (and, for a built fixture, its seed and layer counts) can be combined into one "
                "pipeline."
            )
    if use_ema:
        lacking = [str(info.path) for info in infos if not info.has_ema]
        if lacking:
            raise CheckpointError(
                f"--ema / use_ema asks for EMA weights but {lacking} hold no {EMA_FILE} (the run had "
                "algo.ema=false); drop --ema to export the trained weights."
            )
    return infos


def _base_model(info: CheckpointInfo) -> tuple:
    return info.model.base_model_id()


def _default_dtype(infos: list[CheckpointInfo]) -> torch.dtype:
    names = sorted({info.model.dtype for info in infos})
    if len(names) > 1:
        raise CheckpointError(
            f"the checkpoints were trained in different dtypes {names}; choose the export's with --dtype."
        )
    return DTYPES[names[0]]


def load_pipeline_from_checkpoints(
    checkpoints: list[Path],
    *,
    use_ema: bool = False,
    merge_lora: bool = True,
    dtype: torch.dtype | None = None,
) -> GlmImagePipeline:
    """The base GLM-Image of the checkpoints' runs with their trained weights loaded, on CPU, in eval mode.

    Args:
        checkpoints: one or two step or run folders (one DiT run and one AR run of the same base model).
        use_ema: load the EMA weights (`ema.pt`) instead of the trained ones.
        merge_lora: merge LoRA adapters into the base weights (peft's merge); `False` leaves them as active
            peft adapters named "default" in the component (see `save_lora_adapters`).
        dtype: weight dtype of every component; `None` = the runs' `model.dtype`.

    Raises `CheckpointError` for bad input, before any model is loaded.
    """
    from diffusers import GlmImagePipeline

    from glm_training.models.wrapper import model_path

    infos = inspect_checkpoints([Path(c) for c in checkpoints], use_ema=use_ema)
    dtype = dtype or _default_dtype(infos)
    base = infos[0].model
    path = model_path(base)
    logger.info("loading the base model %s (%s) on CPU", path, dtype)
    pipe = GlmImagePipeline.from_pretrained(path, dtype=dtype)
    for info in infos:
        module = getattr(pipe, info.pipeline_component)
        load_trained_weights(module, info, use_ema=use_ema)
        if info.is_lora and merge_lora:
            merge_lora_adapters(module)
        module.requires_grad_(False).eval()
        logger.info("loaded %s step %d (%s) from %s", info.component, info.step, _kind(info), info.path)
    return pipe


def _kind(info: CheckpointInfo) -> str:
    return "LoRA" if info.is_lora else "full fine-tuning"


def load_trained_weights(module: nn.Module, info: CheckpointInfo, *, use_ema: bool = False) -> None:
    """Copy a checkpoint's trained (or EMA) weights into `module`, adding its LoRA adapters first if any.

    The adapters are built by the trainers' own `add_lora_adapters`, so the parameter names match
    `trainable.safetensors` by construction.
    """

    if info.is_lora:
        add_lora_adapters(module, info.model.lora)
    state = read_trained_weights(info.path)
    params = dict(module.named_parameters())
    unexpected = sorted(set(state) - set(params))
    if unexpected:
        raise CheckpointError(
            f"'{info.path / WEIGHTS_FILE}' does not match the {info.pipeline_component} of "
            f"'{info.model.name}': no parameters named {unexpected[:5]}. Was model.name or model.lora "
            "changed after the run?"
        )
    if use_ema:
        state = _ema_state(info, module, state)
    with torch.no_grad():
        for name, value in state.items():
            target = params[name]
            if target.shape != value.shape:
                raise CheckpointError(
                    f"'{info.path}': parameter {name} has shape {tuple(value.shape)} in the checkpoint but "
                    f"{tuple(target.shape)} in the model; was model.name or model.lora changed after the run?"
                )
            target.copy_(value.to(target.dtype))


def _ema_state(info: CheckpointInfo, module: nn.Module, trained: dict[str, torch.Tensor]) -> dict:
    """The EMA shadow parameters by name (diffusers' `EMAModel` keeps a list, in `parameters()` order)."""
    ema = torch.load(info.path / EMA_FILE, map_location="cpu", weights_only=True)
    shadow = ema.get("shadow_params") if isinstance(ema, dict) else None
    # The EMA was built over the parameters that train, which are exactly those the checkpoint stores.
    names = [name for name, _ in module.named_parameters() if name in trained]
    if shadow is None or len(shadow) != len(names):
        count = "none" if shadow is None else len(shadow)
        raise CheckpointError(
            f"'{info.path / EMA_FILE}' holds {count} shadow parameters for the {len(names)} trained ones in "
            f"{WEIGHTS_FILE}; the two files come from different runs."
        )
    return dict(zip(names, shadow))


def export(
    checkpoints: list[Path],
    output: Path,
    *,
    overwrite: bool = False,
    lora_format: str = "merged",
    use_ema: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the pipeline folder of `checkpoints` to `output` atomically; returns `output`.

    Raises `CheckpointError` / `FileExistsError` for bad input before any model is loaded.
    """
    if lora_format not in LORA_FORMATS:
        raise ValueError(f"lora_format must be one of {LORA_FORMATS}, got '{lora_format}'.")
    output = Path(output).expanduser()
    infos = inspect_checkpoints([Path(c) for c in checkpoints], use_ema=use_ema)
    _check_output(output, infos, overwrite)
    dtype = dtype or _default_dtype(infos)
    if lora_format == "separate":
        for info in infos:
            if not info.is_lora:
                logger.warning(
                    "--lora-format separate: '%s' is full fine-tuning (no adapters); its weights go into the "
                    "pipeline itself.",
                    info.path,
                )

    pipe = load_pipeline_from_checkpoints(
        [info.path for info in infos], use_ema=use_ema, merge_lora=lora_format == "merged", dtype=dtype
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        adapters = {}
        for info in infos:
            module = getattr(pipe, info.pipeline_component)
            if info.is_lora and lora_format == "separate":
                folder = Path(LORA_DIR) / info.pipeline_component
                save_lora_adapters(module, staging / folder)
                merge_lora_adapters(module, merge=False)  # back to the untouched base weights
                adapters[info.pipeline_component] = folder.as_posix()
        pipe.save_pretrained(staging, safe_serialization=True)
        record = _export_info(infos, lora_format=lora_format, use_ema=use_ema, dtype=dtype, adapters=adapters)
        (staging / EXPORT_INFO_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        staging.chmod(0o755)  # mkdtemp makes it owner-only
        _publish(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("exported %s", output)
    return output


def _check_output(output: Path, infos: list[CheckpointInfo], overwrite: bool) -> None:
    if output.exists() or output.is_symlink():
        if not overwrite:
            raise FileExistsError(
                f"--output '{output}' already exists; choose another folder, or pass --overwrite to replace "
                "it (the old folder is removed only once the new export is complete)."
            )
        if not output.is_dir():
            raise FileExistsError(f"--output '{output}' exists and is not a folder; refusing to replace it.")
        if not any((output / marker).is_file() for marker in ("export_info.json", "model_index.json")):
            raise FileExistsError(
                f"--output '{output}' exists and is not a pipeline folder (no model_index.json); --overwrite "
                "only replaces an earlier export. Choose a new folder, or remove this one yourself."
            )
    parent = output.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise FileExistsError(
            f"cannot write --output '{output}': its parent '{parent}' does not exist or is not writable."
        )
    # --overwrite must never delete what the export reads.
    resolved = output.resolve()
    sources = [(info.path, "the checkpoint") for info in infos]
    base = Path(infos[0].model.name).expanduser()
    if base.exists():
        sources.append((base, "the base model"))
    for source, what in sources:
        if source.resolve().is_relative_to(resolved):
            raise FileExistsError(
                f"--output '{output}' contains {what} '{source}'; replacing it would delete it. Export to "
                "another folder."
            )


def _publish(staging: Path, output: Path) -> None:
    """Rename the complete `staging` folder to `output`, replacing an old `output` only after that."""
    if not output.exists():
        os.rename(staging, output)
        return
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    os.rename(output, old)
    try:
        os.rename(staging, output)
    except OSError:
        os.rename(old, output)  # put the previous export back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _export_info(
    infos: list[CheckpointInfo], *, lora_format: str, use_ema: bool, dtype: torch.dtype, adapters: dict
) -> dict[str, Any]:
    return {
        "base_model": infos[0].model.name,
        "tiny_seed": infos[0].model.tiny_seed if infos[0].model.name == "tiny" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "lora_format": lora_format,
        "ema": use_ema,
        "lora_adapters": adapters,
        "checkpoints": [
            {
                "path": str(info.path.resolve()),
                "step": info.step,
                "component": info.component,
                "pipeline_component": info.pipeline_component,
                "lora": info.is_lora,
            }
            for info in infos
        ],
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m glm_training.export",
        description="Export GLM-Image training checkpoints as a diffusers GlmImagePipeline folder.",
    )
    parser.add_argument(
        "--checkpoint",
        action="append",
        required=True,
        type=Path,
        help="step folder or run folder (newest checkpoint); give it twice to combine a DiT and an AR run",
    )
    parser.add_argument("--output", required=True, type=Path, help="folder to write the pipeline into")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument(
        "--lora-format",
        choices=LORA_FORMATS,
        default="merged",
        help="merge LoRA adapters into the weights (default) or save them separately under lora/",
    )
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (runs with algo.ema=true)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="weight dtype (default: the run's model.dtype)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 0 on success and 2 for bad input (message on stderr)."""
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    try:
        output = export(
            args.checkpoint,
            args.output,
            overwrite=args.overwrite,
            lora_format=args.lora_format,
            use_ema=args.ema,
            dtype=DTYPES[args.dtype] if args.dtype else None,
        )
    except (CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"done: pipeline in {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
