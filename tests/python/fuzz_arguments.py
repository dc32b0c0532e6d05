"""Argument fuzzer for the Python entry points: valid small calls of fwd, chunk_kda,
fused_recurrent_kda and reference_forward, each with one or two random corruptions (shapes, dtypes, layouts, values,
types, missing arguments). Every call must return or raise ValueError, TypeError or
NotImplementedError; anything else, or the process dying, is a finding.

    python tests/python/fuzz_arguments.py SEED COUNT [numpy|torch|cuda]

Prints one line per case before calling it (so a crash names its case), one FINDING line per
unexpected exception, how many calls returned and how many were refused, and `DONE <findings>`
last; exit status 1 when there were findings.
FUZZ_ONLY=<case seed> runs that case alone and prints its traceback.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

import flashkda

ALLOWED = (ValueError, TypeError, NotImplementedError)
ENTRY_POINTS = ("fwd", "chunk_kda", "fused_recurrent_kda", "reference_forward")
SCALARS = (None, float("nan"), float("inf"), -10.0, 1.0, 0.0, "x", -1, 2**40, True)


def valid_call(rng, fn, cuda=False):
    """Keyword arguments of one valid call of fn (float32 numpy arrays, lower-bound gate); K = V = 128
    for the GPU (its only head size), else 16 or 32."""
    H, K = 2, 128 if cuda else 16 * int(rng.integers(1, 3))
    V = K
    f32 = np.float32
    if fn == "fused_recurrent_kda":
        N, T, P = int(rng.integers(1, 4)), int(rng.integers(1, 5)), 5
        shape = (N, T, H)
    else:
        N, T = int(rng.integers(1, 4)), int(rng.integers(0, 40))
        shape = (1, T, H)
    d = dict(q=rng.standard_normal(shape + (K,)).astype(f32), k=rng.standard_normal(shape + (K,)).astype(f32),
             v=rng.standard_normal(shape + (V,)).astype(f32), g=rng.standard_normal(shape + (K,)).astype(f32),
             beta=rng.standard_normal(shape).astype(f32), A_log=(0.3 * rng.standard_normal(H)).astype(f32),
             dt_bias=(0.5 * rng.standard_normal((H, K))).astype(f32), lower_bound=-2.0)
    if fn != "fused_recurrent_kda":
        lengths = rng.multinomial(T, [1.0 / N] * N)
        d["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(rng.choice([np.int32, np.int64]))
    if fn == "reference_forward":
        d.update(gate=str(rng.choice(["lower_bound", "softplus", "precomputed"])), l2norm_qk=True, beta_is_logit=True,
                 initial_state=(0.1 * rng.standard_normal((N, H, V, K))).astype(f32))
    elif fn == "fwd":
        d.update(scale=K**-0.5, out=np.empty(shape + (V,), f32), final_state=np.empty((N, H, V, K), f32),
                 initial_state=(0.1 * rng.standard_normal((N, H, V, K))).astype(f32))
    elif fn == "chunk_kda":
        d.update(use_gate_in_kernel=True, output_final_state=True, use_qk_l2norm_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, initial_state=(0.1 * rng.standard_normal((N, H, K, V))).astype(f32))
    else:  # a serving step: a [P, H, V, K] pool updated in place through indices, maybe speculative
        d.update(use_gate_in_kernel=True, state_v_first=True, inplace_final_state=True,
                 use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 initial_state=(0.1 * rng.standard_normal((P, H, V, K))).astype(f32),
                 ssm_state_indices=rng.integers(-1, P, N).astype(np.int32))
        if rng.random() < 0.5:
            d["ssm_state_indices"] = rng.integers(-1, P, (N, T)).astype(np.int32)
            d["num_accepted_tokens"] = rng.integers(1, T + 1, N).astype(np.int32)
    return d


def corrupt_array(rng, x, kind):
    if kind == 0 and x.ndim:  # one dimension off by -1, +1 or +7
        shape = list(x.shape)
        i = int(rng.integers(len(shape)))
        shape[i] = max(0, shape[i] + int(rng.choice([-1, 1, 7])))
        return np.zeros(shape, x.dtype)
    if kind == 1:  # one dimension fewer or more
        # (the last axis may be empty after an earlier corruption: then one more)
        return x[..., 0] if x.ndim and x.shape[-1] > 0 and rng.random() < 0.5 else x[..., None]
    if kind == 2:
        with np.errstate(invalid="ignore"):  # a NaN from an earlier corruption cast to an integer
            return x.astype(rng.choice([np.float16, np.float64, np.int32, np.int64, np.bool_, np.uint8]))
    if kind == 3 and x.ndim >= 2:
        return np.swapaxes(x, -1, -2)
    if kind == 4 and x.ndim and x.shape[-1] > 1:
        return x[..., ::2]
    if kind == 5:
        return None
    if kind == 6:
        return x.tolist()
    if kind == 7 and x.size:  # one bad value
        y = x.copy()
        if x.dtype.kind == "f":
            bad = (np.nan, np.inf, -np.inf, 1e30, -1e30)
        elif x.dtype.kind == "b":
            bad = (True, False)
        else:  # the integer values that fit the dtype (an earlier corruption may have made it uint8 or int32)
            info = np.iinfo(x.dtype)
            bad = tuple(v for v in (-5, 10**6, -1, 2**31 - 1) if info.min <= v <= info.max) or (info.max,)
        y.flat[int(rng.integers(x.size))] = bad[int(rng.integers(len(bad)))]
        return y
    if kind == 8 and x.ndim:
        return x[::-1]
    if kind == 9:
        return np.asfortranarray(x)
    if kind == 10 and x.dtype.kind in "iu":
        y = x.copy()
        rng.shuffle(y)
        return y
    if kind == 11 and x.size:
        return np.broadcast_to(x.flat[0], x.shape)
    if kind == 12:
        return x.reshape(-1)
    return np.empty((0,) + x.shape[1:], x.dtype) if x.ndim else x


def corrupt(rng, d):
    """Corrupts one argument of d in place; returns a short description."""
    name = list(d)[int(rng.integers(len(d)))]
    kind = int(rng.integers(14))
    if isinstance(d[name], np.ndarray):
        d[name] = corrupt_array(rng, d[name], kind)
        return f"{name}:{kind}"
    d[name] = SCALARS[int(rng.integers(len(SCALARS)))]
    return f"{name}={d[name]!r}"


def to_torch(rng, d, device):
    import torch

    def conv(name, x):
        if not isinstance(x, np.ndarray) or x.dtype.kind not in "fiub" or rng.random() < 0.1:
            return x  # some arguments stay numpy: mixed inputs must be refused cleanly too
        if any(s < 0 for s in x.strides) or not x.flags.writeable:
            x = x.copy()
        t = torch.from_numpy(x).to(device)
        if device == "cuda" and name in ("q", "k", "v", "out") and t.dtype == torch.float32:
            t = t.to(torch.bfloat16)  # the GPU kernels take bf16 q, k, v
        return t

    return {n: conv(n, x) for n, x in d.items()}


def run(seed0, count, mode="numpy", only=-1):
    findings = returned = refused = 0
    for i in range(count):
        seed = seed0 * 100000 + i
        if only >= 0 and seed != only:
            continue
        rng = np.random.default_rng(seed)
        fn = ENTRY_POINTS[int(rng.integers(len(ENTRY_POINTS)))]
        d = valid_call(rng, fn, cuda=mode == "cuda")
        what = [corrupt(rng, d) for _ in range(int(rng.integers(1, 3)))]
        if mode != "numpy":
            d = to_torch(rng, d, "cuda" if mode == "cuda" else "cpu")
        print(json.dumps([seed, fn, what]), flush=True)
        try:
            getattr(flashkda, fn)(**d)
            returned += 1
        except ALLOWED:
            refused += 1
        except Exception as e:  # noqa: BLE001 - any other exception is what we look for
            findings += 1
            print("FINDING", seed, fn, what, type(e).__name__, str(e)[:300], flush=True)
            if only >= 0:
                traceback.print_exc()
    if mode == "cuda":
        import torch

        torch.cuda.synchronize()  # a kernel fault from any case surfaces here at the latest
    print(f"returned {returned} refused {refused}", flush=True)
    print("DONE", findings, flush=True)
    return findings


if __name__ == "__main__":
    mode = sys.argv[3] if len(sys.argv) > 3 else "numpy"
    sys.exit(1 if run(int(sys.argv[1]), int(sys.argv[2]), mode, int(os.environ.get("FUZZ_ONLY", "-1"))) else 0)
