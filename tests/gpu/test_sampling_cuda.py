"""sample_from_logits on CUDA: no host sync, CUDA-graph capturable, bounded memory, same kept
sets as the CPU reference, and the reference distribution. Run on the device with
``python3 -m pytest --noconftest -q tests/gpu/test_sampling_cuda.py``."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import ddtree_reference as dr
import ddtree_utils as du

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

V = 151936


def params(rows, top_k, top_p, device="cuda"):
    return (
        torch.full((rows,), 0.7, device=device),
        torch.full((rows,), top_k, dtype=torch.int32, device=device),
        torch.full((rows,), top_p, device=device),
        torch.zeros(rows, device=device),
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_host_sync(backend):
    x = torch.randn(64, V, device="cuda")
    args = params(64, 1 << 30, 0.9)
    du.sample_from_logits(x, *args, backend=backend)  # warm-up (compilation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        du.sample_from_logits(x, *args, backend=backend)
        du.sample_tree_targets(x, *(a[:16] for a in args), 4, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_capture_and_replay(backend):
    x = torch.randn(32, V, device="cuda")
    args = params(32, 20, 0.9)
    du.sample_from_logits(x, *args, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = du.sample_from_logits(x, *args, backend=backend)
    graph.replay()
    torch.cuda.synchronize()
    top = x.topk(20, dim=-1).indices
    assert bool((out.unsqueeze(-1) == top).any(-1).all())


@pytest.mark.parametrize("rows", [256, 2048])
def test_peak_extra_memory(rows):
    """Triton path: the search's buffer (about V / 4 float32 per program, a few programs per
    multiprocessor whatever R) and O(R) bytes beyond the logits; torch path: one row chunk of
    temporaries."""
    x = torch.randn(rows, V, device="cuda")
    programs = min(rows, du._sample_programs(x.device))
    buffer = 4 * du._sample_buffer_cap(V, du._sample_blocks(V)[1]) * programs
    for backend, bound in (("triton", buffer + 64 * rows + (1 << 20)), ("torch", None)):
        args = params(rows, 1 << 30, 0.9)
        du.sample_from_logits(x, *args, backend=backend)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        du.sample_from_logits(x, *args, backend=backend)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        if bound is None:
            chunk = max(1, du._TORCH_WORK_ELEMS // V)
            bound = 48 * chunk * V + 64 * rows + (1 << 20)
        assert extra <= bound, (backend, extra, bound)
        assert extra <= 2 * x.numel() * x.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_sets_equal_cpu_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    rows = 24
    x = (torch.randn(rows, V, generator=gen) * torch.linspace(0.5, 8, rows).view(rows, 1)).to(dtype)
    temp = torch.rand(rows, generator=gen) + 0.4
    top_k = torch.tensor([1 << 30, 50, 0, 1000, 7, 1 << 30] * 4, dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 1.0] * 4)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05] * 4)
    ref = dr.target_probs_from_logits(x.float(), temp, top_k, top_p, min_p) > 0
    _, thr = du._sample_with_threshold(
        x.cuda(), temp.cuda(), top_k.cuda(), top_p.cuda(), min_p.cuda(), None, "triton"
    )
    kept = (x.float() / temp.view(rows, 1)) >= thr.cpu().view(rows, 1)
    assert torch.equal(kept, ref)


def test_distribution_matches_reference():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 64, generator=gen) * 2
    want = dr.target_probs_from_logits(x, 0.8, 10, 0.9, 0.02)[0]
    n = 200000
    tok = du.sample_from_logits(
        x.cuda().expand(n, -1), 0.8, 10, 0.9, 0.02, backend="triton"
    ).cpu()
    counts = torch.bincount(tok, minlength=64).double()
    keep = want > 0
    assert counts[~keep].sum() == 0
    exp = want[keep].double() / want[keep].double().sum() * n
    assert chisquare(counts[keep].numpy(), exp.numpy()).pvalue > 1e-3


def test_top_p_boundary_rows_equal_reference():
    """Full vocabulary: each row's top_p is the float32 nearest to the float64 mass of its top j
    tokens (j around the 0.9 mass), so float32 rounding decides the boundary token; the kept
    sets (float64 masses in the kernel) equal the float64 reference on every row."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    rows = 64
    x = torch.randn(rows, V, device="cuda", generator=gen)
    temp = torch.full((rows,), 0.7, device="cuda")
    desc = (x / temp.view(rows, 1)).sort(dim=1, descending=True).values
    mass = torch.softmax(desc.double(), dim=1).cumsum(dim=1)
    j = (mass < 0.9).sum(dim=1, keepdim=True) + torch.arange(rows, device="cuda").view(rows, 1)
    m = mass.gather(1, j).view(rows)
    top_p = m.float()
    assert bool(((top_p.double() - m).abs() > 1e-12).all())  # float64 decides every row
    top_k = torch.full((rows,), 1 << 30, dtype=torch.int32, device="cuda")
    ref = dr.target_probs_from_logits(x, temp, top_k, top_p) > 0
    _, thr = du._sample_with_threshold(x, temp, top_k, top_p, None, None, "triton")
    kept = x / temp.view(rows, 1) >= thr.view(rows, 1)
    assert torch.equal(kept, ref)
    extra = kept.sum(dim=1) - (j.view(rows) + 1)  # the top j + 1, and the next iff m < top_p
    assert torch.equal(extra, (m < top_p.double()).long())


@pytest.mark.parametrize("search", [True, False])
def test_no_filter_rows_keep_everything(search):
    """No top-k / top-p: both kernel specialisations keep every token (min_p 0)."""
    x = torch.randn(64, V, device="cuda")
    args = params(64, 1 << 30, 1.0)
    _, thr = du._sample_with_threshold(x, *args, None, "triton", any_top_k_top_p=search)
    # divide by the temperature tensor, as SGLang's sampler does: torch's x / 0.7 with a
    # Python scalar multiplies by a rounded reciprocal on CUDA, which moves some values 1 ulp
    s = x / args[0].view(-1, 1)
    assert bool((s >= thr.view(-1, 1)).all())
    assert torch.equal(thr, s.amin(dim=1))  # the threshold is each row's smallest value


def test_search_buffer_shared_by_programs():
    """Many flat rows (top_p brackets stay dense, so every row is copied to the buffer and
    re-compacted) over one program, a few, the default (a few per multiprocessor) and one per
    row: each launch keeps the rule's set on every row (the torch path's threshold) and, from
    one seed, draws the same tokens. A buffer race between warps, or between the rows one
    program takes in turn, would show as a wrong set."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    rows = 1024
    x = torch.randn(rows, V, device="cuda", generator=gen) * 0.5
    temp = torch.full((rows,), 0.7, device="cuda")
    top_k = torch.where(torch.arange(rows, device="cuda") % 4 == 0, 50, 1 << 30)
    top_p = torch.where(torch.arange(rows, device="cuda") % 4 == 1, 1.0, 0.9)
    params_ = du._sampling_rows(rows, V, x.device, temp, top_k, top_p, None)
    want = du._sample_with_threshold(x, temp, top_k, top_p, None, None, "torch")[1]
    draws = []
    for programs in (1, 7, None, rows):
        seed = torch.Generator(device="cuda").manual_seed(5)
        token, thr = du._sample_rows_triton(x, *params_, seed, True, programs=programs)
        bad = (thr != want).nonzero().view(-1).tolist()
        assert not bad, (programs, bad[:10])
        draws.append(token)
    assert all(torch.equal(draws[0], d) for d in draws[1:])
