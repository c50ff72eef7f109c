"""Depth 3 of the verl plug-in's tests: verl 0.9.1's whole ``main_ppo`` with
``trainer.v1.trainer_mode=anchor_rl`` on the CPU, for PVPO, V0.5 and VAPO.

Not part of the README's test command (the seven launches take minutes, mostly verl's and
Ray's start-up): ``.ci/run`` runs this file after the suite, by name
(``python -m pytest -q -p no:cacheprovider tests/integrations/verl_loop_checks.py``; the
name keeps it out of the default collection).

Each method is launched twice through :mod:`verl_main_ppo` (the plug-in's CPU mode, the
``anchor_rl`` rollout backend, anchor-rl's tiny random model, 8 prompts whose reward rule
is picked by ``data_source``: ``easy`` always 1, ``hard`` 1 only with the answer, ``coin``
about half): steps 1-2 with a checkpoint at step 2, then a second launch that resumes from
it and runs step 3. The reward workers append every response they score to a file, so
the tests count what verl's agent loop sampled: presampling, training rollouts, teacher
rows and top-ups. V0.5's launches (a KL loss and a KL in the reward, several mini-batches
per step) and VAPO's (a KL in the reward under its length-adaptive GAE) also load
:mod:`verl_probe`, which records every optimizer step of the workers, every advantage
stage of the trainer and every mini-batch verl's critic worker trains on.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import sys
import types
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import verl_main_ppo as loop  # noqa: E402

from anchor_rl.anchors.store import AnchorStore  # noqa: E402
from anchor_rl.integrations.verl.data import row_key  # noqa: E402

N = 2
"""actor_rollout_ref.rollout.n of every method (verl_main_ppo.METHOD_OVERRIDES)."""


class Runs:
    """Both launches of one method in one directory, and what they left there."""

    def __init__(self, out: Path, method: str, probe: bool = False) -> None:
        self.out, self.method = out, method
        self.first = loop.launch(out, method, 2, probe=probe)
        assert self.first.returncode == 0, self.first.stdout[-6000:]
        self.second = loop.launch(out, method, 3, probe=probe)
        assert self.second.returncode == 0, self.second.stdout[-6000:]
        self.metrics = {**loop.metrics(out, method, 2), **loop.metrics(out, method, 3)}
        self.folder = out / "checkpoints" / method

    def state(self, step: int) -> dict:
        return torch.load(self.folder / f"global_step_{step}" / "anchor_rl.pt", weights_only=True)

    def scored(self, steps: int) -> list[tuple[str, float]]:
        """(data_source, score) of every response verl's reward scored in one launch."""
        path = self.out / f"scored_{self.method}_{steps}.tsv"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(line.split("\t")[0], float(line.split("\t")[-1])) for line in lines]

    def probed(self, kind: str, steps: int) -> list[dict]:
        """What :mod:`verl_probe` recorded in one launch: ``kind`` ``optim`` (every optimizer
        step, in order; one process) or ``advantage`` (every advantage stage)."""
        files = sorted((self.out / f"probe_{self.method}_{steps}").glob(f"{kind}_*.pt"))
        assert len({f.name.split("_")[1] for f in files}) <= 1, files  # one process
        return [torch.load(f, weights_only=False) for f in files]

    def total(self, name: str, steps: range) -> float:
        return sum(self.metrics[s].get(name, 0.0) for s in steps)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verl_loop")
    loop.prepare(out)
    return out


@pytest.fixture(scope="module")
def pvpo(base: Path) -> Runs:
    return Runs(base, "pvpo")


@pytest.fixture(scope="module")
def v05(base: Path) -> Runs:
    return Runs(base, "v05", probe=True)


@pytest.fixture(scope="module")
def vapo(base: Path) -> Runs:
    return Runs(base, "vapo", probe=True)


def stored_anchors(out: Path, method: str, digest: str) -> dict[str, tuple[int, float]]:
    """data_source/question -> (rollouts, mean reward) of the anchors under ``digest``."""
    store = AnchorStore(out / f"anchors_{method}.db")
    keys = {
        row_key([{"role": "user", "content": f"What is {q}?"}], a, s): f"{s}/{q}"
        for s, q, a in loop.PROMPTS
    }
    stats = store.get_anchors(digest, list(keys))
    return {keys[k]: (s.n, s.mean) for k, s in stats.items()}


def check_resumed(runs: Runs) -> None:
    """Steps 1-2 in the first launch, step 3 alone in the second (resumed from global_step_2,
    never from scratch), the method state saved at both checkpoints."""
    assert sorted(loop.metrics(runs.out, runs.method, 2)) == [1, 2]
    assert sorted(loop.metrics(runs.out, runs.method, 3)) == [3]
    for step in (2, 3):
        state = runs.state(step)
        assert state["method"] == runs.method
    assert runs.state(3)["anchor_key"] == runs.state(2)["anchor_key"]
    assert (runs.folder / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def check_presampled(runs: Runs) -> None:
    """PVPO's and V0.5's anchors: presampled once through verl's agent loop and reward, M
    rollouts of each of the 8 prompts, the rewards as the reward rule gives them."""
    scored = runs.scored(2)
    presampled = scored[: len(loop.PROMPTS) * loop.M]
    assert len(scored) > len(presampled)
    anchors = stored_anchors(runs.out, runs.method, runs.state(2)["anchor_key"])
    assert len(anchors) == len(loop.PROMPTS)
    for name, (n, mean) in anchors.items():
        assert n == loop.M, name
        if name.startswith(("easy/", "drift/")):
            assert mean == 1.0
        elif name.startswith("hard/"):
            assert mean == 0.0  # a random model never writes "#### 5"
    assert sorted(s for s, _ in presampled) == sorted(
        s for s, _, _ in loop.PROMPTS for _ in range(loop.M)
    )


def test_pvpo_through_main_ppo(pvpo: Runs) -> None:
    """PVPO: presampling into the store, group sampling (the always-solved prompts never
    reach training), teacher rows with log pi_gt as their old log-probs, anchors in the
    advantages; resumed at step 3 with the same anchors and nothing presampled again."""
    check_resumed(pvpo)
    check_presampled(pvpo)
    # one optimizer step per step (one mini-batch): the resumed actor is the saved one
    check_resumed_engine(pvpo.folder / "global_step_2" / "actor",
                         pvpo.folder / "global_step_3" / "actor")  # fmt: skip
    training = pvpo.scored(2)[len(loop.PROMPTS) * loop.M :] + pvpo.scored(3)
    assert len(training) == 3 * loop.BATCH * N  # nothing presampled again at the resume
    # group sampling dropped the prompts the reference always solved
    assert not {"easy", "drift"} & {s for s, _ in training}
    teacher = pvpo.total("pvpo/teacher_rows", range(1, 4))
    # the hard prompts are solved only by their teacher rows (the field teacher's answer)
    solved_hard = sum(1 for s, r in training if s == "hard" and r == 1.0)
    assert 1 <= solved_hard <= teacher
    for step in (1, 2, 3):
        m = pvpo.metrics[step]
        assert 0.0 <= m["pvpo/anchor_mean"] <= 1.0
        # one mini-batch, so the ratio is exactly 1 on sampled rows; teacher rows carry
        # old = log pi_gt = 0, so their ratio is pi_theta (far below 1)
        ratio = m["actor/anchor_rl/ratio_mean"]
        if m.get("pvpo/teacher_rows", 0.0) > 0:
            assert ratio < 0.95, step
        else:
            assert ratio == pytest.approx(1.0, abs=1e-5), step


def test_pvpo_resume_refuses_a_changed_anchor_key(pvpo: Runs) -> None:
    """A third launch whose presample key differs (another reference identity) is refused
    before it samples anything, naming the checkpoint's key."""
    done = loop.launch(pvpo.out, "pvpo", 4, ["anchor_rl.pvpo.reference=another-model"])
    assert done.returncode != 0
    text = done.stdout
    assert "the checkpoint's anchors are under the presample key" in text
    assert pvpo.state(3)["anchor_key"] in text
    assert pvpo.scored(4) == []  # refused before presampling
    assert 4 not in loop.metrics(pvpo.out, "pvpo", 4)


def test_v05_through_main_ppo(v05: Runs) -> None:
    """V0.5: the anchor prior presampled, the fused baseline, the KL loss to verl's reference
    worker, top-ups through verl's agent loop and reward (every rollout the metrics count was
    scored by verl's reward worker), the history prior continuing at step 3 from the
    checkpoint's state."""
    check_resumed(v05)
    check_presampled(v05)
    training = v05.scored(2)[len(loop.PROMPTS) * loop.M :] + v05.scored(3)
    extra = v05.total("v05/extra_rollouts", range(1, 4))
    assert len(training) == 3 * loop.BATCH * N + extra
    for step in (1, 2, 3):
        m = v05.metrics[step]
        for name in ("v05/prior_mean", "v05/baseline_mean", "v05/weight_mean"):
            assert 0.0 <= m[name] <= 1.0, (step, name)
    # the KL loss to verl's reference worker (on the CPU: the CPU mode's unpinned offload): 0
    # while the policy is the reference, finite and positive once the actor has trained, in
    # the resumed launch too (its actor is the trained one, its reference the initial model)
    kl = [v05.metrics[step]["actor/kl_loss"] for step in (1, 2, 3)]
    assert all(math.isfinite(v) for v in kl), kl
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 1e-6 and kl[2] > 1e-6, kl
    before, after = v05.state(2)["prior"], v05.state(3)["prior"]
    assert before["step"] == 2 and after["step"] == 3  # restored, then one more step
    evidence = before["evidence"]
    assert set(evidence) <= set(after["evidence"])
    # prompts step 3 did not draw keep their counts exactly
    untouched = [k for k, v in after["evidence"].items() if v[2] != 3]
    assert untouched and all(after["evidence"][k] == evidence[k] for k in untouched)


def test_v05_tops_up_through_verls_agent_loop(v05: Runs) -> None:
    """Step 2 holds the drift prompt (anchor 1, training rewards 0): its first rollouts reject
    the prior, and the adaptive budget samples more of it through verl's agent loop; the
    top-ups are scored by verl's reward and join the batch."""
    m = v05.metrics[2]
    assert m["v05/rejected_init_frac"] > 0
    assert m["v05/extra_rollouts"] > 0 and m["v05/top_up_rounds"] >= 1
    assert m["v05/rollouts_per_prompt"] > N
    drift = [r for s, r in v05.scored(2)[len(loop.PROMPTS) * loop.M :] if s == "drift"]
    assert len(drift) > N and set(drift) == {0.0}


LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class Sharded(NamedTuple):
    """A ShardedTensor of one rank's FSDP1 checkpoint file as :func:`load_ranks` reads it:
    that rank's shards (``Shard``: ``tensor`` and ``metadata.shard_offsets``) and the whole
    tensor's size."""

    shards: list
    size: torch.Size


def _rebuild(func, new_type, args, state):  # noqa: ANN001, ANN202 (pickle's hook)
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(new_type, type) and issubclass(new_type, ShardedTensor):
        return Sharded(list(state[0]), torch.Size(state[1].size))
    return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _rebuild
        return super().find_class(module, name)


_PICKLE = types.ModuleType("sharded_as_shards")
_PICKLE.Unpickler, _PICKLE.load = _Unpickler, pickle.load
RANK_FILE = re.compile(r"^(\w+?)_world_size_(\d+)_rank_(\d+)\.pt$")


def load_ranks(folder: Path, kind: str) -> list[dict]:
    """Every rank's ``{kind}_world_size_{W}_rank_{r}.pt`` of a verl FSDP checkpoint folder
    (``kind`` ``model`` or ``optim``), in rank order, on the CPU. A ShardedTensor (FSDP1 at
    several ranks) is read as :class:`Sharded`, without the process group of its rank that
    unpickling one as a ShardedTensor requires. Raises where the folder lacks a rank."""
    found = {}
    for path in folder.glob(f"{kind}_world_size_*_rank_*.pt"):
        m = RANK_FILE.match(path.name)
        if m and m.group(1) == kind:
            found[int(m.group(3))] = (int(m.group(2)), path)
    worlds = {w for w, _ in found.values()}
    if len(worlds) != 1 or sorted(found) != list(range(next(iter(worlds)))):
        raise RuntimeError(f"{folder}: {kind} files of ranks {sorted(found)}, world sizes "
                           f"{sorted(worlds)}: not one file per rank")  # fmt: skip
    # verl saves DTensors, whose device mesh pickles as an object: not weights_only
    return [torch.load(found[r][1], map_location="cpu", weights_only=False,
                       pickle_module=_PICKLE) for r in sorted(found)]  # fmt: skip


def full_tensor(*parts: object) -> torch.Tensor:
    """One weight of a checkpoint as one local tensor, from its value in each rank's file
    (rank order): :class:`Sharded` (FSDP1 at several ranks; the shards placed at their
    offsets), a plain tensor (FSDP1 at world size 1, which torch runs as ``NO_SHARD``) or a
    DTensor (FSDP2, world size 1)."""
    if isinstance(parts[0], Sharded):
        size = parts[0].size
        shards = [s for part in parts for s in part.shards]
        out = torch.zeros(size, dtype=shards[0].tensor.dtype)
        assert sum(s.tensor.numel() for s in shards) == out.numel(), ("shards", size)
        for s in shards:
            where = tuple(
                slice(o, o + n)
                for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes, strict=True)
            )
            out[where] = s.tensor.reshape(s.metadata.shard_sizes)  # fmt: skip
        return out
    if len(parts) > 1:
        raise NotImplementedError("only FSDP1 checkpoints (ShardedTensors) of several ranks are "
                                  "read; an FSDP2 one (DTensors) only at world size 1")  # fmt: skip
    (t,) = parts
    return t.to_local() if hasattr(t, "to_local") else t


def unit_sizes(
    order: list[str], weights: dict[str, torch.Tensor], numels: list[int], world: int = 1
) -> list[int] | None:
    """The sizes of FSDP1's flat parameters (one per FSDP unit) when ``weights`` concatenate
    in ``order``, where the optimizer's flat state has ``numels`` elements: a unit of ``n``
    elements sharded over ``world`` ranks is padded to ``world * ceil(n / world)``. None
    where ``order`` gives no such units."""
    sizes, total = [], 0
    for n in order:
        total += weights[n].numel()
        i = len(sizes)
        if i < len(numels) and numels[i] - world < total <= numels[i]:
            sizes.append(total)
            total = 0
    return sizes if len(sizes) == len(numels) and total == 0 else None


def flat_layout(weights: dict[str, torch.Tensor], numels: list[int], world: int = 1) -> list[str]:
    """The named weights in the order FSDP1 (``use_orig_params=False``, verl's default)
    concatenates them into flat parameters of ``numels`` elements (padded to a multiple of
    ``world``, the ranks they are sharded over), one per FSDP unit: the root unit's weights
    (all but the decoder layers'; a tied ``lm_head.weight`` counted once), then each decoder
    layer's, each in state-dict order. Raises where no order's unit sizes are ``numels``."""
    names = list(weights)
    tied = [n for n in names if n.endswith("lm_head.weight")]
    candidates = []
    for drop in ([], tied):
        kept = [n for n in names if n not in drop]
        unit = {n: int(m.group(1)) if (m := LAYER.search(n)) else -1 for n in kept}
        candidates.append(sorted(kept, key=lambda n: unit[n]))  # stable: root, layers
        candidates.append(kept)
    for order in candidates:
        if unit_sizes(order, weights, numels, world) is not None:
            return order
    raise RuntimeError(f"FSDP1 flat layout not matched: flat sizes {numels}, "
                       f"{len(names)} named weights")  # fmt: skip


def split_flat(state: dict, weights: dict[str, torch.Tensor]) -> dict[int, dict]:
    """Optimizer state over FSDP1's flat parameters, ``{k: {step, exp_avg[numel_k],
    exp_avg_sq[numel_k]}}``, as per-weight state ``{i: {step, exp_avg, exp_avg_sq}}`` with
    each weight's shape, ``weights`` (name -> tensor) in the flat layout's order
    (:func:`flat_layout`)."""
    split, k, offset = {}, 0, 0
    for i, w in enumerate(weights.values()):
        numel = w.numel()
        split[i] = {key: v if v.dim() == 0 else
                    v.flatten()[offset:offset + numel].reshape(w.shape)
                    for key, v in state[k].items()}  # fmt: skip
        offset += numel
        if offset == state[k]["exp_avg"].numel():
            k, offset = k + 1, 0
    assert k == len(state) and offset == 0, (k, len(state), offset)
    return split


def per_weight(state: dict, weights: dict[str, torch.Tensor]) -> dict[int, dict]:
    """An optimizer's state as per-weight state in ``weights``' order: FSDP2's (one entry
    per weight) as it is, FSDP1's (one per flat parameter) split by :func:`split_flat`."""
    shapes = [s["exp_avg"].shape for s in state.values()]
    if shapes == [w.shape for w in weights.values()]:
        return state
    return split_flat(state, weights)


def engine_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """The weights, the optimizer's per-parameter state and its hyper-parameters of one verl
    FSDP checkpoint folder (FSDP2 at world size 1, FSDP1 at any), as local fp32 tensors,
    weights in the optimizer's order (a tied ``lm_head.weight`` dropped), FSDP1's flat
    optimizer state split into the named weights. At several ranks each rank holds a slice
    of every weight (ShardedTensors) and of every flat parameter (its optimizer state):
    the weights are assembled, the flat states concatenated in rank order and their padding
    dropped."""
    models, optims = load_ranks(folder, "model"), load_ranks(folder, "optim")
    world = len(models)
    weights = {name: full_tensor(*(m[name] for m in models)).float() for name in models[0]}
    state = {}
    for i in optims[0]["state"]:
        parts = [o["state"][i] for o in optims]
        state[i] = {}
        for k, v in parts[0].items():
            if world > 1 and torch.as_tensor(v).dim() == 0:  # the step: the same on every rank
                assert all(torch.equal(torch.as_tensor(p[k]), torch.as_tensor(v)) for p in parts)
                state[i][k] = torch.as_tensor(v).float()
            elif world > 1:  # FSDP1: this rank's slice of the flat parameter
                state[i][k] = torch.cat([full_tensor(p[k]).flatten() for p in parts]).float()
            else:
                state[i][k] = full_tensor(v).float()
    (group,) = optims[0]["param_groups"]
    shapes = [s["exp_avg"].shape for s in state.values()]
    if [w.shape for w in weights.values()][: len(shapes)] == shapes:  # FSDP2: per weight
        if len(weights) == len(state) + 1:  # the tiny Llama ties lm_head to the embeddings
            weights.pop(next(n for n in weights if n.endswith("lm_head.weight")))
        return weights, state, group
    numels = [s["exp_avg"].numel() for s in state.values()]
    order = flat_layout(weights, numels, world)
    weights = {n: weights[n] for n in order}
    sizes = unit_sizes(order, weights, numels, world)
    state = {i: {k: v if v.dim() == 0 else v[:size] for k, v in s.items()}
             for (i, s), size in zip(state.items(), sizes, strict=True)}  # fmt: skip
    return weights, split_flat(state, weights), group


def fsdp1_ready() -> None:
    """A process group of world size 1 unless one exists: ``torch.load`` unpickles a
    ShardedTensor only inside one of the world size it was saved at (:func:`engine_state`
    reads FSDP1 checkpoints through :func:`load_ranks`, which needs none)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def replay(before: Path, steps: list[tuple[dict, dict]], after: Path) -> None:
    """The engine that ran the resumed training step started from the weights and optimizer
    state saved in ``before``, and its optimizer steps are ``steps``: each one's AdamW moments
    (``{index: {step, exp_avg, exp_avg_sq}}``) and hyper-parameters, in order. Each step's
    moments are the previous ones advanced by one gradient (``m = b1 m' + (1 - b1) g`` fixes
    ``g``, and then ``v = b2 v' + (1 - b2) g^2`` must hold), AdamW's update from those moments,
    applied from ``before``'s weights step by step, gives ``after``'s weights, and the last
    moments are ``after``'s. An engine that started from other weights or a fresh optimizer
    fails (its weights differ from ``before``'s by the earlier steps, about the learning rate
    per weight). Steps recorded over FSDP1's flat parameters are split into the named weights
    as the checkpoints are (:func:`per_weight`)."""
    w0, s0, _ = engine_state(before)
    w1, s1, _ = engine_state(after)
    assert list(w0) == list(w1) and len(w0) == len(s1) and steps
    steps = [(per_weight(state, w0), group) for state, group in steps]  # FSDP1: flat
    weights = dict(w0)
    for n, (state, group) in enumerate(steps):
        lr, (b1, b2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        assert len(state) == len(w0), n
        for i, name in enumerate(w0):
            previous = s0[i] if n == 0 else steps[n - 1][0][i]
            step = float(state[i]["step"])
            assert step == float(previous["step"]) + 1, (n, name)
            m, v = state[i]["exp_avg"], state[i]["exp_avg_sq"]
            grad = (m - b1 * previous["exp_avg"]) / (1 - b1)
            torch.testing.assert_close(v, b2 * previous["exp_avg_sq"] + (1 - b2) * grad**2,
                                       rtol=1e-4, atol=1e-12, msg=f"{n} {name}")  # fmt: skip
            update = (m / (1 - b1**step)) / (v.sqrt() / (1 - b2**step) ** 0.5 + eps)
            weights[name] = weights[name] * (1 - lr * decay) - lr * update
    lr = steps[-1][1]["lr"]
    moved = 0.0
    for i, name in enumerate(w0):
        torch.testing.assert_close(w1[name], weights[name], rtol=0, atol=lr * 1e-3, msg=name)
        for k in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(s1[i][k], steps[-1][0][i][k], msg=f"{name} {k}")
        moved = max(moved, (w1[name] - w0[name]).abs().max().item())
    assert moved > lr / 2  # the resumed step trained: the check compares moved weights


def check_resumed_engine(before: Path, after: Path) -> None:
    """:func:`replay` of a training step with one optimizer step (one mini-batch, one epoch):
    its moments are the ones ``after`` saved."""
    _, state, group = engine_state(after)
    replay(before, [(state, group)], after)


def recorded_steps(records: list[dict]) -> list[tuple[dict, dict]]:
    """:mod:`verl_probe`'s optimizer records as :func:`replay`'s steps."""
    return [(dict(enumerate(r["state"])), r["group"]) for r in records]


def test_v05_resumed_actor_replays_every_optimizer_step(v05: Runs) -> None:
    """V0.5's resumed step 3 makes several optimizer steps (one prompt's rollouts per
    mini-batch, top-ups included) with its KL loss in the gradient: every one, recorded in
    the worker by :mod:`verl_probe`, replays from the step-2 checkpoint to the step-3 one."""
    steps = recorded_steps(v05.probed("optim", 3))
    assert len(steps) >= 2  # one mini-batch per prompt, two prompts per step
    replay(v05.folder / "global_step_2" / "actor", steps, v05.folder / "global_step_3" / "actor")


def test_replay_fails_for_a_checkpoint_paired_with_the_wrong_run(pvpo: Runs, v05: Runs) -> None:
    """The replays can fail: V0.5's recorded steps from PVPO's step-2 actor, PVPO's resumed
    step from V0.5's, and V0.5's steps from its own step-3 checkpoint (a run that did not
    resume from step 2) are refused."""
    steps = recorded_steps(v05.probed("optim", 3))
    v05_2, v05_3 = (v05.folder / f"global_step_{k}" / "actor" for k in (2, 3))
    pvpo_2, pvpo_3 = (pvpo.folder / f"global_step_{k}" / "actor" for k in (2, 3))
    with pytest.raises(AssertionError):
        replay(pvpo_2, steps, v05_3)
    with pytest.raises(AssertionError):
        check_resumed_engine(v05_2, pvpo_3)
    with pytest.raises(AssertionError):
        replay(v05_3, steps, v05_3)


def test_v05_reward_carries_the_kl_to_the_reference(v05: Runs) -> None:
    """``algorithm.use_kl_in_reward`` with V0.5 (``kl_penalty=kl``, a fixed beta): in every
    step's advantage stage the reward is the score minus beta * (old - ref) per response
    token, with verl's reference worker's log-probs, and the advantages are built on it: two
    rollouts of one prompt differ in advantage by their rewards' difference, KL included.
    At step 1 the actor is the reference and the penalty is 0; after training it is not."""
    records = v05.probed("advantage", 2) + v05.probed("advantage", 3)
    assert len(records) == 3
    beta = loop.KL_IN_REWARD
    shifts = []
    for step, r in enumerate(records, start=1):
        assert v05.metrics[step]["actor/reward_kl_penalty_coeff"] == pytest.approx(beta)
        mask = r["response_mask"]
        kl = (r["old_log_probs"] - r["ref_log_prob"]) * mask
        torch.testing.assert_close(r["token_level_rewards"], r["token_level_scores"] - beta * kl,
                                   rtol=0, atol=1e-6)  # fmt: skip
        penalty = beta * kl.sum(-1)
        shifts.append(penalty.abs().max().item())
        rewards = r["token_level_rewards"].sum(-1)
        valid = r["valid"].nonzero().flatten().tolist()
        adv = r["advantages"]
        for i in valid:  # one advantage per response: r_i - b(prompt_i)
            torch.testing.assert_close(adv[i][mask[i] > 0], adv[i, 0].expand(int(mask[i].sum())))
        pairs = [(i, j) for i in valid for j in valid if i < j and r["uid"][i] == r["uid"][j]]
        assert pairs, step
        for i, j in pairs:
            assert adv[i, 0] - adv[j, 0] == pytest.approx((rewards[i] - rewards[j]).item(),
                                                          abs=1e-5), (step, i, j)  # fmt: skip
    assert shifts[0] < 1e-5 and shifts[1] > 1e-3 and shifts[2] > 1e-3, shifts


def test_vapo_through_main_ppo(vapo: Runs) -> None:
    """VAPO: verl's critic (FSDP2 on the CPU) trained alone at step 1 (critic_warmup), the
    actor from step 2 with VAPO's loss (the NLL term set through verl's worker group in both
    launches), VAPO's critic metrics, the critic's checkpoint saved and resumed: the resumed
    step starts from the saved critic's weights and optimizer state."""
    check_resumed(vapo)
    assert vapo.scored(2) and len(vapo.scored(3)) == loop.BATCH * N  # no presampling
    assert "actor/pg_loss" not in vapo.metrics[1]  # value pretraining: the actor waits
    for step in (1, 2, 3):
        m = vapo.metrics[step]
        assert "critic/vf_loss" in m, step
        for name in ("value_mse", "explained_variance", "policy_lam"):
            assert name in json.dumps(sorted(m)), (step, name)
    for step in (2, 3):
        assert "actor/anchor_rl/nll_loss" in vapo.metrics[step], step
    for step in (2, 3):
        critic = vapo.folder / f"global_step_{step}" / "critic"
        assert critic.is_dir() and any(critic.iterdir())
    # the resumed launch's critic (and actor) are the saved ones: step 3 started from step
    # 2's weights and optimizer state
    for role in ("critic", "actor"):
        check_resumed_engine(vapo.folder / "global_step_2" / role,
                             vapo.folder / "global_step_3" / role)  # fmt: skip


def kl_in_reward(record: dict, beta: float) -> torch.Tensor:
    """The token rewards ``[B, T]`` (float64) verl's ``apply_kl_penalty`` (``kl_penalty=kl``,
    fixed ``beta``) makes of one advantage stage's record: ``score - beta * (old - ref)`` on
    response tokens, the score alone elsewhere."""
    mask = record["response_mask"].double()
    kl = (record["old_log_probs"].double() - record["ref_log_prob"].double()) * mask
    return record["token_level_scores"].double() - beta * kl


def gae_by_hand(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                lam: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """GAE (gamma 1) ``[B, T]`` in float64 over each row's policy tokens (``mask[B, T]`` > 0),
    skipping masked ones, with one lambda per row (``lam[B]``); 0 on masked tokens."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        a_next = v_next = 0.0
        for t in reversed(mask[b].nonzero().flatten().tolist()):
            delta = float(rewards[b, t]) + v_next - float(values[b, t])
            a_next, v_next = delta + float(lam[b]) * a_next, float(values[b, t])
            adv[b, t] = a_next
    return adv


def vapo_advantages_by_hand(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                            lam_alpha: float, lam_min: float) -> torch.Tensor:  # fmt: skip
    """VAPO's policy advantages ``[B, T]`` recomputed in float64 from token ``rewards``, the
    critic's ``values`` and ``mask`` (all ``[B, T]``): GAE with gamma 1 and the
    length-adaptive lambda ``1 - 1/(lam_alpha * l)`` per row (``l`` its policy tokens,
    clamped to ``[lam_min, 1 - 1e-6]``), whitened over the batch's policy tokens (unbiased
    variance), 0 on masked tokens."""
    mask = mask.double()
    lam = (1 - 1 / (lam_alpha * mask.sum(-1))).clamp(lam_min, 1 - 1e-6)
    adv = gae_by_hand(rewards.double(), values.double(), mask, lam)
    kept = adv[mask > 0]
    return torch.where(mask > 0, (adv - kept.mean()) / (kept.var() + 1e-8).sqrt(), 0)


def test_vapo_reward_carries_the_kl_to_the_reference(vapo: Runs) -> None:
    """``algorithm.use_kl_in_reward`` with VAPO (``kl_penalty=kl``, a fixed beta, no KL loss)
    inside verl's loop: in every step's advantage stage the token rewards are the score minus
    beta * (old - ref) per response token, with verl's reference worker's log-probs; the
    policy's advantages are the whitened length-adaptive GAE of those rewards on the critic's
    values, and the critic's returns their reward-to-go (lambda 1), all recomputed here in
    float64. The penalty is 0 while the actor is the reference (steps 1 and 2: the critic
    trains alone at step 1) and moves the rewards once it has trained (step 3)."""
    records = vapo.probed("advantage", 2) + vapo.probed("advantage", 3)
    assert len(records) == 3
    beta = loop.KL_IN_REWARD
    shifts = []
    for step, r in enumerate(records, start=1):
        assert vapo.metrics[step]["actor/reward_kl_penalty_coeff"] == pytest.approx(beta)
        knobs = r["vapo"]
        assert knobs["policy_lam"] == "adaptive" and knobs["lam"] == 1.0 and knobs["whiten"]
        assert knobs["lam_alpha"] == loop.VAPO_LAM_ALPHA and r["gamma"] == 1.0
        mask = r["response_mask"].double()
        rewards = kl_in_reward(r, beta)
        torch.testing.assert_close(r["token_level_rewards"].double(), rewards,
                                   rtol=0, atol=1e-6, msg=f"step {step}")  # fmt: skip
        shifts.append((rewards - r["token_level_scores"].double()).sum(-1).abs().max().item())
        lam = 1 - 1 / (knobs["lam_alpha"] * mask.sum(-1))
        assert ((lam > 0) & (lam < 1)).any(), step  # the GAE's lambda is not 0 or 1 throughout
        expected = vapo_advantages_by_hand(rewards, r["values"], mask, knobs["lam_alpha"],
                                           knobs["lam_min"])  # fmt: skip
        torch.testing.assert_close(r["advantages"].double(), expected, rtol=0, atol=1e-6,
                                   msg=f"step {step}")  # fmt: skip
        to_go = rewards.flip(-1).cumsum(-1).flip(-1) * mask
        torch.testing.assert_close(r["returns"].double(), to_go, rtol=0, atol=1e-6,
                                   msg=f"step {step}")  # fmt: skip
    assert shifts[0] < 1e-5 and shifts[1] < 1e-5 and shifts[2] > 1e-3, shifts
    # at step 3 the KL changed the advantages: those of the scores alone differ
    r = records[2]
    knobs = r["vapo"]
    scores_only = vapo_advantages_by_hand(r["token_level_scores"], r["values"],
                                          r["response_mask"], knobs["lam_alpha"],
                                          knobs["lam_min"])  # fmt: skip
    assert (scores_only - r["advantages"].double()).abs().max() > 1e-3


def critic_steps(records: list[dict]) -> list[list[dict]]:
    """:mod:`verl_probe`'s critic records (one per mini-batch the critic worker trained on, in
    order) grouped by training step: a step ends with the mini-batch marked ``last``."""
    steps, current = [], []
    for record in records:
        current.append(record)
        if record["last"]:
            steps.append(current)
            current = []
    assert not current, "a critic update without its last mini-batch"
    return steps


def unmatched_critic_rows(advantage: dict, minibatches: list[dict], atol: float = 1e-6) -> list:
    """The rows verl's critic worker trained on in one step (``minibatches``: its records, each
    row's ``returns[T_i]`` and ``response_mask[T_i]``) that are not the returns the trainer's
    advantage stage wrote (``advantage``: ``returns[B, T]``, ``response_mask[B, T]``), matched
    one to one in any order: a row matches an unused trainer row whose first ``T_i`` returns
    agree to ``atol``, whose mask is the same there and 0 after it. Each unmatched row is
    listed as (mini-batch, row), and each trainer row the critic never received as
    ("missing", row); empty when the critic received exactly the trainer's returns."""
    returns, mask = advantage["returns"].double(), advantage["response_mask"]

    def same(i: int, got: torch.Tensor, got_mask: torch.Tensor) -> bool:
        n = got.shape[0]
        return (
            torch.equal(mask[i, :n], got_mask.to(mask.dtype))
            and not mask[i, n:].any()
            and not returns[i, n:].any()
            and (returns[i, :n] - got.double()).abs().max().item() <= atol
        )

    unused = list(range(returns.shape[0]))
    problems: list = []
    for k, record in enumerate(minibatches):
        rows = zip(record["returns"], record["response_mask"], strict=True)
        for j, (got, got_mask) in enumerate(rows):
            match = next((i for i in unused if same(i, got, got_mask)), None)
            if match is None:
                problems.append((k, j))
            else:
                unused.remove(match)
    return problems + [("missing", i) for i in unused]


def test_vapo_critic_trains_on_the_returns_the_trainer_wrote(vapo: Runs) -> None:
    """At every step (step 1's value pretraining included) verl's critic worker trains on
    exactly the returns VAPO's advantage stage wrote, its value loss's target: every row the
    worker received, recorded inside it by :mod:`verl_probe`, is one of the trainer's rows
    (returns to 1e-6 and the response mask), each trainer row received once. The check
    fails for returns moved by 1e-5 on one row."""
    advantage = vapo.probed("advantage", 2) + vapo.probed("advantage", 3)
    critic = critic_steps(vapo.probed("critic", 2)) + critic_steps(vapo.probed("critic", 3))
    assert len(advantage) == len(critic) == 3, (len(advantage), len(critic))
    for step, (record, minibatches) in enumerate(zip(advantage, critic, strict=True), start=1):
        assert unmatched_critic_rows(record, minibatches) == [], step
    # the rows differ, so a mix-up of rows would show
    rows = advantage[2]["returns"]
    assert (rows - rows[:1]).abs().max() > 1e-3
    moved = [dict(r, returns=list(r["returns"])) for r in critic[2]]
    moved[0]["returns"][0] = moved[0]["returns"][0] + 1e-5
    problems = unmatched_critic_rows(advantage[2], moved)
    assert (0, 0) in problems and len(problems) == 2, problems  # and its trainer row missing
