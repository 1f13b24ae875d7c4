"""FSDP2 with 2 processes (gloo, CPU): the same global batch split unevenly over 2 ranks trains
exactly like one process — losses, first-step gradients, and a sharded checkpoint resume."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM
from _dist_worker import run, scenario
from _tiny import one_thread, tiny_model  # noqa: F401  (one_thread: autouse fixture)
from test_trainer import CFG

from agentopd.trainer import TrainerConfig, export_checkpoint

# every global-batch term on: reward weights, TCAD weights and GRPO advantages per group
# (groups span both ranks), sampled-token k1 policy gradient
KWARGS = CFG | {"loss": "sampled_k1", "task_reward_coef": 0.5, "reward_beta": 0.5, "tcad_power": 1.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_one_process(tmp_path):
    pytest.importorskip("agentopd.losses")
    mp.spawn(run, args=(2, _free_port(), KWARGS, str(tmp_path / "ckpt2"), str(tmp_path / "out.pt")), nprocs=2)
    two = torch.load(tmp_path / "out.pt")
    one = scenario(TrainerConfig(**KWARGS), str(tmp_path / "ckpt1"))

    assert two["losses"] == pytest.approx(one["losses"], abs=1e-6)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], abs=1e-6)
    init = tiny_model().state_dict()
    for k in init:  # eps=1 Adam: equal first-step deltas <=> equal gradients (test_trainer.CFG)
        d2, d1 = (two["params_1"][k] - init[k]) / CFG["lr"], (one["params_1"][k] - init[k]) / CFG["lr"]
        torch.testing.assert_close(d2, d1, atol=1e-6, rtol=0, msg=k)
    # sharded DCP checkpoint: 3 steps + save + fresh Trainer + load + 3 steps == 6 steps
    assert two["resumed_losses"] == two["losses"]  # bit-identical
    for k, v in two["params_6"].items():
        assert torch.equal(two["resumed_params_6"][k], v), k
    assert two["step"] == 6
    # the 2-rank sharded checkpoint exported in this one process == the weights it was saved from
    export_checkpoint(tmp_path / "ckpt2", tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for k, v in two["params_3"].items():
        assert torch.equal(reloaded[k], v), k
