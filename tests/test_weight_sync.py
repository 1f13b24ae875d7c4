"""Weight sync of the Ray backend outside Ray (agentopd.backends.weight_sync): a broadcast group over gloo
(the CPU stand-in for NCCL: the same ProcessGroup API) with members in threads of this process."""

import threading

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from agentopd.backends.weight_sync import WeightGroup, WeightLayout, flatten


def _model(seed: int, tied: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied)  # fmt: skip
    return Qwen3ForCausalLM(cfg)


def _group_of(world: int, fn):
    """Run fn(rank, group) in `world` threads on one weight group; the results by rank."""
    store, addr, port = WeightGroup.host(world, timeout_s=30)
    results, errors = [None] * world, []

    def member(rank):
        try:
            group = WeightGroup.join(addr, port, rank, world, torch.device("cpu"), store=store if rank == 0 else None, timeout_s=30)
            results[rank] = fn(rank, group)
            group.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("tied", [True, False])
def test_broadcast_gives_every_member_the_senders_weights_tied_names_included(tied):
    sender, receiver = _model(0, tied), _model(1, tied)
    layout = WeightLayout.of(sender, torch.float32)
    assert ("lm_head.weight" in layout.aliases) == tied
    bucket = 3000  # bytes: tensors span buckets, buckets hold several tensors

    def fn(rank, group):
        if rank == 0:
            group.send(layout, sender.state_dict().items(), bucket_bytes=bucket)
            return None
        return group.receive(layout, bucket_bytes=bucket)

    got = _group_of(3, fn)
    want = sender.state_dict()
    for received in got[1:]:
        assert received.keys() == want.keys()
        assert all(torch.equal(received[k], want[k]) for k in want)
    receiver.load_state_dict(got[1])
    assert all(torch.equal(a, b) for a, b in zip(receiver.parameters(), sender.parameters()))


def test_broadcast_casts_to_the_layouts_dtype():
    sender = _model(0)
    layout = WeightLayout.of(sender, torch.bfloat16)
    got = _group_of(2, lambda rank, g: g.send(layout, sender.state_dict().items()) if rank == 0 else g.receive(layout))
    w = sender.state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert got[1]["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(got[1]["model.layers.0.mlp.up_proj.weight"], w.to(torch.bfloat16))
    assert layout.nbytes == 2 * sum(p.numel() for p in sender.parameters())


def test_a_sender_out_of_the_layouts_order_is_refused_by_name():
    sender = _model(0)
    layout = WeightLayout.of(sender, torch.float32)
    wrong = list(reversed(sender.state_dict().items()))
    with pytest.raises(ValueError, match="the layout expects model.embed_tokens.weight"):
        WeightGroup(None, 0, 1, torch.device("cpu"), None).send(layout, wrong)


def test_flatten_lays_the_layout_out_in_one_buffer():
    sender = _model(0)
    layout = WeightLayout.of(sender, torch.float32)
    views = layout.views(flatten(layout, sender.state_dict().items(), torch.device("cpu")))
    assert all(torch.equal(views[k], v) for k, v in sender.state_dict().items())
    assert views["lm_head.weight"].data_ptr() == views["model.embed_tokens.weight"].data_ptr()
