"""Independent numpy fp64 KDA reference, written from docs/SPEC.md §2/§3/§5 (not from the C++ code).

States are [.., H, V, K] ("v-first", as the kernels keep them); inputs of any float dtype
(including ml_dtypes.bfloat16) are read as float64.
"""

from __future__ import annotations

import numpy as np


def f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def log_decay(g, gate, A_log=None, dt_bias=None, lower_bound=-5.0):
    """SPEC §2 gate forms: g [..., H, K] -> a [..., H, K] (a <= 0)."""
    g = f64(g)
    if gate == "precomputed":
        return g
    H, K = g.shape[-2:]
    A = np.zeros(H) if A_log is None else f64(A_log).reshape(H)
    bias = np.zeros((H, K)) if dt_bias is None else f64(dt_bias).reshape(H, K)
    x = g + bias
    if gate == "lower_bound":
        return lower_bound * sigmoid(np.exp(A)[:, None] * x)
    if gate == "softplus":
        return -np.exp(A)[:, None] * softplus(x)
    raise ValueError(gate)


def preprocess(q, k, g, beta, gate, A_log, dt_bias, lower_bound, l2norm, beta_logit):
    q, k, b = f64(q), f64(k), f64(beta)
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    if beta_logit:
        b = sigmoid(b)
    return q, k, log_decay(g, gate, A_log, dt_bias, lower_bound), b


def recur(S, q, k, v, a, b, scale):
    """SPEC §3 on one sequence, all heads at once. S [H, V, K] (updated in place); q, k, a [T, H, K];
    v [T, H, V]; b [T, H]. Returns o [T, H, V] and the state after each token [T, H, V, K]."""
    T = q.shape[0]
    o = np.zeros(v.shape)
    states = np.zeros((T,) + S.shape)
    for t in range(T):
        S *= np.exp(a[t])[:, None, :]                     # decay first (along K)
        pred = np.einsum("hvk,hk->hv", S, k[t])           # S^T k
        S += b[t][:, None, None] * (v[t] - pred)[:, :, None] * k[t][:, None, :]
        o[t] = scale * np.einsum("hvk,hk->hv", S, q[t])   # read the updated state
        states[t] = S
    return o, states


def seq_bounds(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(n * T, (n + 1) * T) for n in range(B)]
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    return list(zip(cu[:-1], cu[1:]))


def flat_inputs(q, k, v, g, beta, gate, A_log, dt_bias, lower_bound, l2norm, beta_logit, scale, cu_seqlens):
    """Shared by prefill and decode: the scale, the sequence bounds and the preprocessed q, k, v,
    decay and beta flattened to [B*T, ...]."""
    B, T, _, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    qh, kh, a, b = preprocess(q, k, g, beta, gate, A_log, dt_bias, lower_bound, l2norm, beta_logit)
    flat = lambda x: x.reshape((B * T,) + x.shape[2:])  # noqa: E731
    return scale, seq_bounds(B, T, cu_seqlens), tuple(flat(x) for x in (qh, kh, f64(v), a, b))


def kda_forward(q, k, v, g, beta, *, gate="precomputed", A_log=None, dt_bias=None, lower_bound=-5.0,
                l2norm=False, beta_logit=False, scale=None, initial_state=None, cu_seqlens=None):
    """Chunk-free prefill: returns o [B, T, H, V] and final_state [N, H, V, K], float64."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale, bounds, (qh, kh, vv, a, b) = flat_inputs(q, k, v, g, beta, gate, A_log, dt_bias, lower_bound, l2norm,
                                                     beta_logit, scale, cu_seqlens)
    o = np.zeros((B * T, H, V))
    final = np.zeros((len(bounds), H, V, K))
    for n, (bos, eos) in enumerate(bounds):
        S = np.zeros((H, V, K)) if initial_state is None else f64(initial_state)[n].copy()
        o[bos:eos], _ = recur(S, qh[bos:eos], kh[bos:eos], vv[bos:eos], a[bos:eos], b[bos:eos], scale)
        final[n] = S
    return o.reshape(B, T, H, V), final


def kda_decode(q, k, v, g, beta, pool, state_indices=None, num_accepted_tokens=None, *, gate="precomputed",
               A_log=None, dt_bias=None, lower_bound=-5.0, l2norm=False, beta_logit=False, scale=None,
               cu_seqlens=None):
    """SPEC §5 on a state pool [P, H, V, K]. Returns (o [.., H, V], new pool), both float64.

    state_indices [N]: sequence n reads and writes slot idx[n] (negative: padding, skipped, o = 0).
    state_indices [N, S] with num_accepted_tokens: start from slot idx[n, acc[n] - 1]; the state after
    token t goes to slot idx[n, t] (a negative slot skips that store).
    Without state_indices sequence n uses slot n.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale, bounds, (qh, kh, vv, a, b) = flat_inputs(q, k, v, g, beta, gate, A_log, dt_bias, lower_bound, l2norm,
                                                     beta_logit, scale, cu_seqlens)
    pool = f64(pool).copy()
    idx = np.arange(len(bounds)) if state_indices is None else np.asarray(state_indices)
    o = np.zeros((B * T, H, V))
    for n, (bos, eos) in enumerate(bounds):
        if num_accepted_tokens is not None:
            start = int(idx[n, int(num_accepted_tokens[n]) - 1])
        else:
            start = int(idx[n]) if idx.ndim == 1 else int(idx[n, 0])
        if start < 0:
            continue
        S = pool[start].copy()
        o[bos:eos], states = recur(S, qh[bos:eos], kh[bos:eos], vv[bos:eos], a[bos:eos], b[bos:eos], scale)
        if num_accepted_tokens is None:
            if eos > bos:
                pool[start] = S
        else:
            for t in range(eos - bos):
                slot = int(idx[n, t])
                if slot >= 0:
                    pool[slot] = states[t]
    return o.reshape(B, T, H, V), pool


def rel_rms(x, ref):
    """Relative RMS error of x against ref (both read as float64)."""
    x, ref = f64(x), f64(ref)
    den = np.sqrt(np.mean(ref * ref))
    return float(np.sqrt(np.mean((x - ref) ** 2)) / (den if den > 0 else 1.0))
