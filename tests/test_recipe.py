"""examples/decoupled_recipe.sh end to end on the tiny model (few steps, 32x32 DiT, 4 prompts).

AR RL (jpeg_compressibility) -> priors from the trained AR -> DiT RL (jpeg_incompressibility) on the cache ->
combined export. Each stage's held-out evaluation must improve on its start, and the export, loaded by plain
diffusers in a process that cannot import the project, must produce the trained AR's prior tokens (the
cache's rows, sampled with `model.ar_weights`) and hold the trained DiT's and AR's weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, REPO, run_cli
from safetensors.torch import load_file

from glm_training.priors import PriorCache, row_seed

PROMPTS = ["a red cube on a table", "a lighthouse at dusk", "a bowl of ramen", "a snowy mountain village"]

# A fresh interpreter, outside the repository, where importing the project raises.
LOADER = r"""
import json, sys

class NoProject:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "glm_training":
            raise ImportError("the project must not be importable here")

sys.meta_path.insert(0, NoProject())
import torch
from diffusers import GlmImagePipeline
from safetensors.torch import save_file

torch.set_num_threads(1)
spec = json.loads(sys.argv[1])
pipe = GlmImagePipeline.from_pretrained(spec["export"])
ar = pipe.vision_language_encoder
ar.generation_config.pad_token_id = ar.generation_config.pad_token_id or ar.generation_config.eos_token_id
tokens = {}
for i, (text, seed) in enumerate(spec["rows"]):
    prior, _, _ = pipe.generate_prior_tokens(
        prompt=[text], height=32, width=32, device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(seed),
    )
    tokens[f"row{i}"] = prior[0].contiguous()
save_file(tokens, spec["out"] + "/tokens.safetensors")
for part in ("transformer", "vision_language_encoder"):
    state = {k: v.contiguous() for k, v in getattr(pipe, part).state_dict().items()}
    save_file(state, spec["out"] + f"/{part}.safetensors")
try:
    import glm_training  # noqa: F401
    importable = True
except ImportError:
    importable = False
json.dump({"project_importable": importable}, open(spec["out"] + "/report.json", "w"))
"""


def _eval_rewards(run_dir: Path) -> list[float]:
    return [json.loads(p.read_text())["reward_mean"] for p in sorted((run_dir / "eval").glob("*.json"))]


def _final(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").iterdir())[-1]


@pytest.mark.slow
def test_the_decoupled_recipe_runs_end_to_end(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    small = f"eval.num_prompts=4 data.prompt_file={prompts}"
    out = tmp_path / "recipe"
    env = {
        "OUT": str(out),
        "PYTHON": PYTHON,
        "PATH": f"{Path(PYTHON).parent}:{os.environ['PATH']}",
        "AR_STEPS": "6",
        "DIT_STEPS": "8",
        "NUM_PRIORS": "1",
        "AR_ARGS": f"reward.names=[jpeg_compressibility] optim.lr=1e-2 {small}",
        "DIT_ARGS": f"reward.names=[jpeg_incompressibility] sampling.height=32 sampling.width=32 "
        f"data.num_groups_per_step=2 {small}",
    }
    result = run_cli(["bash", str(REPO / "examples" / "decoupled_recipe.sh")], timeout=900, env=env)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    assert "[load] vision_language_encoder: not loaded" in result.stderr  # the DiT stage

    # Neither stage is long enough for the direction of its held-out reward to mean anything, so each asserts
    # that it evaluated twice and that what it samples changed. The AR stage's 6 steps move it by -0.18,
    # +1.61, +0.72, +1.50, -0.14 (trainer.seed 0-4, pinned numerics: benchmarks/learning_margins.py
    # recipe_ar; at 10 steps still -0.35 on seed 4): the AR's learning is asserted where five seeds clear a
    # bar, by test_ar_training.py's default run. The DiT stage's 8 steps on 32x32 images moved its reward by
    # -0.02 to +0.02 over trainer.seed 0-3.
    ar = _eval_rewards(out / "ar")
    assert len(ar) == 2 and ar[-1] != ar[0], ar
    dit = _eval_rewards(out / "dit")
    assert len(dit) == 2 and dit[-1] != dit[0], dit

    cache = PriorCache(out / "priors")
    rows = [(t, row_seed(0, t, 0)) for t in PROMPTS]
    spec = {"export": str(out / "export"), "out": str(tmp_path), "rows": rows}
    loaded = run_cli([PYTHON, "-c", LOADER, json.dumps(spec)], timeout=300, env={"PYTHONPATH": ""})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text()) == {"project_importable": False}
    tokens = load_file(str(tmp_path / "tokens.safetensors"))
    for i, (text, _) in enumerate(rows):
        assert torch.equal(tokens[f"row{i}"], cache.tokens("train", text, 0)), text
    for part, stage in (("transformer", "dit"), ("vision_language_encoder", "ar")):
        trained = load_file(str(_final(out / stage) / "trainable.safetensors"))
        state = load_file(str(tmp_path / f"{part}.safetensors"))
        assert trained and set(trained) <= set(state), part
        for name, value in trained.items():
            assert torch.equal(state[name], value), (part, name)
