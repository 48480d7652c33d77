"""GRPO's config (GRPO, DAPO and GSPO are its settings): the AR rollout's `sampling` section, its `algo`
section and its run config (`python train_ar.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm_training.config.options import RUN_NAME_HELP, _check, _check_choice, check_resolution, option
from glm_training.config.run import AlgoConfig, RunConfig

DECODING_PATHS = ("loop", "generate")  # pipeline/ar.py DECODING_PATHS
SAMPLERS = ("policy", "folded")  # pipeline/ar_sampler.py SAMPLERS
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # algorithm.py IMPORTANCE_SAMPLING
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # algorithm.py AGGREGATIONS


@dataclass
class ARSamplingConfig:
    """The AR rollout: image-token sampling, and the frozen DiT that renders each sample for the reward."""

    height: int = option(64, "image height in pixels, a multiple of 32")
    width: int = option(64, "image width in pixels, a multiple of 32")
    temperature: float | None = option(
        None,
        (
            "The policy trained is the distribution the tokens are sampled from, so temperature /"
            " top_p / top_k unset (null) = what GlmImagePipeline itself samples with: the AR "
            "checkpoint's generation_config, and transformers' defaults where it is silent (real "
            "checkpoint and tiny model: 0.9 / 0.75 / 50). The resolved values are logged at start"
            ' ("AR sampling: ..."); a value set here overrides.'
        ),
    )
    top_p: float | None = option(None, "nucleus sampling threshold (1 = off; null = the pipeline's)")
    top_k: int | None = option(
        None, "top-k filter (0 = off; null = the pipeline's, transformers' 50 when unset)"
    )
    decoding: str = option(
        "loop",
        (
            "How image tokens are decoded. loop: the project's own decoding loop (positions computed up "
            "front, a preallocated KV cache, each token's log-prob computed in its step; ~20% faster than "
            "generate() on CPU, see docs/benchmarks.md); generate: transformers' generate(). Both draw "
            "the same tokens for a seed and record the same log-probs up to float rounding "
            "(tests/test_ar_logprobs.py)."
        ),
    )
    static_cache: bool = option(
        False,
        (
            'decoding=generate only: a static KV cache (transformers\' cache_implementation="static"), '
            "the same tokens for the same seed, log-probs equal up to fp32 rounding. The loop always "
            "preallocates its cache."
        ),
    )
    compile: bool = option(
        False,
        (
            "decoding=loop only: torch.compile of the decoding step (CUDA graphs on CUDA); compiles on first "
            "use and for every new batch size or resolution. The same tokens for the same seed."
        ),
    )
    sampler: str = option(
        "policy",
        (
            "Who draws the tokens (pipeline/ar_sampler.py). policy: the training module, LoRA layers "
            "computing their adapters. folded: a sampler apart from the learner, each LoRA adapter folded "
            "into a sampling copy of its layer (W + scale B A, refreshed before every rollout), so the "
            "decoding step runs the plain model and compiles into one graph with sampling.compile=true; "
            "prompts are left-padded to a multiple of 64 tokens. It draws from the policy's distribution "
            "up to float rounding: the learner still teacher-forces the old log-probs (first ratio exactly "
            "1) and sampling_logp_mean_diff / sampling_logp_max_diff log the gap. Needs LoRA and "
            "trainer.strategy=ddp; holds a copy of the adapted weights."
        ),
    )
    dit_num_steps: int = option(
        4, "denoising steps of the frozen DiT that renders each sample for the reward"
    )
    dit_guidance_scale: float = option(1.5, "classifier-free guidance of that DiT")
    dit_noise_seed: str = option(
        "step",
        (
            "The DiT noise that renders a group is fixed per group (rewards inside a group differ"
            ' only through the AR tokens). "step": drawn anew for every group of every step; '
            '"prompt": the same for a prompt at every step, which makes the reward a '
            "deterministic function of (prompt, tokens): less variance, at the cost of learning "
            "tokens for one noise draw per prompt."
        ),
    )

    def __post_init__(self) -> None:
        check_resolution(self.height, self.width)
        unset = "leave it unset (null) for the pipeline's own value."
        _check(
            self.temperature is None or self.temperature > 0, "sampling.temperature", f"must be > 0; {unset}"
        )
        _check(self.top_p is None or 0 < self.top_p <= 1, "sampling.top_p", f"must be in (0, 1]; {unset}")
        _check(self.top_k is None or self.top_k >= 0, "sampling.top_k", f"must be >= 0 (0 = off); {unset}")
        _check_choice(self.decoding, DECODING_PATHS, "sampling.decoding")
        _check(
            self.decoding == "generate" or not self.static_cache,
            "sampling.static_cache",
            "applies to sampling.decoding=generate; the decoding loop always preallocates its KV cache. "
            "Drop sampling.static_cache, or set sampling.decoding=generate.",
        )
        _check(
            self.decoding == "loop" or not self.compile,
            "sampling.compile",
            "compiles the decoding loop's step; set sampling.decoding=loop, or sampling.compile=false.",
        )
        _check_choice(self.sampler, SAMPLERS, "sampling.sampler")
        _check(
            self.sampler == "policy" or self.decoding == "loop",
            "sampling.sampler",
            "folded decodes with the decoding loop; set sampling.decoding=loop.",
        )
        _check(self.dit_num_steps >= 1, "sampling.dit_num_steps", "must be >= 1.")
        _check_choice(self.dit_noise_seed, ("step", "prompt"), "sampling.dit_noise_seed")


@dataclass
class DAPOConfig(AlgoConfig):
    """GRPO/DAPO token-level loss and dynamic sampling."""

    name: str = option(
        "grpo",
        "the AR model's algorithm: grpo (GRPO, DAPO and GSPO are its settings: clip-higher, dynamic "
        "sampling, algo.importance_sampling_level=sequence)",
    )
    epsilon_low: float = option(
        0.2,
        (
            "The ratio is clipped to [1 - epsilon_low, 1 + epsilon_high]. DAPO's clip-higher (0.2"
            " / 0.28) is for token-level ratios; GSPO's sequence-level ratios need far smaller "
            "ranges: the paper uses 3e-4 / 4e-4 (TRL's GSPO recipe: epsilon=3e-4, "
            "epsilon_high=4e-4)."
        ),
    )
    epsilon_high: float = option(0.28, "upper clip: 1 + epsilon_high (DAPO's clip-higher 0.28; GSPO: 4e-4)")
    importance_sampling_level: str = option(
        "token",
        (
            "token: one ratio per token (GRPO / DAPO). sequence: GSPO (arXiv 2507.18071; TRL's "
            'importance_sampling_level="sequence"), one ratio per sample, the geometric mean of '
            "its token ratios."
        ),
    )
    loss_aggregation: str = option("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum")
    beta: float = option(0.0, "KL (k3) coefficient")
    clip_ratio_c: float | None = option(
        None,
        "dual clip (verl's clip_ratio_c; verl's default 3.0): where the advantage is negative the token loss "
        "is at most -A c, so one very off-policy bad token cannot dominate a later mini-batch. null = off "
        "(TRL's loss). Token-level ratios only",
    )
    log_ratio_clamp: float | None = option(
        None,
        "clamp the token log-ratio to [-v, v] before exp (verl clamps at 20). null = off (TRL). Token-level "
        "ratios only",
    )
    kl_low_var_clamp: bool = option(
        False,
        "verl's low_var_kl: the k3 log-ratio clamped to [-20, 20] and the estimate to [-10, 10]. false = "
        "TRL's unclamped k3",
    )
    rollout_is_threshold: float | None = option(
        None,
        "verl's rollout importance sampling, token level, truncate mode (TIS): each token's weight "
        "min(p_learner / p_sampler, threshold) over the sampler-learner mismatch "
        "(algorithms/grpo/rollout_is.py); logs rollout_is_mean and rollout_is_ratio_fraction_high. "
        "null = off (verl's default; verl suggests 1.5-5 at token level)",
    )
    rollout_is: bool = option(
        False,
        "multiply each token's policy loss by that weight (verl's algorithm.rollout_is); false = measure "
        "only. Needs algo.rollout_is_threshold",
    )
    scale_rewards: str = option("group", "advantage scaling: group | batch | none")
    micro_batch_size: int = option(4, "samples per forward/backward pass of the AR model")
    dynamic_sampling: bool = option(
        True, "DAPO's dynamic sampling: drop flat groups (min_group_std) and resample"
    )
    min_group_std: float = option(
        0.0,
        (
            "A group whose reward std (population) is below this counts as flat: dynamic sampling"
            " drops it and frac_zero_std_groups counts it. 0 = only exact ties. Continuous "
            "rewards (PickScore, HPS, aesthetic) almost never tie, so set it to the reward's "
            "noise level there, or nothing is ever dropped and groups of pure noise get unit "
            "advantages."
        ),
    )
    max_resample_rounds: int = option(3, "extra sampling rounds per step to replace dropped groups")
    on_budget_exhausted: str = option("warn", "warn (train on what was found) | error")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(0 < self.epsilon_low < 1, "algo.epsilon_low", "must be in (0, 1).")
        _check(self.epsilon_high > 0, "algo.epsilon_high", "must be > 0.")
        _check_choice(
            self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS, "algo.importance_sampling_level"
        )
        _check(self.min_group_std >= 0, "algo.min_group_std", "must be >= 0 (0 = only exact ties are flat).")
        _check_choice(
            self.loss_aggregation,
            LOSS_AGGREGATIONS,
            "algo.loss_aggregation",
        )
        _check(
            self.clip_ratio_c is None or self.clip_ratio_c > 1,
            "algo.clip_ratio_c",
            f"must be > 1 (verl's default is 3.0) or null, got {self.clip_ratio_c}.",
        )
        _check(
            self.log_ratio_clamp is None or self.log_ratio_clamp > 0,
            "algo.log_ratio_clamp",
            f"must be > 0 (verl: 20) or null, got {self.log_ratio_clamp}.",
        )
        _check(
            self.importance_sampling_level == "token"
            or (self.clip_ratio_c is None and self.log_ratio_clamp is None),
            "algo.clip_ratio_c",
            "the dual clip and the log-ratio clamp act on token ratios; with importance_sampling_level="
            "sequence (GSPO) set algo.clip_ratio_c and algo.log_ratio_clamp to null.",
        )
        _check(
            self.rollout_is_threshold is None or self.rollout_is_threshold > 1,
            "algo.rollout_is_threshold",
            f"must be > 1 (verl suggests 1.5-5 at token level) or null, got {self.rollout_is_threshold}.",
        )
        _check(
            not self.rollout_is or self.rollout_is_threshold is not None,
            "algo.rollout_is",
            "applies the truncated importance weights, which algo.rollout_is_threshold sets; set it (e.g. "
            "algo.rollout_is_threshold=2.0), or algo.rollout_is=false.",
        )
        _check(self.micro_batch_size >= 1, "algo.micro_batch_size", "must be >= 1.")
        _check(self.max_resample_rounds >= 0, "algo.max_resample_rounds", "must be >= 0.")
        _check_choice(self.on_budget_exhausted, ("warn", "error"), "algo.on_budget_exhausted")


@dataclass
class ARTrainConfig(RunConfig):
    """`python train_ar.py`: GRPO/DAPO on the GLM-Image autoregressive token model."""

    run_name: str = option("ar", RUN_NAME_HELP)
    component: str = option("ar", "the half of GLM-Image that trains: ar here (train_dit.py trains dit)")
    sampling: ARSamplingConfig = field(default_factory=ARSamplingConfig)
    algo: DAPOConfig = field(default_factory=DAPOConfig)

    def _check_algorithm(self) -> None:
        _check(
            not (self.sampling.compile and self.trainer.strategy == "fsdp"),
            "sampling.compile",
            "is not supported with trainer.strategy=fsdp (sharded weights are gathered into new buffers, "
            "which compiled CUDA graphs do not follow); set sampling.compile=false.",
        )
        _check(
            self.sampling.sampler == "policy" or self.model.lora.enabled,
            "sampling.sampler",
            "folded folds LoRA adapters into a sampling copy, and model.lora.enabled is false; enable LoRA, "
            "or set sampling.sampler=policy (sampling.compile=true compiles the full model's decoding step).",
        )
        _check(
            self.sampling.sampler == "policy" or self.trainer.strategy == "ddp",
            "sampling.sampler",
            "folded keeps whole copies of the adapted weights, which trainer.strategy=fsdp shards; set "
            "trainer.strategy=ddp, or sampling.sampler=policy.",
        )
