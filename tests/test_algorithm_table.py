"""The algorithm table (`config/algorithms.py`): every consumer reads it, and a new decoder algorithm is its
own code (a loss, an `Algorithm` class, a config section) and one table entry, with nothing else in the
package to edit.

Unit tests, plus one short training run of a toy algorithm registered from this file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch
from conftest import DIT_SMALL
from safetensors.torch import load_file

from glm_training.algorithms.awm import config as awm_config
from glm_training.algorithms.awm import losses as awm
from glm_training.algorithms.base import Algorithm as AlgorithmBase
from glm_training.algorithms.decoder.forward_math import noised_latents
from glm_training.algorithms.decoder.ode import keep_for_update, sample_ode
from glm_training.algorithms.decoder.rollout import DecoderRollout
from glm_training.algorithms.decoder.sde import LOG_PROBS
from glm_training.algorithms.decoder.trajectory import SDE_STEPS
from glm_training.algorithms.flow_grpo import config as flow_grpo_config
from glm_training.algorithms.flow_grpo.algorithm import WINDOW_STARTS
from glm_training.algorithms.flow_grpo.losses import KL_FNS, LOG_RATIOS
from glm_training.algorithms.grpo import config as grpo_config
from glm_training.algorithms.grpo.algorithm import AGGREGATIONS, IMPORTANCE_SAMPLING
from glm_training.algorithms.nft import config as nft_config
from glm_training.algorithms.nft.losses import DECAY_SCHEDULES
from glm_training.build import build_trainer
from glm_training.cli import run
from glm_training.config import (
    ALGORITHMS,
    AlgoConfig,
    AlgorithmSpec,
    ConfigError,
    DiffusionSamplingConfig,
    RunConfig,
    algorithm_of,
    load_config,
    load_run_config,
    option,
    options,
    register_algorithm,
)
from glm_training.distributed.strategies import STRATEGIES
from glm_training.engine.advantages import ADVANTAGE_FNS
from glm_training.engine.ema import EMA_CALL_FNS
from glm_training.metrics import read_metrics
from glm_training.pipeline.ar import DECODING_PATHS
from glm_training.pipeline.dit import predict_velocity
from glm_training.rewards.combine import COMBINE_FNS


@pytest.mark.parametrize(
    "choices, table",
    [
        (options.SCALE_REWARDS, ADVANTAGE_FNS),
        (options.REWARD_COMBINES, COMBINE_FNS),
        (options.STRATEGIES, STRATEGIES),
        (options.EMA_CALLS, EMA_CALL_FNS),
        (flow_grpo_config.SDE_TYPES, SDE_STEPS),
        (flow_grpo_config.CPS_LOG_PROBS, LOG_PROBS),
        (flow_grpo_config.SDE_WINDOW_SCHEDULES, WINDOW_STARTS),
        (flow_grpo_config.DIT_KL_TYPES, KL_FNS),
        (flow_grpo_config.RATIO_NORMS, LOG_RATIOS),
        (nft_config.NFT_DECAY_TYPES, DECAY_SCHEDULES),
        (grpo_config.IMPORTANCE_SAMPLING_LEVELS, IMPORTANCE_SAMPLING),
        (grpo_config.LOSS_AGGREGATIONS, AGGREGATIONS),
        (awm_config.AWM_WEIGHTINGS, awm.WEIGHTINGS),
        (awm_config.AWM_TIME_TYPES, awm.TIME_TYPES),
        (awm_config.AWM_ANCHOR_DECAY_TYPES, awm.ANCHOR_DECAY_TYPES),
        (grpo_config.DECODING_PATHS, DECODING_PATHS),
    ],
)
def test_each_choice_list_is_the_keys_of_the_table_it_picks_from(choices, table):
    # The config spells the choices (so --help needs no torch); a key added to a table must be added there.
    assert sorted(map(str, choices)) == sorted(map(str, table))


def test_every_shipped_algorithm_resolves_from_its_config():
    for name, algorithm in ALGORITHMS.items():
        cfg = load_config(config=algorithm.config)
        assert type(cfg) is algorithm.run_config and cfg.algo.name == name
        assert algorithm_of(cfg) is algorithm and issubclass(algorithm.algorithm_class(), AlgorithmBase)
    # A saved config without algo.name (older runs) is its half's first algorithm.
    assert algorithm_of({"component": "ar"}).name == "grpo"
    assert algorithm_of({"component": "dit", "algo": {}}).name == "flow_grpo"
    with pytest.raises(ConfigError, match="algo.name.*Did you mean 'nft'"):
        algorithm_of({"component": "dit", "algo": {"name": "nfd"}})


# ---------------------------------------------------------------------------------------------------------
# A toy decoder algorithm, defined here as a user would in their own module: reward-weighted flow matching
# on the policy's own ODE samples (the shape of AWM, simplified). Nothing in glm_training/ names it.


def toy_loss(
    velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """[B] advantage-weighted flow-matching error: weight * mean((v - (noise - x0))^2) per sample."""
    target = noise.float() - x0.float()
    return weight * ((velocity.float() - target) ** 2).flatten(1).mean(dim=1)


@dataclass
class ToyConfig(AlgoConfig):
    """The toy algorithm's settings: the shared ones (`AlgoConfig`) and its own."""

    name: str = option("toy", "the DiT algorithm: toy here")
    train_time: float = option(0.5, "the one noise level the update trains at")


@dataclass
class ToyTrainConfig(RunConfig):
    """A toy decoder run."""

    run_name: str = option("toy", "output folder name")
    component: str = option("dit", "the half it trains")
    sampling: DiffusionSamplingConfig = field(default_factory=DiffusionSamplingConfig)
    algo: ToyConfig = field(default_factory=ToyConfig)

    def _check_algorithm(self) -> None:
        if not 0 < self.algo.train_time < 1:
            raise ConfigError("algo.train_time", "must be in (0, 1).")

    def rollout_latents_per_sample(self) -> tuple[int, str]:
        return 1, "1 final latent"


@dataclass
class ToyRollout:
    samples: list


class ToyAlgorithm(AlgorithmBase):
    """A decoder algorithm written as a user would: the decoder's rollout frame, its own loss."""

    def __init__(self, cfg, parts):
        super().__init__(cfg, parts)
        self.decoder = DecoderRollout(cfg, parts)

    def rollout(self, group_prompts, group_ids, step, scoring):
        chunks, _, _, images = self.decoder.sample(group_prompts, group_ids, step, scoring, self.sample_chunk)
        return ToyRollout(chunks), images

    def sample_chunk(self, latents, cond, timesteps, sigmas, step, generator):
        final = sample_ode(self.policy.trainable, latents, cond, timesteps, sigmas, guidance_scale=1.0)
        return keep_for_update(cond, final), final

    def update(self, batch, step):
        chunks = batch.rollout.samples
        sizes = [c.final_latents.shape[0] for c in chunks]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        generator = torch.Generator().manual_seed(self.collector.sample_seed(step))

        def micro_steps(mini):
            total = sum(sizes[m] for m in mini)
            for m in mini:
                weight = batch.advantages[offsets[m] : offsets[m] + sizes[m]].float()
                noise = torch.randn(chunks[m].final_latents.shape, generator=generator)
                yield functools.partial(self.loss_and_backward, chunks[m], noise, weight, total)

        update = self.updates.run(len(chunks), micro_steps, ("loss",))
        return self.collector.mean_over_ranks({**update.means, "grad_norm": update.grad_norm})

    def loss_and_backward(self, chunk, noise, weight, total):
        x0 = chunk.final_latents.to(self.device)
        t = torch.full((x0.shape[0],), self.cfg.algo.train_time)
        x_t = noised_latents(x0, noise.to(self.device), t.to(self.device))
        timestep = (t * 1000).to(self.device)
        with self.policy.precision():
            v = predict_velocity(self.policy.model, x_t, timestep, chunk.cond.to(self.device), 1.0)
            loss_b = toy_loss(v, x0, noise.to(self.device), weight.to(self.device))
        self.policy.backward(loss_b.sum() / total)
        return {"loss": loss_b.detach().mean()}


@pytest.fixture
def toy_algorithm():
    entry = register_algorithm(
        AlgorithmSpec(
            name="toy",
            component="dit",
            run_config=ToyTrainConfig,
            schema="toy_schema",
            algorithm=ToyAlgorithm,
            config="",
        )
    )
    yield entry
    ALGORITHMS.pop("toy")


def test_a_registered_toy_algorithm_trains_through_the_entry_point(tmp_path, tiny_model_dir, toy_algorithm):
    config = tmp_path / "toy.yaml"
    config.write_text(
        "defaults:\n  - toy_schema\n  - model: tiny\n  - _self_\nsampling:\n  guidance_scale: 1.0\n"
    )
    out = tmp_path / "run"
    args = [
        "--config",
        str(config),
        *DIT_SMALL,
        "trainer.num_steps=1",
        "optim.lr=1e-2",
        f"trainer.output_dir={out}",
    ]
    assert run("dit", "t2i_training", args) == 0  # train_dit.py's own call: the table picks ToyAlgorithm
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] != 0 and rows[0]["grad_norm"] > 0
    ckpt = out / "checkpoints" / "step-000001"
    trained = load_file(str(ckpt / "trainable.safetensors"))  # the tiny model trains every DiT weight
    base = load_file(str(next((tiny_model_dir / "transformer").glob("*.safetensors"))))
    assert trained.keys() == base.keys() and any(not torch.equal(trained[n], base[n]) for n in base)
    saved = load_run_config(ckpt / "config.yaml")
    assert type(saved) is ToyTrainConfig and saved.algo.train_time == 0.5
    with pytest.raises(ConfigError, match="algo.train_time"):
        load_config(["--config", str(config), "algo.train_time=2"])
    # The trainer a half's entry point builds must train that half.
    with pytest.raises(ConfigError, match="train_dit.py"):
        build_trainer(load_config(["--config", str(config)]), "ar")
