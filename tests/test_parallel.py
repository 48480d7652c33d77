"""The parallelism strategies (`glm_training.distributed.strategies`) seen from one process.

Their multi-rank behaviour runs for real in `test_fsdp.py` (FSDP2 against DDP, 2 ranks under torchrun) and
the DDP tests; here: which strategy a config gets, and what each answers without a process group.
"""

from __future__ import annotations

import logging

import pytest
import torch
from accelerate import Accelerator

from glm_training.config import load_config
from glm_training.distributed.strategies import DDP, FSDP, STRATEGIES, make_parallelism


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def test_fsdp_in_one_process_trains_unsharded_and_says_so(accelerator, caplog):
    cfg = load_config(config="t2i_training", overrides=["trainer.strategy=fsdp"])
    with caplog.at_level(logging.WARNING, logger="glm_training"):
        parallel = make_parallelism(cfg.trainer, accelerator, "dit")
    assert type(parallel) is DDP and not parallel.sharded and not parallel.equal_calls
    assert "nothing to shard" in caplog.text


def test_each_configured_strategy_has_an_implementation():
    cfg = load_config(config="t2i_training", overrides=[])
    assert cfg.trainer.strategy in STRATEGIES
    assert STRATEGIES == {"ddp": DDP, "fsdp": FSDP}
    assert FSDP.sharded and FSDP.equal_calls  # every forward through a sharded module is a collective


def test_ddp_defers_the_gradient_reduction_to_the_last_backward(accelerator):
    cfg = load_config(config="t2i_training", overrides=[])
    parallel = make_parallelism(cfg.trainer, accelerator, "dit")
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    model, optimizer = parallel.wrap(layer, optimizer)
    layer(torch.ones(1, 2)).sum().backward()
    norm = parallel.clip_grad_norm_(list(layer.parameters()), 1e9)
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in layer.parameters()]))
    assert float(norm) == pytest.approx(float(expected))
    with parallel.no_sync(model, last=True), parallel.sampling(layer):
        pass  # nothing to defer or gather in one process; the contexts exist for every strategy
