"""fp64 simulation of what the segmented K2's packed outputs (src/cuda/sm90/prefill/seg_out.cuh: o_zero
and w in fp16 under a power-of-two exponent per token and group of 16 columns) cost the output, on
the inputs the GPU tests use, without a GPU.

Over a segment after a prefix, the combine forms out_t = o_zero_t + X^T w_t (X the state after the
prefix, [V][K]). This script gets o_zero (the segment from a zero state), w (from the identity state,
V = K) and X from the library's fp64 token recurrence, rounds o_zero and w as seg_out.cuh does, and
prints the output's rel-RMS against the recurrence with and without that rounding (both rounded to
bf16 at the end, as the combine's output is). Needs flashkda and ml_dtypes installed:

    python scripts/sim_seg_out.py [--T 1024] [--prefix 512] [--H 2]
"""
import argparse

import ml_dtypes
import numpy as np

from flashkda import reference_forward

K = V = 128


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def packed(x):
    """x [T, H, C] rounded as seg_out.cuh packs it: per token and 16 columns, the largest finite
    magnitude scaled into [2^14, 2^15) (exponent clamped to [-126, 126]), values rounded to fp16."""
    t, h, c = x.shape
    g = x.reshape(t, h, c // 16, 16)
    m = np.where(np.isfinite(g), np.abs(g), 0).max(-1, keepdims=True).astype(np.float32)
    e = np.clip(np.where(m > 0, np.floor(np.log2(np.where(m > 0, m, 1))) - 14, 0), -126, 126)
    return ((g * 2.0**-e).astype(np.float32).astype(np.float16).astype(np.float64) * 2.0**e).reshape(t, h, c)


def case(name, q, k, v, g, beta, prefix, **gate):
    h = q.shape[2]
    part = lambda a, s: np.ascontiguousarray(a[:, s])  # noqa: E731
    _, x = reference_forward(*[part(a, slice(0, prefix)) for a in (q, k, v, g, beta)], **gate)
    seg = [part(a, slice(prefix, None)) for a in (q, k, v, g, beta)]
    x32 = x.astype(np.float32)
    out, _ = reference_forward(*seg, initial_state=x32, **gate)
    o_zero, _ = reference_forward(*seg, initial_state=np.zeros_like(x32), **gate)
    eye = np.broadcast_to(np.eye(K, dtype=np.float32), (1, h, V, K)).copy()
    o_eye, _ = reference_forward(*seg, initial_state=eye, **gate)
    ref, oz, w, xs = out[0], o_zero[0], (o_eye - o_zero)[0], x32.astype(np.float64)[0]

    def err(a):
        return np.sqrt(np.mean((a - ref) ** 2) / np.mean(ref**2))

    corr = np.einsum("thk,hvk->thv", w, xs)
    fp32 = bf16(oz + corr)
    fp16 = bf16(packed(oz) + np.einsum("thk,hvk->thv", packed(w), xs))
    share = lambda a: np.sqrt(np.mean(a**2) / np.mean(ref**2))  # noqa: E731
    print(f"| {name} | {share(oz):.2f} | {share(corr):.2f} | {err(fp32):.3e} | {err(fp16):.3e} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=1024, help="tokens: the prefix, then the segment")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--H", type=int, default=2)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    T, H, P = a.T, a.H, a.prefix

    def rnd(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    print("| case | rms o_zero / out | rms X^T w / out | out error, fp32 o_zero and w | packed fp16 |")
    print("|---|---|---|---|---|")
    for name, dt_long, v_scale in (("random gates", False, 1.0), ("long memory", True, 1.0),
                                   ("long memory, v x 2^17", True, 2.0**17)):
        dt = rng.random((H, K)).astype(np.float32)
        if dt_long:
            dt[:, :8] = -8.0  # 8 near-zero-decay channels a head, as bench_prefill.py's long regime
        case(name, rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, V, scale=v_scale), rnd(1, T, H, K),
             rnd(1, T, H), P, gate="lower_bound", A_log=rng.random(H).astype(np.float32), dt_bias=dt)
    key = np.broadcast_to(rnd(1, 1, H, K), (1, T, H, K)).copy()  # one key repeated, raw gate -12, raw beta 8
    case("repeated key", rnd(1, T, H, K), key, rnd(1, T, H, V), np.full((1, T, H, K), -12.0, np.float32),
         np.full((1, T, H), 8.0, np.float32), P, gate="lower_bound", A_log=np.zeros(H, np.float32),
         dt_bias=np.zeros((H, K), np.float32))
    qk = rnd(1, T, H, K)  # q = k, no decay, beta ~ 1
    case("q = k, no decay", qk, qk, rnd(1, T, H, V), np.zeros((1, T, H, K), np.float32),
         np.full((1, T, H), 10.0, np.float32), P, gate="precomputed")


if __name__ == "__main__":
    main()
