"""verl's FSDP1 checkpoints read back as named weights, on the CPU.

``benchmarks/verl_gpu.sh`` runs the depth-3 checks (tests/integrations/verl_loop_checks.py) on
GPU launches with ``strategy=fsdp`` (FSDP1) too. verl's FSDP1 engine wraps the model with
``use_orig_params=False``, so its optimizer steps one flat parameter per FSDP unit (the root,
then each decoder layer) and its checkpoint's optimizer state is flat; the checks'
``engine_state`` and ``replay`` split that state back into the named weights. Here the same
layout is built on the CPU: anchor-rl's tiny Llama wrapped by torch's FSDP1 with verl's own
wrap policy on a one-rank gloo group, two AdamW steps, each saved by verl's own
``FSDPCheckpointManager`` (the files the GPU runs write), and every optimizer step recorded by
``verl_probe``. A plain (unwrapped) copy of the model takes the same steps: the converted
weights and moments must equal its own, tensor by tensor.

The same at two gloo ranks (``torch.multiprocessing.spawn``; FSDP1 shards there): verl's
manager writes one model and one optimizer file per rank, the weights as ShardedTensors and
the optimizer state as each rank's slice of the flat parameters. ``engine_state`` reads them
without a process group and must give the plain model's weights and moments bit for bit.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import verl_loop_checks as checks  # noqa: E402
import verl_probe  # noqa: E402

LR, DECAY = 1e-3, 0.01


def _wrapped(model: torch.nn.Module, tokenizer) -> tuple:
    """``model`` wrapped as verl's FSDP1 engine wraps it (workers/engine/fsdp/transformer_impl.py,
    verl's wrap policy, flat parameters) but for ``sync_module_states``, which needs GPU
    parameters (a no-op on one rank, the same weights on both ranks here), with AdamW and
    verl's ``FSDPCheckpointManager`` saving model, optimizer and extra state:
    ``(wrapped, optim, manager)``."""
    from omegaconf import OmegaConf
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy

    wrapped = FSDP(
        model, auto_wrap_policy=get_fsdp_wrap_policy(model, config=None),
        device_id=torch.device("cpu"), use_orig_params=False,
    )  # fmt: skip
    optim = torch.optim.AdamW(wrapped.parameters(), lr=LR, weight_decay=DECAY)
    contents = ["model", "optimizer", "extra"]
    manager = FSDPCheckpointManager(
        model=wrapped, optimizer=optim, lr_scheduler=None, processing_class=tokenizer,
        checkpoint_config=OmegaConf.create({"load_contents": contents,
                                            "save_contents": contents}),
    )  # fmt: skip
    return wrapped, optim, manager


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory) -> dict:
    """Two steps of the tiny model under FSDP1 and of a plain copy; verl's checkpoints after
    each step, the probe's records, and the plain model's weights and AdamW state by name."""
    from anchor_rl.models.factory import build_model
    from anchor_rl.models.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("verl_fsdp1")
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        tokenizer = build_tokenizer()
        model = build_model("tiny", tokenizer, seed=0)
        assert model.config.tie_word_embeddings  # the layout's tied lm_head is exercised
        plain = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "switching to NO_SHARD" at world size 1
            wrapped, optim, manager = _wrapped(model, tokenizer)
        plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=DECAY)
        (out / "probe").mkdir()
        verl_probe.FOLDER = str(out / "probe")
        optim.register_step_post_hook(verl_probe._after_step)
        gen = torch.Generator().manual_seed(0)
        for step in (1, 2):
            ids = torch.randint(5, model.config.vocab_size, (2, 12), generator=gen)
            for net, opt in ((wrapped, optim), (plain, plain_optim)):
                loss = net(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                manager.save_checkpoint(str(out / f"step_{step}"), global_step=step)
        index = {id(p): n for n, p in plain.named_parameters()}
        return {
            "folders": [out / "step_1", out / "step_2"],
            "records": [
                torch.load(f, weights_only=False)
                for f in sorted((out / "probe").glob("optim_*.pt"))
            ],  # fmt: skip
            "weights": {n: p.detach().clone() for n, p in plain.named_parameters()},
            "state": {
                index[id(p)]: {k: torch.as_tensor(v).clone() for k, v in s.items()}
                for p, s in plain_optim.state.items()
            },  # fmt: skip
        }
    finally:
        verl_probe.FOLDER = None
        if own_group:
            dist.destroy_process_group()


def test_the_checkpoint_holds_fsdp1s_flat_optimizer_state(fsdp1):
    """What verl saved is the flat layout the conversion exists for: one 1-D state per FSDP
    unit (the root, then the 4 decoder layers), the weights by name, lm_head tied."""
    optim = torch.load(fsdp1["folders"][1] / "optim_world_size_1_rank_0.pt", weights_only=False)
    model = torch.load(fsdp1["folders"][1] / "model_world_size_1_rank_0.pt", weights_only=False)
    flat = [s["exp_avg"] for s in optim["state"].values()]
    assert len(flat) == 5 and all(t.dim() == 1 for t in flat)
    assert sum(t.numel() for t in flat) == sum(w.numel() for w in fsdp1["weights"].values())
    assert set(model) == set(fsdp1["weights"]) | {"lm_head.weight"}


def test_engine_state_converts_an_fsdp1_checkpoint_exactly(fsdp1):
    """The converted weights and per-weight AdamW moments equal the plain model's after the
    same two steps, bit for bit, in the optimizer's order (root unit first)."""
    weights, state, group = checks.engine_state(fsdp1["folders"][1])
    assert sorted(weights) == sorted(fsdp1["weights"])  # the tied lm_head dropped
    names = list(weights)
    assert names[:2] == ["model.embed_tokens.weight", "model.norm.weight"]  # the root unit
    assert group["lr"] == LR and group["weight_decay"] == DECAY
    for i, name in enumerate(names):
        torch.testing.assert_close(weights[name], fsdp1["weights"][name], rtol=0, atol=0)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            expected = fsdp1["state"][name][key].float()
            torch.testing.assert_close(state[i][key], expected, rtol=0, atol=0,
                                       msg=f"{name} {key}")  # fmt: skip


def test_a_wrong_layout_is_caught(fsdp1):
    """The comparison above sees a wrong split: two same-shaped weights of a layer swapped in
    the layout give moments unequal to the plain model's; sizes no order can give raise."""
    weights, _, _ = checks.engine_state(fsdp1["folders"][1])
    optim = torch.load(fsdp1["folders"][1] / "optim_world_size_1_rank_0.pt", weights_only=False)
    names = list(weights)
    q, k = (
        names.index("model.layers.0.self_attn.q_proj.weight"),
        names.index("model.layers.0.self_attn.k_proj.weight"),
    )
    names[q], names[k] = names[k], names[q]
    swapped = checks.split_flat(optim["state"], {n: weights[n] for n in names})
    # position q now names k_proj: the slice there is q_proj's moments, not k_proj's
    for i in (q, k):
        assert not torch.equal(swapped[i]["exp_avg"], fsdp1["state"][names[i]]["exp_avg"])
    with pytest.raises(RuntimeError, match="flat layout not matched"):
        checks.flat_layout(weights, [s["exp_avg"].numel() + 1 for s in optim["state"].values()])


def test_the_replays_run_on_fsdp1_checkpoints(fsdp1):
    """The depth-3 replays on FSDP1 outputs: the one-step replay from the step-1 checkpoint to
    the step-2 one, and the probe's recorded (flat) optimizer step replayed the same way; from
    the wrong checkpoint both fail."""
    before, after = fsdp1["folders"]
    records = fsdp1["records"]
    assert len(records) == 2 and len(records[1]["state"]) == 5  # flat, as recorded
    checks.check_resumed_engine(before, after)
    checks.replay(before, checks.recorded_steps(records[1:]), after)
    with pytest.raises(AssertionError):
        checks.replay(after, checks.recorded_steps(records[1:]), after)
    with pytest.raises(AssertionError):
        checks.check_resumed_engine(after, before)


def _two_ranks(rank: int, out: Path) -> None:
    """One of two gloo ranks (``torch.multiprocessing.spawn``): the tiny model under FSDP1
    (sharded, FULL_SHARD) with verl's wrap policy, two AdamW steps on the same batch as the
    plain copy's, each saved by verl's ``FSDPCheckpointManager`` (one file per rank)."""
    from anchor_rl.models.factory import build_model
    from anchor_rl.models.tokenizer import build_tokenizer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=(out / "rendezvous").as_uri(), rank=rank, world_size=2
    )
    try:
        tokenizer = build_tokenizer()
        model = build_model("tiny", tokenizer, seed=0)
        wrapped, optim, manager = _wrapped(model, tokenizer)
        for step, ids in enumerate(_batches(model.config.vocab_size), start=1):
            # the same batch on both ranks: their averaged gradient is the plain model's
            wrapped(input_ids=ids, labels=ids).loss.backward()
            optim.step()
            optim.zero_grad()
            manager.save_checkpoint(str(out / f"step_{step}"), global_step=step)
    finally:
        dist.destroy_process_group()


def _batches(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, vocab, (2, 12), generator=gen) for _ in range(2)]


@pytest.fixture(scope="module")
def fsdp1_two_ranks(tmp_path_factory) -> dict:
    """verl's FSDP1 checkpoints of two gloo ranks after each of two steps, and the plain
    model's weights and AdamW state by name after the same two steps."""
    import torch.multiprocessing as mp

    from anchor_rl.models.factory import build_model
    from anchor_rl.models.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("verl_fsdp1_two_ranks")
    mp.spawn(_two_ranks, args=(out,), nprocs=2)
    plain = build_model("tiny", build_tokenizer(), seed=0)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=DECAY)
    for ids in _batches(plain.config.vocab_size):
        plain(input_ids=ids, labels=ids).loss.backward()
        plain_optim.step()
        plain_optim.zero_grad()
    index = {id(p): n for n, p in plain.named_parameters()}
    return {
        "folders": [out / "step_1", out / "step_2"],
        "weights": {n: p.detach().clone() for n, p in plain.named_parameters()},
        "state": {
            index[id(p)]: {k: torch.as_tensor(v).clone() for k, v in s.items()}
            for p, s in plain_optim.state.items()
        },  # fmt: skip
    }


def test_two_ranks_save_sharded_tensors_and_flat_slices(fsdp1_two_ranks):
    """At two ranks each file holds a slice of every weight (a ShardedTensor, read without
    a process group) and of every unit's flat optimizer state, the slices of equal size and
    together the unit's weights plus at most one padding element; a folder missing a rank's
    file is refused."""
    folder = fsdp1_two_ranks["folders"][1]
    models, optims = checks.load_ranks(folder, "model"), checks.load_ranks(folder, "optim")
    assert len(models) == len(optims) == 2
    for name, full in fsdp1_two_ranks["weights"].items():
        parts = [m[name] for m in models]
        assert all(isinstance(p, checks.Sharded) and p.size == full.shape for p in parts)
        assert all(0 < sum(s.tensor.numel() for s in p.shards) < full.numel() for p in parts)
    flat = [[s["exp_avg"] for s in o["state"].values()] for o in optims]
    assert len(flat[0]) == 5 and [t.shape for t in flat[0]] == [t.shape for t in flat[1]]
    total = sum(2 * t.numel() for t in flat[0])
    assert 0 <= total - sum(w.numel() for w in fsdp1_two_ranks["weights"].values()) <= 5
    bare = folder.parent / "one_rank_missing"
    bare.mkdir()
    for f in folder.glob("*_rank_0.pt"):
        (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(RuntimeError, match="not one file per rank"):
        checks.engine_state(bare)


def test_engine_state_assembles_two_ranks_exactly(fsdp1_two_ranks):
    """The weights assembled from both ranks' shards and the moments split from both ranks'
    flat slices equal the plain model's after the same two steps, bit for bit."""
    weights, state, group = checks.engine_state(fsdp1_two_ranks["folders"][1])
    assert sorted(weights) == sorted(fsdp1_two_ranks["weights"])  # the tied lm_head dropped
    assert group["lr"] == LR and group["weight_decay"] == DECAY
    for i, name in enumerate(weights):
        torch.testing.assert_close(weights[name], fsdp1_two_ranks["weights"][name],
                                   rtol=0, atol=0, msg=name)  # fmt: skip
        for key in ("step", "exp_avg", "exp_avg_sq"):
            expected = fsdp1_two_ranks["state"][name][key].float()
            torch.testing.assert_close(state[i][key], expected, rtol=0, atol=0,
                                       msg=f"{name} {key}")  # fmt: skip


def test_the_replay_runs_on_two_rank_checkpoints(fsdp1_two_ranks):
    """The one-step replay from the step-1 checkpoint to the step-2 one passes on the two
    ranks' files and fails the other way round."""
    before, after = fsdp1_two_ranks["folders"]
    checks.check_resumed_engine(before, after)
    with pytest.raises(AssertionError):
        checks.check_resumed_engine(after, before)


def test_flat_layout_drops_the_padding_of_sharded_units():
    """A unit of an odd number of elements sharded over two ranks is padded by one: the flat
    layout matches it at world size 2, not at 1, and the unit sizes are the unpadded ones;
    several ranks' DTensors (FSDP2) are refused by name."""
    weights = {"model.embed_tokens.weight": torch.zeros(3, 1), "model.norm.weight":
               torch.zeros(2), "model.layers.0.mlp.up_proj.weight": torch.zeros(5)}  # fmt: skip
    order = checks.flat_layout(weights, [6, 6], world=2)
    assert order == list(weights)
    assert checks.unit_sizes(order, weights, [6, 6], world=2) == [5, 5]
    with pytest.raises(RuntimeError, match="flat layout not matched"):
        checks.flat_layout(weights, [6, 6])
    with pytest.raises(NotImplementedError, match="FSDP2"):
        checks.full_tensor(torch.zeros(2), torch.zeros(2))
