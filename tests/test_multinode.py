"""Two simulated nodes on one machine train exactly like one node with two processes (issue 23).

Two `torchrun --nnodes=2 --nproc_per_node=1` launchers meet through a c10d rendezvous on 127.0.0.1, as two
machines would through the first one's address (the SLURM launcher in `examples/` does the same per node);
their run must write the same `metrics.jsonl` rows as one `--nproc_per_node=2` launch, under DDP and FSDP.
Every launcher gets `OMP_NUM_THREADS=1` (torchrun sets it itself only for several local processes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
from conftest import DIT_SMALL, PYTHON, REPO, torchrun

from glm_training.metrics import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ARGS = [*DIT_SMALL, "trainer.num_steps=2", "trainer.save_every=0", "logging.tensorboard=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(script: str, args: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """One launcher per simulated node, started together, each one process; waits for both."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=multinode-test",
                script,
                *args,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    results = []
    for launcher in launchers:
        try:
            out, err = launcher.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in launchers:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(launcher.args, launcher.returncode, out, err))
    return results


def _without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not (k.endswith("_s") or "time" in k)} for row in rows]


def test_two_single_process_nodes_train_like_one_node_of_two(tmp_path):
    # Both strategies in one launch of each kind (tests/scripts/fsdp_check.py runs them one after the other).
    script = str(REPO / "tests" / "scripts" / "fsdp_check.py")

    def runs(where):
        return json.dumps(
            {s: [*ARGS, f"trainer.strategy={s}", f"trainer.output_dir={where / s}"] for s in ("ddp", "fsdp")}
        )

    one = torchrun(script, [str(tmp_path / "one"), "dit", runs(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    for node in _two_nodes(script, [str(tmp_path / "two"), "dit", runs(tmp_path / "two")]):
        assert node.returncode == 0, node.stderr[-3000:]
    for strategy in ("ddp", "fsdp"):
        reference = _without_timings(read_metrics(tmp_path / "one" / strategy / "metrics.jsonl"))
        assert [r["step"] for r in reference] == [1, 2]
        assert _without_timings(read_metrics(tmp_path / "two" / strategy / "metrics.jsonl")) == reference
    # The second run of each launch really was sharded over the two processes.
    reports = [json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(rep["fsdp"]["sharded"] and not rep["ddp"]["sharded"] for rep in reports)
