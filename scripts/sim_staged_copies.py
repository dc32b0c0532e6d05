# Model of fused.cu produce_item's staged-input copies and waits over a CTA's items: each wait's
# mbarrier parity matches its copy's phase, no buffer is copied into while a copy is pending, and no
# copy is in flight when an item ends or the producer stops (kStagedBufs 1 and 2; random items, stops,
# time_consumers_only). Run: python3 scripts/sim_staged_copies.py (prints ok).
import random
def run(items, kBufs, stop_at=None, tco=False):
    completions = [0]*kBufs        # how many times each barrier's phase completed
    pending = {}                   # gc -> barrier (issued, not yet waited)
    issued_order = [[] for _ in range(kBufs)]
    base = 0
    for it, num_chunks in enumerate(items):
        staged_chunks = 2 if (tco and num_chunks > 2) else num_chunks
        def issue(c):
            gc = base + c; b = gc % kBufs
            # the buffer must not hold an un-waited copy
            assert all(pb != b for pb in pending.values()), ("buffer busy", gc)
            pending[gc] = b; issued_order[b].append(gc)
            completions[b] += 1     # the copy completes (some time later; a phase per copy)
        def wait(gc):
            b = gc % kBufs
            assert gc in pending, ("wait on unissued", gc)
            # phase parity the wait uses vs the phase index of this copy on barrier b
            k = issued_order[b].index(gc)
            assert (gc // kBufs) & 1 == k & 1, ("parity", gc, k)
            del pending[gc]
        for c in range(min(kBufs, staged_chunks)): issue(c)
        stopped = False
        for c in range(num_chunks):
            gc = base + c
            if stop_at is not None and (it, c) == stop_at:
                for i in range(c, min(c + kBufs, staged_chunks)): wait(base + i)
                stopped = True; break
            if tco and gc >= 2: continue
            wait(gc)
            if c + kBufs < staged_chunks: issue(c + kBufs)
        assert not pending, ("copies in flight at item end", pending)
        if stopped: return
        base += num_chunks
for trial in range(20000):
    items = [random.choice([0,1,1,2,3,4,5,7,16]) for _ in range(random.randint(1,6))]
    for kBufs in (1,2):
        run(items, kBufs)
        if sum(items) > 0:
            nz = [(i,c) for i,n in enumerate(items) for c in range(n)]
            run(items, kBufs, stop_at=random.choice(nz))
        if len(items) == 1: run(items, kBufs, tco=True)
print("ok")
