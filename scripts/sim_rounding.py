"""fp64 simulation of the chunk-16 recurrence with chosen operands rounded to bf16, against the
fp64 token recurrence: what the GPU's precision modes can reach on a given input, without a GPU.

Needs flashkda installed (its fp64 reference is the yardstick):

    python scripts/sim_rounding.py [--case softplus|precomputed|random|repeated|long] [--pair] [--T 333] [--chunk 32]
                                   [--lmqk-tf32 [rna|trunc]] [--round-mqk-q]

Modes: 'fast' rounds every tensor-core operand (S, U, kd, qd, kr, inv_b, Mqk, and in the pair
form the cross matrices and the e^Γ-scaled operands) as the fast kernels do; 'exact' rounds
nothing (checks the algebra); 'out-only' rounds only the bf16 output. The inputs follow the GPU
tests (tests/cpp/gpu/test_prefill_gpu.cpp): bf16 q, k, v, L2 norm, beta logits, fp32 state x0.1.
--lmqk-tf32 forms L and Mqk from factored operands (k, q e^{G - mid}, k e^{mid - G}) rounded to tf32,
as prefill v2's producer does (docs/DESIGN.md "L and Mqk from tf32 operands"); --round-mqk-q rounds
only Mqk's query operand to bf16.
"""
import argparse

import numpy as np

from flashkda import reference_forward  # the library's fp64 token recurrence (docs/SPEC.md §3)

C = 16  # tokens per chunk (the GPU kernels' kChunk); --chunk changes it for a design study


def bf16(x):
    """Round to bfloat16 (nearest even), returned as float64."""
    x32 = np.asarray(x, np.float64).astype(np.float32)
    u = x32.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def f16(x):
    """Round to IEEE half precision (nearest even), returned as float64: the fp16-operand option."""
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def tf32(x):
    """Round to TensorFloat-32 (10 mantissa bits, nearest, ties away: cvt.rna.tf32.f32; the kernels'
    cvt.rn differs only on exact ties), as float64."""
    x32 = np.asarray(x, np.float64).astype(np.float32)
    u = x32.view(np.uint32).astype(np.uint64)
    u = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def tf32_trunc(x):
    """Truncate to TensorFloat-32 (the low 13 bits dropped: what wgmma reads of an fp32 operand)."""
    x32 = np.asarray(x, np.float64).astype(np.float32)
    return (x32.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def f32(x):
    """fp32 copy of an array (every simulated input is exact in fp32); other values unchanged."""
    return x.astype(np.float32) if isinstance(x, np.ndarray) else x


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def log_decay(g, gate, A_log, dt_bias, lower_bound=-5.0):
    """docs/SPEC.md §2: the per-channel log-decay a <= 0 of each gate form, g [T, H, K]."""
    if gate == "precomputed":
        return g
    x = g + dt_bias[None]
    if gate == "lower_bound":
        return lower_bound * sigmoid(np.exp(A_log)[None, :, None] * x)
    return -np.exp(A_log)[None, :, None] * np.logaddexp(0.0, x)  # softplus


def rel_rms(x, ref):
    return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref ** 2)))


def inputs(case, T, H, K, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (bf16(rng.standard_normal((1, T, H, K))) for _ in range(3))
    beta = bf16(rng.uniform(-3, 3, (1, T, H)))
    kw = {}
    if case == "softplus":
        g = rng.uniform(-8, 8, (1, T, H, K)).astype(np.float32).astype(np.float64)
        kw = dict(gate="softplus", A_log=rng.uniform(0, 2, H), dt_bias=np.full((H, K), 8.0))
    elif case == "precomputed":
        g = rng.uniform(-1000, 0, (1, T, H, K)).astype(np.float32).astype(np.float64)
        kw = dict(gate="precomputed")
    elif case == "repeated":
        k[:] = k[:, :1]
        g = np.full((1, T, H, K), -12.0)
        beta[:] = 8.0
        kw = dict(gate="lower_bound", A_log=rng.uniform(-1, 1, H), dt_bias=rng.uniform(-1, 1, (H, K)))
    elif case == "long":  # the benchmark's long-memory regime: 8 channels per head with dt_bias -8
        g = bf16(rng.standard_normal((1, T, H, K)))
        dt_bias = rng.uniform(0, 1, (H, K))
        dt_bias[:, :8] = -8.0
        kw = dict(gate="lower_bound", A_log=rng.uniform(0, 1, H), dt_bias=dt_bias)
    else:
        g = bf16(rng.uniform(-3, 3, (1, T, H, K)))
        kw = dict(gate="lower_bound", A_log=rng.uniform(-1, 1, H), dt_bias=rng.uniform(-1, 1, (H, K)))
    h0 = 0.1 * rng.standard_normal((1, H, K, K))
    # A_log, dt_bias and the state rounded to fp32, so the fp64 reference (fp32 inputs) sees the same values
    kw = {name: f32(x).astype(np.float64) if isinstance(x, np.ndarray) else x for name, x in kw.items()}
    return q, k, v, g, beta, kw, f32(h0).astype(np.float64)


def chunk_mats(qh, kh, a, b, round_mqk_q=False, lmqk_tf32=False):
    """One chunk of one head: kd, qd, kr [c, K], e^Γ [K], inv_b, Mqk [c, c] in fp64. round_mqk_q:
    Mqk's query operand q e^{G - mid} (mid = Γ / 2, the kernels' factoring) rounded to bf16, the
    key operand exact (the kernels' split). lmqk_tf32: L's and Mqk's three operands (k e^{G - mid},
    q e^{G - mid}, k e^{mid - G}) rounded to tf32, one tf32 product instead of the bf16 split's three."""
    G = np.cumsum(a, axis=0)
    Gam = G[-1]
    mid = 0.5 * Gam
    r = (tf32_trunc if lmqk_tf32 == "trunc" else tf32) if lmqk_tf32 else (lambda x: x)
    qop = bf16(qh * np.exp(G - mid)) if round_mqk_q else r(qh * np.exp(G - mid))
    kop, kup = r(kh * np.exp(mid - G)), r(kh * np.exp(G - mid))
    factored = round_mqk_q or lmqk_tf32
    kd, qd, kr = kh * np.exp(G), qh * np.exp(G), kh * np.exp(Gam - G)
    n = len(b)
    L = np.zeros((n, n))
    M = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            w = np.exp(G[i] - G[j])
            if j < i:
                L[i, j] = b[i] * (np.sum(kup[i] * kop[j]) if lmqk_tf32 else np.sum(kh[i] * kh[j] * w))
            M[i, j] = np.sum(qop[i] * kop[j]) if factored else np.sum(qh[i] * kh[j] * w)
    inv_b = np.linalg.solve(np.eye(n) + L, np.diag(b))
    return kd, qd, kr, np.exp(Gam), inv_b, M, Gam


OPERANDS = ("S", "u", "U", "kd", "qd", "kr", "inv", "Mqk")  # u = v - W, the A operand of inv_b
# "<operand>16" in keep: that operand rounded to fp16 instead of bf16 (8x smaller rounding, a
# narrower range) rather than split; "<operand>32": rounded to tf32 (nearest; fp32's range, 10
# mantissa bits: one tf32 product instead of the split's three).


ROUND_MQK_Q = LMQK_TF32 = False  # --round-mqk-q, --lmqk-tf32


def run(q, k, v, g, beta, kw, h0, mode, pair, keep=()):
    """keep: operands left unrounded in the fast mode (what a split into bf16 hi + lo would give)."""
    _, T, H, K = q.shape
    rnd = bf16 if mode == "fast" else (lambda x: x)
    rk = {name: (lambda x: x) if name in keep else
          (f16 if mode == "fast" and name + "16" in keep else tf32 if mode == "fast" and name + "32" in keep else rnd)
          for name in OPERANDS}
    qh = q[0] / np.sqrt((q[0] ** 2).sum(-1, keepdims=True) + 1e-6) * K ** -0.5
    kh = k[0] / np.sqrt((k[0] ** 2).sum(-1, keepdims=True) + 1e-6)
    a = log_decay(g[0], kw.get("gate"), kw.get("A_log"), kw.get("dt_bias"))
    b = sigmoid(beta[0])
    out = np.zeros((T, H, K))
    S_all = np.zeros((H, K, K))
    for h in range(H):
        S = h0[0, h].copy()  # [V, K]
        t0 = 0
        while t0 < T:
            if not pair or t0 + C >= T:
                t1 = min(T, t0 + C)
                kd, qd, kr, eg, inv_b, M, _ = chunk_mats(qh[t0:t1, h], kh[t0:t1, h], a[t0:t1, h], b[t0:t1, h],
                                                          ROUND_MQK_Q and mode == "fast", LMQK_TF32 if mode == "fast" else None)
                Sr = rk["S"](S)
                W = rk["kd"](kd) @ Sr.T
                U = rk["inv"](inv_b) @ rk["u"](v[0, t0:t1, h] - W)
                Ur = rk["U"](U)
                out[t0:t1, h] = rk["qd"](qd) @ Sr.T + rk["Mqk"](M) @ Ur
                S = S * eg[None, :] + Ur.T @ rk["kr"](kr)
                t0 = t1
                continue
            tA, tB, tE = t0, t0 + C, min(T, t0 + 2 * C)
            kdA, qdA, krA, egA, invA, MA, GA = chunk_mats(qh[tA:tB, h], kh[tA:tB, h], a[tA:tB, h], b[tA:tB, h])
            kdB, qdB, krB, egB, invB, MB, GB = chunk_mats(qh[tB:tE, h], kh[tB:tE, h], a[tB:tE, h], b[tB:tE, h])
            r = rnd
            C_BA = r(r(kdB) @ r(krA).T)  # the kernel's cross operands: bf16, product rounded
            D_BA = r(r(qdB) @ r(krA).T)
            Sr = rk["S"](S)
            WA = rk["kd"](kdA) @ Sr.T
            WB = rk["kd"](kdB * egA) @ Sr.T
            UA = rk["U"](rk["inv"](invA) @ rk["u"](v[0, tA:tB, h] - WA))
            UB = rk["U"](rk["inv"](invB) @ rk["u"](v[0, tB:tE, h] - WB - C_BA @ UA))
            out[tA:tB, h] = rk["qd"](qdA) @ Sr.T + rk["Mqk"](MA) @ UA
            out[tB:tE, h] = rk["qd"](qdB * egA) @ Sr.T + D_BA @ UA + rk["Mqk"](MB) @ UB
            S = S * (egA * egB)[None, :] + UA.T @ rk["kr"](krA * egB) + UB.T @ rk["kr"](krB)
            t0 = tE
        S_all[h] = S
    if mode != "exact":
        out = bf16(out)
    return out, S_all


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="softplus", choices=["softplus", "precomputed", "random", "repeated", "long"])
    ap.add_argument("--T", type=int, default=333)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pair", action="store_true", help="the pair form (two chunks per step)")
    ap.add_argument("--chunk", type=int, default=16, help="tokens per chunk (16: the kernels; 32: the chunk-32 study)")
    ap.add_argument("--keep", nargs="*", default=None, metavar="OPERAND",
                    help=f"fast mode with these operands unrounded (split), any of {' '.join(OPERANDS)} "
                         "(or NAME16: rounded to fp16; NAME32: rounded to tf32); "
                         "several --keep sets can be compared with --sets")
    ap.add_argument("--sets", nargs="*", default=None,
                    help="comma-separated operand sets to keep, one fast run each (e.g. kr kr,inv S,U,kr,inv)")
    ap.add_argument("--round-mqk-q", action="store_true",
                    help="Mqk's query operand q e^{G - mid} rounded to bf16 (its key operand and Mqk itself as --keep says)")
    ap.add_argument("--lmqk-tf32", nargs="?", const="rna", default=None, choices=["rna", "trunc"],
                    help="L's and Mqk's operands rounded to tf32 (one tf32 product) instead of split: to nearest "
                         "(rna, the default) or truncated (trunc)")
    args = ap.parse_args()
    global C, ROUND_MQK_Q, LMQK_TF32
    C, ROUND_MQK_Q, LMQK_TF32 = args.chunk, args.round_mqk_q, args.lmqk_tf32
    q, k, v, g, beta, kw, h0 = inputs(args.case, args.T, args.H, args.K, args.seed)
    ref_o, ref_s = reference_forward(*map(f32, (q, k, v, g, beta)), initial_state=f32(h0),
                                     **{name: f32(x) for name, x in kw.items()})
    form = ("pair" if args.pair else "chunk") + ("" if C == 16 else f" C={C}")
    if args.sets is not None:
        for spec in args.sets:
            keep = tuple(x for x in spec.split(",") if x)
            o, s = run(q, k, v, g, beta, kw, h0, "fast", args.pair, keep)
            print(f"{args.case} T={args.T} {form} fast, split {'+'.join(keep) or 'nothing'}: "
                  f"out {rel_rms(o, ref_o[0]):.2e}  state {rel_rms(s, ref_s[0]):.2e}", flush=True)
        return
    for mode in ("exact", "out-only", "fast"):
        o, s = run(q, k, v, g, beta, kw, h0, mode, args.pair, tuple(args.keep or ()))
        print(f"{args.case} T={args.T} {form} {mode}: "
              f"out {rel_rms(o, ref_o[0]):.2e}  state {rel_rms(s, ref_s[0]):.2e}", flush=True)


if __name__ == "__main__":
    main()
