"""A tiny MoE transformer trained 50 steps with expert parallelism x FSDP2 (issue 16, "Tests and measurement"), on
the CPU over gloo (2, 4 and 8 processes): its loss falls, and its loss curve is the single-process model's on the same
global batches, step by step.

The model: embedding, 2 blocks of [RMSNorm -> causal multi-head attention (plain PyTorch) -> RMSNorm -> MoE], RMSNorm,
LM head. The EP run replaces each block's machmoe.MoE by ExpertParallelMoE.from_moe (EP over the 2 ranks), prepares
the experts with shard_experts_fsdp2 on the "expert_fsdp" dimension of the 2-D mesh of docs/PARALLEL.md (of size 1
here: the experts stay whole, a hook divides their gradient by ep_size) and shards everything else with fully_shard
over the 2 data-parallel ranks. Each rank trains on its own batch; the reference is the unsharded model, same initial
weights, on the concatenation of the ranks' batches (one process, no EP; every rank runs it, to compare its own
shards). A second test runs the true 2-D case on 4 ranks: EP = 2 x expert-FSDP = 2 (the experts sharded by FSDP2
across the EP groups). Both compare the first step's gradients, every step's loss and the final weights.

test_expert_parallel_gpu.py runs the same training (train_ep_and_reference) on 2 GPUs over NCCL in bf16.
"""
import copy
import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import machmoe
from machmoe.parallel import ExpertParallelMoE, shard_experts_fsdp2
from test_expert_parallel import assert_scenario, gen, spawn_scenarios


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 2
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    expert_dim: int = 32     # n: the width of an expert's hidden layer (each half of SwiGLU)
    batch: int = 8           # sequences per rank and step
    seq: int = 32            # tokens per sequence fed to the model (the targets are the next 32)
    steps: int = 50
    lr: float = 1e-2
    seed: int = 20


class TinyBlock(torch.nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.heads = c.heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(c.dim), torch.nn.RMSNorm(c.dim)
        self.qkv = torch.nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.proj = torch.nn.Linear(c.dim, c.dim, bias=False)
        self.moe = machmoe.MoE(c.dim, c.expert_dim, c.experts, c.top_k)

    def forward(self, h):
        B, S, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(B, S, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(B, S, d))
        return h + self.moe(self.norm2(h)).output


class TinyLM(torch.nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.emb = torch.nn.Embedding(c.vocab, c.dim)
        self.blocks = torch.nn.ModuleList(TinyBlock(c) for _ in range(c.layers))
        self.norm = torch.nn.RMSNorm(c.dim)
        self.head = torch.nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


def lm_batch(c: TinyConfig, step: int, rank: int) -> torch.Tensor:
    """(batch, seq + 1) tokens, the same on every machine. Token 0 of a sequence is its mode m in {0, 1}, token 1 is
    random, and then t[i+1] = perm_m(t[i]) for two fixed random permutations of the vocabulary. Token i alone leaves
    two candidates for t[i+1] (ln 2 nats); attending to position 0 resolves them. Loss floor: ln(vocab)/seq for the
    unpredictable token 1."""
    perms = torch.stack([torch.randperm(c.vocab, generator=gen("ep-train-perm", c.seed, m)) for m in range(2)])
    g = gen("ep-train-data", c.seed, step, rank)
    mode = torch.randint(2, (c.batch,), generator=g)
    cols = [mode, torch.randint(c.vocab, (c.batch,), generator=g)]
    for _ in range(c.seq - 1):
        cols.append(perms[mode, cols[-1]])
    return torch.stack(cols, 1)


def next_token_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference_name(name: str) -> str:
    return name.replace(".moe.experts.", ".moe.")


def _compare(model, ref, get, local_experts):
    """Relative Frobenius differences of get(param) between the EP model and the reference, by parameter name
    (expert tensors: this rank's slice of the reference). full_tensor() is a collective: every rank calls it in the
    same (named_parameters) order."""
    ref_params = dict(ref.named_parameters())
    errors = {}
    for name, p in model.named_parameters():
        a = _full(get(p))
        b = get(ref_params[_reference_name(name)])
        if ".moe.experts." in name:
            b = b[local_experts]
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        errors[name] = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    return errors


def train_ep_and_reference(rank, world, c: TinyConfig, *, device, dtype, ep=None):
    """Trains the EP x FSDP2 model (this rank's batch) and the single-process reference (every rank's batch) for
    c.steps AdamW steps from the same initial weights. Returns {"ep": [loss per step, mean over ranks], "ref": [...],
    "grad_errors": {param: relative difference of the first step's gradient}, "param_errors": {param: relative
    difference after the last step}}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    ep = ep or world
    torch.manual_seed(c.seed)
    ref = TinyLM(c).to(device, dtype)
    model = copy.deepcopy(ref)
    # docs/PARALLEL.md's 2-D recipe: EP groups of size ep inside world / ep replicas of the experts.
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("expert_fsdp", "ep"))
    dp = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    ignored = set()
    for blk in model.blocks:
        blk.moe = ExpertParallelMoE.from_moe(blk.moe, group=mesh["ep"].get_group())
        whole = shard_experts_fsdp2(blk.moe, mesh["expert_fsdp"])
        fully_shard(blk, mesh=dp, ignored_params=whole)
        ignored |= whole
    fully_shard(model, mesh=dp, ignored_params=ignored)
    first = model.blocks[0].moe
    local_experts = slice(first.expert_offset, first.expert_offset + first.num_local_experts)
    # foreach=False: with the experts outside FSDP, the EP model's parameters mix DTensors and plain tensors, which
    # one foreach kernel call refuses ("mixed torch.Tensor and DTensor"); the reference uses the same per-tensor path.
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=c.lr, foreach=False)
    losses, ref_losses, grad_errors = [], [], None
    for step in range(c.steps):
        loss = next_token_loss(model, lm_batch(c, step, rank).to(device))
        opt.zero_grad()
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # SUM: gloo has no AVG
        losses.append(mean.item() / world)

        everyone = torch.cat([lm_batch(c, step, r) for r in range(world)]).to(device)
        ref_loss = next_token_loss(ref, everyone)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        if step == 0:
            grad_errors = _compare(model, ref, lambda p: p.grad, local_experts)
        opt.step()
        ref_opt.step()
    param_errors = _compare(model, ref, lambda p: p, local_experts)
    return {"ep": losses, "ref": ref_losses, "grad_errors": grad_errors, "param_errors": param_errors}


def mean(values):
    return sum(values) / len(values)


# ---- the CPU scenarios ----------------------------------------------------------------------------------------

CPU_CONFIG = TinyConfig()
# Measured on the CPU (float64 since 2026-11-26; torch 2.11), 2 / 4 / 8 ranks: the loss goes from 3.56-3.61 (mean of the
# first 5 steps) to 0.19-0.20 (last 5; the task's floor is ln(64)/32 = 0.13); the EP curve differs from the single-process
# one by at most 1.1e-7 / 1.9e-7 / 2.3e-7 relative per step (the loss is evaluated in float32, next_token_loss), the
# first step's gradients by 8.6e-16 / 6.1e-16 / 1.1e-15, the final weights by 6.4e-10 / 9.3e-14 / 4.6e-12 (the
# router's logits from x @ W_r^T here, from the library's router in the reference). The test ran in float32 before:
# there the 8-rank run's per-step and final-weight differences (2.3e-6 and 7.0e-6 on one machine) reached 1.2e-5 and
# 4.1e-5 on another (its float32 kernels round differently, and 50 AdamW steps amplify that), past the bounds below.
#   AdamW is invariant to a constant factor on a gradient, so the curve alone barely sees a wrong gradient
# convention: without the experts' 1/ep_size the curve moved by only 1e-5 relative (measured). The first step's
# gradients are compared directly for that reason (that mistake makes them differ by 100%).
#   bf16 on GPUs cannot be held to these: its rounding (unit roundoff 3.9e-3) differs between the runs by a few
# 1e-3 of each first-step gradient, and AdamW lets the trajectories drift apart chaotically; a bf16 stand-in
# measured up to 0.04 nats (15%) on single steps, 2% on the last-5 means. test_expert_parallel_gpu.py's TRAINING_*
# bounds: 5e-2 on the first-step gradients, 0.1 + 0.1 * loss per step, 10% on the last-10 mean.
CPU_FALL = 0.25        # last-5 mean < CPU_FALL * first-5 mean (measured 0.054)
CPU_CURVE_RTOL = 2e-6   # per step, |ep - ref| <= rtol * ref
CPU_GRAD_RTOL = 1e-12   # the first step's gradients, every parameter, relative Frobenius
CPU_PARAM_RTOL = 1e-7   # the weights after the last step


def check_cpu_training(rank, world, c, ep):
    torch.set_num_threads(1)
    r = train_ep_and_reference(rank, world, c, device=torch.device("cpu"), dtype=torch.float64, ep=ep)
    losses, ref = r["ep"], r["ref"]
    if rank == 0:
        worst_step = max(abs(a - b) / b for a, b in zip(losses, ref))
        print(f"EP {ep} x FSDP2 on {world} ranks (CPU, float64): loss {mean(losses[:5]):.4f} -> "
              f"{mean(losses[-5:]):.4f}; single process {mean(ref[:5]):.4f} -> {mean(ref[-5:]):.4f}; largest "
              f"per-step relative difference {worst_step:.2e}; first-step gradients "
              f"{max(r['grad_errors'].values()):.2e}, final weights {max(r['param_errors'].values()):.2e}", flush=True)
    assert all(math.isfinite(v) for v in losses + ref), (losses, ref)
    for name, err in r["grad_errors"].items():
        assert err <= CPU_GRAD_RTOL, f"first-step gradient of {name}: relative difference {err:.2e}"
    for step, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= CPU_CURVE_RTOL * b, f"step {step}: EP loss {a:.7f}, single process {b:.7f}"
    assert mean(losses[-5:]) < CPU_FALL * mean(losses[:5]), losses
    for name, err in r["param_errors"].items():
        assert err <= CPU_PARAM_RTOL, f"{name} after {c.steps} steps: relative difference {err:.2e}"


def scenario_training_ep2_fsdp2_50_steps(rank, world):
    """EP = 2 over both ranks; the experts whole on each (expert_fsdp of size 1), the rest sharded by FSDP2."""
    assert world == 2
    check_cpu_training(rank, world, CPU_CONFIG, ep=2)


def scenario_training_ep2_expert_fsdp2_50_steps(rank, world):
    """4 ranks: EP groups {0, 1}, {2, 3}; each expert sharded by FSDP2 over its 2 replicas ({0, 2}, {1, 3}); the
    rest sharded over all 4. 4 sequences per rank, so that the reference's global batch stays 16."""
    assert world == 4
    check_cpu_training(rank, world, replace(CPU_CONFIG, batch=4), ep=2)


def scenario_training_ep4_expert_fsdp2_8_ranks_50_steps(rank, world):
    """8 ranks (one 8-GPU host's worth): EP groups {0..3}, {4..7} with 8 experts (2 per rank); each expert sharded by
    FSDP2 over its 2 replicas ({r, r+4}); the rest sharded over all 8. 2 sequences per rank: global batch 16."""
    assert world == 8
    check_cpu_training(rank, world, replace(CPU_CONFIG, batch=2, experts=8), ep=4)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_scenarios(2, __name__, ["training_ep2_fsdp2_50_steps"], str(tmp_path_factory.mktemp("ep_train2")))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn_scenarios(4, __name__, ["training_ep2_expert_fsdp2_50_steps"],
                           str(tmp_path_factory.mktemp("ep_train4")))


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    return spawn_scenarios(8, __name__, ["training_ep4_expert_fsdp2_8_ranks_50_steps"],
                           str(tmp_path_factory.mktemp("ep_train8")))


def test_training_ep2_fsdp2_two_ranks(two_ranks):
    assert_scenario(two_ranks, "training_ep2_fsdp2_50_steps")


def test_training_ep2_expert_fsdp2_four_ranks(four_ranks):
    assert_scenario(four_ranks, "training_ep2_expert_fsdp2_50_steps")


def test_training_ep4_expert_fsdp2_eight_ranks(eight_ranks):
    assert_scenario(eight_ranks, "training_ep4_expert_fsdp2_8_ranks_50_steps")
