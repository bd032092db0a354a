"""The partitioners' per-item loops, compiled (numba): LPT places items one at a time, each
placement depending on the last, so no array operation expresses it, and at tens of thousands
of samples per batch an interpreted loop was most of a search.

The partitioners import this module when first called and numba compiles each kernel on its first
call (cached on disk), so a process that never partitions (a torch rank, the CLI's start) never
loads numba.
"""

from __future__ import annotations

import numba
import numpy as np

jit = numba.njit(cache=True)


@jit
def _less(hk, hc, hb, i, j):
    """Heap entry i before entry j: (largest load, items, bin), lexicographically."""
    if hk[i] != hk[j]:
        return hk[i] < hk[j]
    if hc[i] != hc[j]:
        return hc[i] < hc[j]
    return hb[i] < hb[j]


@jit
def _swap(hk, hc, hb, i, j):
    hk[i], hk[j] = hk[j], hk[i]
    hc[i], hc[j] = hc[j], hc[i]
    hb[i], hb[j] = hb[j], hb[i]


@jit
def _push(hk, hc, hb, size, key, count, b):
    hk[size], hc[size], hb[size] = key, count, b
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if not _less(hk, hc, hb, i, parent):
            break
        _swap(hk, hc, hb, i, parent)
        i = parent
    return size + 1


@jit
def _pop(hk, hc, hb, size):
    size -= 1
    _swap(hk, hc, hb, 0, size)
    i = 0
    while True:
        low, left, right = i, 2 * i + 1, 2 * i + 2
        if left < size and _less(hk, hc, hb, left, low):
            low = left
        if right < size and _less(hk, hc, hb, right, low):
            low = right
        if low == i:
            return size
        _swap(hk, hc, hb, i, low)
        i = low


@jit
def _over(held, need, caps):
    """Whether ``need`` on top of ``held`` passes a cap."""
    for r in range(caps.shape[0]):
        if held[r] + need[r] > caps[r]:
            return True
    return False


@jit
def _max_row(values, b):
    top = values[b, 0]
    for d in range(1, values.shape[1]):
        if values[b, d] > top:
            top = values[b, d]
    return top


@jit
def _before(key, count, b, hk, hc, hb):
    """(key, count, b) before the heap's top entry: (largest load, items, bin), lexicographically."""
    if key != hk[0]:
        return key < hk[0]
    if count != hc[0]:
        return count < hc[0]
    return b < hb[0]


@jit
def _place(costs, resources, item, b, loads, held, count):
    """``item`` into bin ``b``: its costs onto the bin's loads, its resources onto what it holds."""
    for d in range(costs.shape[1]):
        loads[b, d] += costs[item, d]
    for r in range(resources.shape[1]):
        held[b, r] += resources[item, r]
    count[b] += 1


@jit
def _shift(wk, wc, wb, wh, start, stop, by):
    """Entries [start, stop) of the waiting row moved ``by`` places (1: right, -1: left)."""
    steps = range(stop - 1, start - 1, -1) if by > 0 else range(start, stop)
    for w in steps:
        wk[w + by], wc[w + by], wb[w + by] = wk[w], wc[w], wb[w]
        wh[w + by] = wh[w]


@jit
def lpt_loop(costs, order, bins, resources, caps, least):
    """Items in ``order``, each to the bin least in (largest load, items, index) among those whose
    held resources plus its own stay within ``caps``; a bin that no item from there on fits
    (``least``: per position, the least of each resource any later item needs) is dropped for
    good. Returns the assignment, or (-1 - item) for the first item that fits no bin.

    A bin an item passes over for want of room waits, with what it holds, in a row kept in the
    heap's order until it is chosen: the next items scan that row beside the heap, in order,
    instead of taking the same full light bins off the heap and back for every item (most of the
    time on large batches of images). Every bin is in the heap or the row, once, as it is now."""
    n, dims = costs.shape
    kinds = caps.shape[0]
    loads = np.zeros((bins, dims))
    held = np.zeros((bins, kinds))
    key = np.zeros(bins)
    count = np.zeros(bins, dtype=np.int64)
    hk = np.zeros(bins)
    hc = np.zeros(bins, dtype=np.int64)
    hb = np.zeros(bins, dtype=np.int64)
    wk = np.zeros(bins)  # the waiting row: key, count, bin, held
    wc = np.zeros(bins, dtype=np.int64)
    wb = np.zeros(bins, dtype=np.int64)
    wh = np.zeros((bins, kinds))
    waiting, size = 0, 0
    for b in range(bins):
        size = _push(hk, hc, hb, size, 0.0, 0, b)
    assignment = np.empty(n, dtype=np.int64)
    for at in range(n):
        item = order[at]
        chosen, w = -1, 0
        while w < waiting or size > 0:
            if w < waiting and (size == 0 or _before(wk[w], wc[w], wb[w], hk, hc, hb)):
                b = wb[w]
                fits = not _over(wh[w], resources[item], caps)
                if fits or _over(wh[w], least[at], caps):  # chosen, or no later item fits it: out
                    _shift(wk, wc, wb, wh, w + 1, waiting, -1)
                    waiting -= 1
                else:
                    w += 1
            else:
                b = hb[0]
                size = _pop(hk, hc, hb, size)
                fits = not _over(held[b], resources[item], caps)
                if not fits and not _over(held[b], least[at], caps):  # waits, in its place
                    _shift(wk, wc, wb, wh, w, waiting, 1)
                    wk[w], wc[w], wb[w] = key[b], count[b], b
                    wh[w] = held[b]
                    waiting += 1
                    w += 1
            if fits:
                chosen = b
                break
        if chosen < 0:
            return np.full(1, -1 - item, dtype=np.int64)
        _place(costs, resources, item, chosen, loads, held, count)
        key[chosen] = _max_row(loads, chosen)
        assignment[item] = chosen
        size = _push(hk, hc, hb, size, key[chosen], count[chosen], chosen)
    return assignment


@jit
def lpt_groups_loop(costs, order, starts, counts, bins, resources, caps):
    """``lpt_loop`` of each group (its items ``order[starts[g]:starts[g] + counts[g]]``, heaviest
    first, into its ``bins[g]`` bins, numbered from 0); the groups are small, so each item scans its
    group's bins. Returns the assignment, or (-1 - item) for the first item that fits no bin."""
    dims, kinds = costs.shape[1], caps.shape[0]
    most = 0
    for g in range(bins.shape[0]):
        most = max(most, bins[g])
    loads = np.zeros((most, dims))
    held = np.zeros((most, kinds))
    count = np.zeros(most, dtype=np.int64)
    out = np.empty(order.shape[0], dtype=np.int64)
    for g in range(bins.shape[0]):
        loads[:] = 0.0
        held[:] = 0.0
        count[:] = 0
        for j in range(counts[g]):
            item = order[starts[g] + j]
            chosen, least, fewest = -1, np.inf, 0
            for b in range(bins[g]):
                if _over(held[b], resources[item], caps):
                    continue
                key = _max_row(loads, b)
                if chosen < 0 or key < least or (key == least and count[b] < fewest):
                    chosen, least, fewest = b, key, count[b]
            if chosen < 0:
                return np.full(1, -1 - item, dtype=np.int64)
            _place(costs, resources, item, chosen, loads, held, count)
            out[item] = chosen
    return out


@jit
def modality_chunks_loop(lengths, order, bins, per_chunk):
    """Items in ``order``, each to the chunk least in (length so far, index); a chunk leaves once it
    holds ``per_chunk`` items."""
    hk = np.zeros(bins)
    hc = np.zeros(bins, dtype=np.int64)
    hb = np.arange(bins)  # all lengths 0, indices ascending: already a heap
    size = bins
    counts = np.zeros(bins, dtype=np.int64)
    chunk = np.empty(lengths.shape[0], dtype=np.int64)
    for i in order:
        total, c = hk[0], hb[0]
        chunk[i] = c
        counts[c] += 1
        size = _pop(hk, hc, hb, size)
        if counts[c] < per_chunk:
            size = _push(hk, hc, hb, size, total + lengths[i], 0, c)
    return chunk


@jit
def _tight(held, caps, largest, bins, extra):
    """Whether any of ``bins`` (and ``extra``, unless -1) is close enough to a cap for a move to
    break it: only then is each move's fit tested."""
    for r in range(caps.shape[0]):
        for k in range(bins.shape[0] + 1):
            b = bins[k] if k < bins.shape[0] else extra
            if b >= 0 and caps[r] - held[b, r] < largest[r]:
                return True
    return False


@jit
def _best_move(costs, resources, caps, largest, loads, held, head, nxt, size, crit, partners, limit):
    """(item, partner) of the move out of ``crit`` that leaves the pair's larger load least
    (first in (item, partner) order), or (-1, -1) when none is below ``limit``."""
    if size[crit] < 2:
        return -1, -1
    tight = _tight(held, caps, largest, partners, -1)
    best, out, to = np.inf, -1, -1
    item = head[crit]
    while item >= 0:
        crit_after = -np.inf
        for d in range(costs.shape[1]):
            crit_after = max(crit_after, loads[crit, d] - costs[item, d])
        for p in partners:
            worst = crit_after
            for d in range(costs.shape[1]):
                worst = max(worst, loads[p, d] + costs[item, d])
            if tight and _over(held[p], resources[item], caps):
                worst = np.inf
            if worst < best:
                best, out, to = worst, item, p
        item = nxt[item]
    return (out, to) if best < limit else (-1, -1)


@jit
def _best_swap(costs, resources, caps, largest, loads, held, head, nxt, crit, partners, limit):
    """(item, other item, partner) of the swap between ``crit`` and a partner that leaves the
    pair's larger load least (first in (item, partner, other item) order), or -1s."""
    tight = _tight(held, caps, largest, partners, crit)
    best, out, back, to = np.inf, -1, -1, -1
    item = head[crit]
    while item >= 0:
        for p in partners:
            other = head[p]
            while other >= 0:
                crit_after, partner_after = -np.inf, -np.inf
                for d in range(costs.shape[1]):
                    shift = costs[item, d] - costs[other, d]
                    crit_after = max(crit_after, loads[crit, d] - shift)
                    partner_after = max(partner_after, loads[p, d] + shift)
                worst = max(crit_after, partner_after)
                if tight:
                    for r in range(caps.shape[0]):
                        moved = resources[item, r] - resources[other, r]
                        if held[crit, r] - moved > caps[r] or held[p, r] + moved > caps[r]:
                            worst = np.inf
                if worst < best:
                    best, out, back, to = worst, item, other, p
                other = nxt[other]
        item = nxt[item]
    return (out, back, to) if best < limit else (-1, -1, -1)


@jit
def _append(head, tail, nxt, prv, size, item, b):
    """``item`` onto the end of bin b's list of members."""
    prv[item], nxt[item] = tail[b], -1
    if tail[b] >= 0:
        nxt[tail[b]] = item
    else:
        head[b] = item
    tail[b] = item
    size[b] += 1


@jit
def _move(costs, resources, assignment, loads, held, head, tail, nxt, prv, size, item, src, dst):
    assignment[item] = dst
    for d in range(costs.shape[1]):
        loads[src, d] -= costs[item, d]
        loads[dst, d] += costs[item, d]
    for r in range(resources.shape[1]):
        held[src, r] -= resources[item, r]
        held[dst, r] += resources[item, r]
    if prv[item] >= 0:  # out of src's list, its order kept
        nxt[prv[item]] = nxt[item]
    else:
        head[src] = nxt[item]
    if nxt[item] >= 0:
        prv[nxt[item]] = prv[item]
    else:
        tail[src] = prv[item]
    size[src] -= 1
    _append(head, tail, nxt, prv, size, item, dst)


@jit
def _lightest(values, k):
    """The first k of a stable argsort of ``values`` (least by value, then index)."""
    out = np.empty(min(k, values.shape[0]), dtype=np.int64)
    held = 0
    for b in range(values.shape[0]):
        if held == out.shape[0] and values[b] >= values[out[held - 1]]:
            continue
        at = min(held, out.shape[0] - 1)
        while at > 0 and values[out[at - 1]] > values[b]:
            out[at] = out[at - 1]
            at -= 1
        out[at] = b
        held = min(held + 1, out.shape[0])
    return out


@jit
def improve_loop(costs, resources, caps, assignment, bins, target, max_rounds, windows, limit_eps):
    """Rounds of the best move, else swap, out of the critical bin (the lowest-numbered one at the
    makespan that has one) into a partner among the lightest bins, window by window (``windows``:
    their ends, lightest first), until the makespan is down to ``target``, no step lowers it, or
    ``max_rounds``. ``assignment`` is changed in place."""
    n = costs.shape[0]
    loads = np.zeros((bins, costs.shape[1]))
    held = np.zeros((bins, caps.shape[0]))
    head = np.full(bins, -1, dtype=np.int64)
    tail = np.full(bins, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    prv = np.full(n, -1, dtype=np.int64)
    size = np.zeros(bins, dtype=np.int64)
    for item in range(n):  # members in item order, as a bin's list starts
        b = assignment[item]
        for d in range(costs.shape[1]):
            loads[b, d] += costs[item, d]
        for r in range(caps.shape[0]):
            held[b, r] += resources[item, r]
        _append(head, tail, nxt, prv, size, item, b)
    largest = np.zeros(caps.shape[0])
    for r in range(caps.shape[0]):
        for item in range(n):
            largest[r] = max(largest[r], resources[item, r])
    bin_max = np.empty(bins)
    for b in range(bins):
        bin_max[b] = _max_row(loads, b)
    for _ in range(max_rounds):
        makespan = bin_max.max()
        if makespan <= target:
            break
        limit = makespan * (1 - limit_eps)
        order = _lightest(bin_max, windows[-1] + 1)
        out, back, to, crit = -1, -1, -1, -1
        for c in range(bins):
            if bin_max[c] < limit:
                continue
            rest = order[order != c]
            start = 0
            for end in windows:
                partners = rest[start:min(end, rest.shape[0])]
                start = end
                if partners.shape[0] == 0:
                    continue
                out, to = _best_move(costs, resources, caps, largest, loads, held, head, nxt, size, c, partners, limit)
                if out < 0:
                    out, back, to = _best_swap(costs, resources, caps, largest, loads, held, head, nxt, c, partners,
                                               limit)
                if out >= 0:
                    break
            if out >= 0:
                crit = c
                break
        if out < 0:
            break
        _move(costs, resources, assignment, loads, held, head, tail, nxt, prv, size, out, crit, to)
        if back >= 0:
            _move(costs, resources, assignment, loads, held, head, tail, nxt, prv, size, back, to, crit)
        bin_max[crit] = _max_row(loads, crit)
        bin_max[to] = _max_row(loads, to)
    return assignment


@jit
def pack_ends(cum, budget, most):
    """Where each of Megatron's packs ends under ``budget`` (``cum``: the samples' running token
    totals from 0; a sample over the budget alone), at most ``most`` + 1 of them (``most`` < 0: all)."""
    n = cum.shape[0] - 1
    ends = np.empty(n, dtype=np.int64)
    count, start = 0, 0
    while start < n and (most < 0 or count <= most):
        start = max(_last_within(cum, start, cum[start] + budget), start + 1)
        ends[count] = start
        count += 1
    return ends[:count]


@jit
def _last_within(cum, start, limit):
    """The last index from ``start`` whose ``cum`` is at most ``limit`` (``cum`` ascending): galloping
    from ``start``, since a pack spans a few samples of the many a search over all would halve."""
    n = cum.shape[0]
    step = 1
    while start + step < n and cum[start + step] <= limit:
        step *= 2
    lo, hi = start + step // 2, min(start + step, n)  # cum[lo] <= limit; from hi on, over it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cum[mid] <= limit:
            lo = mid
        else:
            hi = mid
    return lo


@jit
def tightest_budget_loop(cum, lo, hi, packs):
    """The least budget in [lo, hi] under which the packing makes at most ``packs`` packs (their
    number never grows with the budget): a bisection, each budget packed once."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pack_ends(cum, mid, packs).shape[0] <= packs:
            hi = mid
        else:
            lo = mid + 1
    return lo


@jit
def token_chunks_loop(tokens, order, budget, bins):
    """Each sample of ``order`` to the leftmost chunk with ``budget`` room left for it, else to the
    leftmost lightest; two trees over the chunks (the most room, the least load) find both in
    log(bins) steps."""
    size = 1
    while size < bins:
        size *= 2
    room = np.full(2 * size, -np.inf)
    light = np.full(2 * size, np.inf)
    room[size:size + bins] = budget
    light[size:size + bins] = 0.0
    for node in range(size - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
        light[node] = min(light[2 * node], light[2 * node + 1])
    chunk = np.empty(tokens.shape[0], dtype=np.int64)
    for i in order:
        t = tokens[i]
        node = 1
        if room[1] >= t:
            while node < size:
                node = 2 * node if room[2 * node] >= t else 2 * node + 1
        else:
            while node < size:
                node = 2 * node if light[2 * node] <= light[2 * node + 1] else 2 * node + 1
        c = node - size
        chunk[i] = c
        room[node] -= t
        light[node] += t
        while node > 1:
            node //= 2
            room[node] = max(room[2 * node], room[2 * node + 1])
            light[node] = min(light[2 * node], light[2 * node + 1])
    return chunk
