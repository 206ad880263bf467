import sys, torch
sys.path.insert(0, "tests")
import dtcp
from dtcp.kernels import KERNELS
from dtcp.plan import AttnMask, ring_plans
from dtcp.plan.fuse import step_launches
from dtcp.kernels import VarlenSeqs
from tests.gpu.test_one_gpu_ranks import long_tailed, S
from sim_ranks import segments_of
docs = long_tailed(S, 2); n = 4; window = (300, 0)
layout = dtcp.Contiguous(); M = S // n
plans = ring_plans(layout, M, n, True, AttnMask.make(True, window, segments_of(docs)))
k = KERNELS["flash"]
for r, plan in enumerate(plans):
    for t, step in enumerate(plan.steps):
        for L in step_launches(step.tasks):
            lens = L.seq_lens
            tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
            cuq = torch.tensor(L.cu_q, dtype=torch.int32, device="cuda"); cuk = torch.tensor(L.cu_k, dtype=torch.int32, device="cuda")
            seqs = VarlenSeqs(L.cu_q, L.cu_k, cuq, cuk, max(a for a, _ in lens), max(b for _, b in lens))
            q = torch.randn(tq, 4, 128, device="cuda", dtype=torch.bfloat16); kk = torch.randn(tk, 2, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(kk)
            o, l = k.varlen_forward(q, kk, v, seqs, L.window, 0.088)
            dq, dk, dv = k.varlen_backward(torch.randn_like(o), q, kk, v, o, l, seqs, L.window, 0.088)
            bad = [name for name, x in (("o", o), ("l", l), ("dq", dq), ("dk", dk), ("dv", dv)) if not torch.isfinite(x).all()]
            if bad:
                print("rank", r, "step", t, "window", L.window, "lens", lens, "bad", bad, "reason", k.reject_varlen_reason(lens, L.window))
                # which sequence
                for i, (a, b) in enumerate(zip(L.cu_k, L.cu_k[1:])):
                    if not torch.isfinite(dk[a:b]).all(): print("   seq", i, lens[i], L.q_ranges[i], L.k_ranges[i])
print("done")
