"""Internal launch configurations, for tests and benchmarks that compare variants of one computation.

    from flashkda import _internal
    with _internal.launch(segment_chunks=-1):      # never cut sequences into segments
        flashkda.fwd(...)

Not public API: the defaults are the launchers' own rules, which is what every call without this
context runs; nothing is read from the environment. See src/launch_config.h for the meaning of
each field (prefill: v_splits, segment_chunks, f16_operands, checkpoints_in_segments, skip_transitions,
skip_run_chunks, skip_warmup_chunks, seg_ctas_per_sm, record_copy, early_launch, cpu_isa, skip_bound,
fused_v2, fused_min_tokens, fused_pieces, fused_warmup, fused_order, fused_chain,
lowrank_transitions, pieces_graph_if; decode:
persistent, check_slots). cpu_engine_isa(requested) says which instruction set the CPU engine runs.
"""

from __future__ import annotations

import contextlib

from . import _launch

_PREFILL = {"v_splits": "_v_splits", "segment_chunks": "_segment_chunks", "f16_operands": "_f16_operands",
            "checkpoints_in_segments": "_ckpt_in_segments", "skip_transitions": "_skip_transitions",
            "skip_run_chunks": "_skip_run_chunks", "skip_warmup_chunks": "_skip_warmup_chunks",
            "seg_ctas_per_sm": "_seg_ctas_per_sm", "record_copy": "_record_copy",
            "early_launch": "_early_launch", "cpu_isa": "_cpu_isa", "skip_bound": "_skip_bound",
            "fused_v2": "_fused_v2", "fused_min_tokens": "_fused_min_tokens", "fused_pieces": "_fused_pieces",
            "fused_warmup": "_fused_warmup", "fused_order": "_fused_order", "fused_chain": "_fused_chain",
            "lowrank_transitions": "_lowrank_transitions", "pieces_graph_if": "_pieces_graph_if"}
_DECODE = {"persistent": "_persistent", "check_slots": "_check_slots", "cpu_isa": "_cpu_isa"}


@contextlib.contextmanager
def launch(**fields):
    """Calls inside the block launch with these fields (v_splits, segment_chunks, f16_operands,
    checkpoints_in_segments, skip_transitions, skip_run_chunks, skip_warmup_chunks, seg_ctas_per_sm,
    record_copy, early_launch, cpu_isa, skip_bound, fused_v2, fused_min_tokens, fused_pieces,
    fused_warmup, fused_order, fused_chain, lowrank_transitions, pieces_graph_if,
    persistent, check_slots)."""
    unknown = set(fields) - set(_PREFILL) - set(_DECODE)
    if unknown:
        raise TypeError(f"unknown launch fields: {sorted(unknown)}")
    saved = {key: dict(value) for key, value in _launch._config.items()}
    prefill = dict(_launch._config.get("prefill", {}))
    decode = dict(_launch._config.get("decode", {}))
    for name, value in fields.items():  # cpu_isa names a field of both
        if name in _PREFILL:
            prefill[_PREFILL[name]] = int(value)
        if name in _DECODE:
            decode[_DECODE[name]] = int(value)
    _launch._config.update(prefill=prefill, decode=decode)
    try:
        yield
    finally:
        _launch._config.clear()
        _launch._config.update(saved)


def cpu_engine_isa(requested: int = 0) -> int:
    """The instruction set the CPU engine runs for cpu_isa = requested on this processor (1 the
    baseline ISA, 2 AVX2 + FMA, 3 AVX-512; 0 = the rule, the widest it has)."""
    from . import _C

    return int(_C._cpu_engine_isa(int(requested)))
