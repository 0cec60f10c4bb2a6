"""The combine step's operators (torch.ops.machmoe.combine_rows / combine_rows_backward, machmoe/combine.hpp), which
the expert-parallel layer's combine runs on: against a float64 PyTorch transcription, through autograd
(gradcheck), opcheck (schema, fake kernel for torch.compile), argument errors, and on the GPU in bf16/fp16/fp32
(relative Frobenius error against float64, bitwise reruns, the edge shapes)."""
import pytest
import torch

import machmoe  # noqa: F401  (loads the operators)
from machmoe.parallel import _CombineRows

ops = torch.ops.machmoe


def make_case(T, d, top_k, *, max_pairs=6, padding=0, unsent=0.0, spare_rows=0, seed=0, dtype=torch.float64,
              device="cpu"):
    """Rows ~ N(0, 1), scores in (0.05, 0.95); each sent pair reads its own row (a random permutation)."""
    g = torch.Generator().manual_seed(seed)
    if top_k:
        P, offsets = T * top_k, None
    else:
        counts = torch.randint(0, max_pairs + 1, (T,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        P = int(offsets[-1]) + padding
    sent = torch.rand(P, generator=g) >= unsent
    R = int(sent.sum()) + spare_rows
    row_of_pair = torch.full((P,), -1, dtype=torch.int64)
    row_of_pair[sent] = torch.randperm(R, generator=g)[: int(sent.sum())]
    rows = torch.randn(R, d, generator=g, dtype=torch.float64)
    scores = 0.05 + 0.9 * torch.rand(P, generator=g, dtype=torch.float64)
    grad_out = torch.randn(T, d, generator=g, dtype=torch.float64)
    score_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(rows=rows.to(device, dtype), scores=scores.to(device, score_dtype),
                row_of_pair=row_of_pair.to(device, torch.int32),
                token_offsets=None if offsets is None else offsets.to(device, torch.int32), top_k=top_k, T=T,
                grad_out=grad_out.to(device, dtype))


def reference(c):
    """float64 transcription: each pair's token, its row (zeros when not sent), products and sums."""
    rows, scores = c["rows"].double().cpu(), c["scores"].double().cpu()
    rp, T = c["row_of_pair"].long().cpu(), c["T"]
    P = rp.shape[0]
    if c["top_k"]:
        token = torch.arange(P) // c["top_k"]
    else:
        off = c["token_offsets"].long().cpu()
        token = torch.bucketize(torch.arange(P), off[1:], right=True)  # T for padding pairs
    valid = (rp >= 0) & (token < T)
    y = torch.where(valid.unsqueeze(1), rows[rp.clamp(min=0)], 0.0) if rows.shape[0] else rows.new_zeros(P, rows.shape[1])
    go = c["grad_out"].double().cpu()
    g = torch.cat([go, go.new_zeros(1, go.shape[1])])[token]
    out = torch.zeros(T + 1, rows.shape[1], dtype=torch.float64).index_add_(0, token, scores.unsqueeze(1) * y)[:T]
    grad_scores = torch.where(valid, (g * y).sum(1), 0.0)
    grad_rows = torch.zeros_like(rows)
    grad_rows[rp[valid]] = scores[valid].unsqueeze(1) * g[valid]
    return out, grad_rows, grad_scores


def run(c, zero_rows=True):
    out = ops.combine_rows(c["rows"], c["scores"], c["row_of_pair"], c["token_offsets"], c["top_k"], c["T"])
    grad_rows, grad_scores = ops.combine_rows_backward(c["grad_out"], c["rows"], c["scores"], c["row_of_pair"],
                                                       c["token_offsets"], c["top_k"], True, True, zero_rows)
    return out, grad_rows, grad_scores


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


CASES = [
    dict(T=16, d=64, top_k=4),
    dict(T=1, d=8, top_k=1),
    dict(T=33, d=24, top_k=8, unsent=0.3, spare_rows=5),
    dict(T=40, d=17, top_k=0, max_pairs=7, padding=9, unsent=0.2, spare_rows=3),
    dict(T=12, d=32, top_k=0, max_pairs=0, padding=4),
    dict(T=6, d=16, top_k=70, unsent=0.1),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cpu_float64_matches_transcription(case):
    c = make_case(seed=case, **CASES[case])
    for got, want in zip(run(c), reference(c)):
        assert rel(got, want) < 1e-14


def test_cpu_float32_and_opcheck():
    c = make_case(T=9, d=16, top_k=0, max_pairs=5, padding=2, unsent=0.2, spare_rows=2, dtype=torch.float32)
    for got, want in zip(run(c), reference(c)):
        assert rel(got, want) < 1e-6
    torch.library.opcheck(ops.combine_rows, (c["rows"], c["scores"], c["row_of_pair"], c["token_offsets"], 0, 9))
    torch.library.opcheck(ops.combine_rows_backward, (c["grad_out"], c["rows"], c["scores"], c["row_of_pair"],
                                                      c["token_offsets"], 0, True, True, True))


def test_without_scores_is_the_plain_sum():
    c = make_case(T=11, d=10, top_k=0, max_pairs=4, padding=3, unsent=0.2, spare_rows=2, seed=3)
    got = ops.combine_rows(c["rows"], None, c["row_of_pair"], c["token_offsets"], 0, 11)
    c["scores"] = torch.ones_like(c["scores"])
    assert rel(got, reference(c)[0]) < 1e-15


@pytest.mark.parametrize("top_k", [3, 0])
def test_autograd_gradcheck(top_k):
    c = make_case(T=5, d=6, top_k=top_k, max_pairs=4, padding=2, unsent=0.25, spare_rows=2, seed=7)
    rows = c["rows"].clone().requires_grad_()
    scores = c["scores"].clone().requires_grad_()
    fn = lambda r, s: _CombineRows.apply(r, s, c["row_of_pair"], c["token_offsets"], top_k, c["T"], True)
    assert torch.autograd.gradcheck(fn, (rows, scores))


def test_double_backward_is_refused():
    c = make_case(T=4, d=6, top_k=2)
    rows = c["rows"].clone().requires_grad_()
    scores = c["scores"].clone().requires_grad_()
    out = _CombineRows.apply(rows, scores, c["row_of_pair"], None, 2, 4, False)
    (g,) = torch.autograd.grad(out.square().sum(), rows, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


def test_cpu_ignores_padding_pairs_and_bounds_top_k():
    c = make_case(T=6, d=4, top_k=0, max_pairs=3, padding=3, seed=5)
    rp = c["row_of_pair"].clone()
    rp[-1], rp[-2] = 10**6, rp[0]  # padding pairs: out of range, and a row another pair reads
    want = reference(c)
    c["row_of_pair"] = rp
    for got, w in zip(run(c), want):
        assert rel(got, w) < 1e-14
    k = make_case(T=4, d=8, top_k=2)
    with pytest.raises(ValueError, match=r"argument 'top_k': expected K in \[1, 2\^31 - 1\]"):
        ops.combine_rows(k["rows"], k["scores"][:0], k["row_of_pair"][:0], None, 2**62, 4)


def test_errors_name_the_argument():
    c = make_case(T=4, d=8, top_k=2)
    with pytest.raises(ValueError, match=r"combine_rows: argument 'row_of_pair': expected T \* top_k = 4 \* 3"):
        ops.combine_rows(c["rows"], c["scores"], c["row_of_pair"], None, 3, 4)
    with pytest.raises(ValueError, match=r"argument 'rows': expected dtype fp32 or fp64 on cpu"):
        ops.combine_rows(c["rows"].bfloat16(), c["scores"], c["row_of_pair"], None, 2, 4)
    with pytest.raises(ValueError, match=r"argument 'row_of_pair': expected dtype int32"):
        ops.combine_rows(c["rows"], c["scores"], c["row_of_pair"].long(), None, 2, 4)
    bad = c["row_of_pair"].clone()
    bad[3] = c["rows"].shape[0]
    with pytest.raises(ValueError, match=r"argument 'row_of_pair\[3\]': expected a row in \[0, 8\) or -1"):
        ops.combine_rows(c["rows"], c["scores"], bad, None, 2, 4)
    dup = c["row_of_pair"].clone()
    dup[5] = dup[1]
    with pytest.raises(ValueError, match=r"a row no other pair reads"):
        ops.combine_rows_backward(c["grad_out"], c["rows"], c["scores"], dup, None, 2, True, False, False)


GPU_CASES = CASES + [
    dict(T=300, d=7168, top_k=8),                                  # several column chunks per thread
    dict(T=257, d=2880, top_k=0, max_pairs=9, padding=5, unsent=0.1, spare_rows=7),
    dict(T=64, d=1536, top_k=40, unsent=0.05),                     # more pairs than one batch of 32
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_against_float64_and_bitwise_reruns(cuda, dtype, case):
    c = make_case(seed=100 + case, dtype=dtype, device=cuda, **GPU_CASES[case])
    want = reference(c)
    first = run(c)
    bound = 1e-2 if dtype != torch.float32 else 1e-5
    for name, got, w in zip(("out", "grad_rows", "grad_scores"), first, want):
        if w.numel() and w.norm() > 0:
            assert rel(got, w) < bound, name
        else:  # (no pair at all: zeros written, not left over)
            assert torch.equal(got.double().cpu(), w), name
    second = run(c)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    plain = ops.combine_rows(c["rows"], None, c["row_of_pair"], c["token_offsets"], c["top_k"], c["T"])
    c["scores"] = torch.ones_like(c["scores"])
    if c["T"]:
        assert rel(plain, reference(c)[0]) < bound


@pytest.mark.gpu
def test_gpu_rows_no_pair_reads_and_out_of_range_rows(cuda):
    c = make_case(T=20, d=64, top_k=3, unsent=0.4, spare_rows=6, dtype=torch.bfloat16, device=cuda)
    _, grad_rows, _ = run(c, zero_rows=True)
    read = torch.zeros(c["rows"].shape[0], dtype=torch.bool, device=cuda)
    rp = c["row_of_pair"].long()
    read[rp[rp >= 0]] = True
    assert not read.all() and torch.count_nonzero(grad_rows[~read]) == 0
    # On the GPU an index outside [-1, R) reads and writes nothing (the CPU raises): never out of bounds.
    bad = c["row_of_pair"].clone()
    bad[0], bad[1] = c["rows"].shape[0] + 1000, -5
    out = ops.combine_rows(c["rows"], c["scores"], bad, None, 3, 20)
    gr, gs = ops.combine_rows_backward(c["grad_out"], c["rows"], c["scores"], bad, None, 3, True, True, True)
    torch.cuda.synchronize()
    assert gs[0] == 0 and gs[1] == 0 and torch.isfinite(out).all()
