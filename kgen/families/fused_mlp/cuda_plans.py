"""fused_mlp's CUDA cluster variants' plans and the rules they obey: the mma.sync kernel's
(templates/fused_mlp/cuda.cu.j2, `cuda_plan`), the WGMMA kernel's (cuda_wgmma.cu.j2,
`wgmma_plan`) and the TMA ring kernel's (cuda_ring.cu.j2, `ring_plan`): how each layer's
columns split over a cluster (or its weights stream through the ring), what sits where in
shared memory, and the spec errors for what a variant cannot be (schema._check_variant calls them)."""

from __future__ import annotations

from typing import Any, Mapping

from kgen.families.fused_mlp.schema import ITEMSIZE, MAX_LAYERS, _round, ring_weights

# ---------------------------------------------------------------- the mma.sync kernel

SMEM_MAX = 227 * 1024  # sm_90's dynamic shared memory per block
SMEM_SM = 228 * 1024  # and per SM
X_VECTORS_MAX = 16  # x's 16-byte vectors a thread loads per row tile (2 a chunk of unaligned rows)
X_PREFETCH_MAX = 8  # ... and at most carries through a row tile's layers (more: loaded at the tile's start)
NB_MAX = 8  # n8 tiles a warp accumulates at once (4 float32 registers each)


def cuda_plan(widths: tuple[int, ...], cluster: int, block_m: int, warps: int, itemsize: int = 2) -> dict:
    """The CUDA cluster variant's plan (templates/fused_mlp/cuda.cu.j2) for exact widths: a
    cluster of `cluster` CTAs owns `block_m` rows; every layer's output columns, in groups of
    8 (an mma n-tile), are split over the cluster's CTAs, each holding its slice of every
    layer's weights in shared memory for the whole kernel. Per layer: K and N, kp (K rounded
    up to 16, an mma k-step), sa (the activation rows' stride in elements, kp + 8: an odd
    number of 16-byte chunks, so ldmatrix's 8 rows hit 8 different bank groups), groups (the
    n8 groups the layer writes: kp of the next layer / 8, its padding written as zeros; the
    last layer: N rounded up to 8), per_cta (groups per CTA, a multiple of nb), nb (n-tiles
    a warp accumulates), units (warp work items: 16-row tiles x nb-group chunks), aligned
    (rows of K elements are whole 16-byte vectors: cp.async, else element loads), the byte
    offsets of its weight slice (w_off) and float32 bias slice (b_off). Then the two
    activation buffers' offsets (layer i reads buffer i % 2, writes buffer (i + 1) % 2), the
    total shared memory, the CTAs an SM holds (ctas_per_sm, the kernel's launch bound), x's
    8-element chunks a thread loads per row tile (x_vectors), the 16-byte registers they take
    (x_registers) and whether they are loaded one row tile ahead, carried through the layers
    of the tile before (x_prefetch: up to X_PREFETCH_MAX registers; more spilled to the stack)."""
    L, mt = len(widths) - 1, block_m // 16
    layers, off = [], 0
    for i in range(L):
        K, N = widths[i], widths[i + 1]
        kp = _round(K, 16)
        groups = _round(N, 16) // 8 if i < L - 1 else -(-N // 8)
        per = -(-groups // cluster)
        nb = min(NB_MAX, per, max(1, -(-per // max(1, warps // mt))))
        per = _round(per, nb)
        layers.append({"i": i, "K": K, "N": N, "kp": kp, "sa": kp + 8, "groups": groups, "per_cta": per, "nb": nb,
                       "units": mt * (per // nb), "last": i == L - 1, "aligned": (K * itemsize) % 16 == 0,
                       "w_off": off})
        off += per * 8 * (kp + 8) * itemsize
    for l in layers:  # the CTA's bias slice of each layer, float32 (zeros where absent)
        l["b_off"] = off
        off += l["per_cta"] * 8 * 4
    bufs = [max([block_m * l["sa"] * itemsize for l in layers if l["i"] % 2 == b], default=0) for b in (0, 1)]
    smem, threads = off + bufs[0] + bufs[1], warps * 32
    # CTAs an SM holds (other clusters' row tiles overlap this one's latencies): shared memory
    # (sm_90: 228 KB an SM, 1 KB of it reserved per CTA) and at least 96 registers a thread
    ctas = max(1, min(SMEM_SM // (smem + 1024), 65536 // (threads * 96)))
    # x's 8-element chunks a thread loads per row tile (every CTA reads the whole tile), and
    # the 16-byte registers they take: two a chunk where x's rows are not whole vectors
    x_vectors = -(-block_m * layers[0]["kp"] // 8 // threads)
    x_registers = x_vectors * (1 if layers[0]["aligned"] else 2)
    return {"layers": layers, "buf_off": [off, off + bufs[0]], "smem": smem, "weights_bytes": off,
            "ctas_per_sm": ctas, "x_vectors": x_vectors, "x_registers": x_registers,
            "x_prefetch": x_registers <= X_PREFETCH_MAX}


# ---------------------------------------------------------------- the WGMMA kernel (sm_90a)

WGMMA_N_MAX = 256  # a CTA's columns of a layer: one wgmma's N (m64nNk16: N = 8 ... 256, step 8)
ALIGN = 128  # shared-memory regions start on 128-byte boundaries (descriptors and bulk copies: 16)


def _first_fit(size: int, taken: list[tuple[int, int]]) -> int:
    """The lowest offset where `size` bytes overlap none of the `taken` [start, end) regions."""
    for start in sorted([0] + [e for _, e in taken]):
        start = _round(start, ALIGN)
        if all(start + size <= a or start >= e for a, e in taken):
            return start
    raise AssertionError("unreachable: past every region is free")


def wgmma_plan(widths: tuple[int, ...], cluster: int, block_m: int, itemsize: int = 2) -> dict:
    """The WGMMA cluster variant's plan (templates/fused_mlp/cuda_wgmma.cu.j2) for exact widths:
    a cluster of `cluster` CTAs owns one tile of `block_m` rows (one warpgroup per 64 rows);
    each layer's output columns, in groups of 8, are split over the CTAs, `per` groups a CTA
    (n = 8 per columns: one m64nNk16 chain per warpgroup), the first `active` CTAs holding
    them. Every operand in shared memory is K-major without swizzle, 8 x 16-byte core matrices
    stored column-chunk by column-chunk: element (r, k) of a tile of R rows at byte
    (k / 8) * 16 R + 16 r + 2 (k % 8), so a CTA's slice of an activation's columns is one
    contiguous run (one bulk copy a peer).

    Shared memory holds the biases (float32), each layer's weight slice (live until the layer
    is done) and the activations: x (layer 0's input) and layer i's output (layer i + 1's
    input), placed first-fit. A peer may write layer i's output into this CTA as soon as it
    has finished layer i itself, so the output's region must not overlap what layer i still
    reads here (its input and weights) or any later weights; where no such room is left under
    SMEM_MAX the layer is a `barrier` layer: every CTA arrives on the cluster barrier once its
    layer-i reads are done and waits on it before sending, so the output may reuse layer i's
    input and weights. (Without a barrier, a region read by an earlier layer is free: a peer
    finishing layer i has had this CTA's columns of every earlier layer, sent after its reads.)"""
    L = len(widths) - 1
    layers, per_prev = [], None
    for i in range(L):
        K, N = widths[i], widths[i + 1]
        kp = _round(K, 16)
        groups = _round(N, 16) // 8 if i < L - 1 else -(-N // 8)
        per = -(-groups // cluster)
        active = -(-groups // per)
        layers.append({"i": i, "K": K, "N": N, "kp": kp, "groups": groups, "per": per, "n": per * 8,
                       "active": active, "last": i == L - 1, "aligned": (K * itemsize) % 16 == 0,
                       "w_bytes": per * 8 * kp * itemsize})
    taken = []

    def put(size, avoid):
        off = _first_fit(size, avoid)
        return off, (off, off + size)

    bias_bytes = _round(sum(l["n"] for l in layers) * 4, ALIGN)
    regions = {"bias": (0, bias_bytes)}
    off = 0
    for l in layers:
        l["b_off"] = off
        off += l["n"] * 4
    # weights: the last layer's first (the longest-lived at the bottom), then x
    for l in reversed(layers):
        l["w_off"], regions[f"w{l['i']}"] = put(l["w_bytes"], list(regions.values()))
    x_bytes = block_m * layers[0]["kp"] * itemsize
    act_off, regions["a0"] = put(x_bytes, list(regions.values()))
    acts = [{"off": act_off, "bytes": x_bytes}]
    for l in layers[:-1]:
        nxt = layers[l["i"] + 1]
        size = block_m * max(nxt["kp"], l["per"] * l["active"] * 8) * itemsize
        later = [regions["bias"]] + [regions[f"w{j}"] for j in range(l["i"] + 1, L)]
        o, reg = put(size, later + [regions[f"w{l['i']}"], regions[f"a{l['i']}"]])
        l["barrier"] = o + size > SMEM_MAX - 1024
        if l["barrier"]:
            o, reg = put(size, later)
        regions[f"a{l['i'] + 1}"] = reg
        acts.append({"off": o, "bytes": size})
    layers[-1]["barrier"] = False
    for l, a in zip(layers, acts):
        l["a_off"] = a["off"]
    for l in layers[:-1]:
        l["out_off"] = acts[l["i"] + 1]["off"]
        # this CTA's columns of the output: one contiguous run at rank * slice_bytes
        l["slice_bytes"] = block_m * l["n"] * itemsize
    smem = max(e for _, e in regions.values())
    return {"layers": layers, "smem": smem, "wgmma_ns": sorted({l["n"] for l in layers}),
            # at least 256 threads a CTA for the prologue's loads (64 rows: a warpgroup idles in the layers)
            "warpgroups": block_m // 64, "threads": max(256, block_m * 2)}


# ---------------------------------------------------------------- the TMA ring kernel (sm_90a)

RING_ROWS = 128  # a ring slot's weight rows (output features): two m64 wgmma tiles
RING_K = 64  # ... and its K columns: one 128-byte swizzled row of 16-bit elements
RING_SLOT = RING_ROWS * RING_K * 2  # bytes
RING_WARPS = 8  # two consumer warpgroups (the producer warp comes on top)
RING_CLUSTERS = (1, 2, 4)


def ring_plan(widths: tuple[int, ...], cluster: int, block_m: int, stages: int, split: bool = False) -> dict:
    """The TMA ring variant's plan (templates/fused_mlp/cuda_ring.cu.j2) for exact widths, 16-bit
    dtypes: a CTA owns `block_m` rows of x (WGMMA's N: the batch is the B operand, "swap AB"),
    the weights are the A operand, streamed through `stages` slots of RING_ROWS features x
    RING_K columns (TMA, 128-byte swizzle, zeros past N and K), each slot multicast to the
    `cluster` CTAs of a cluster. Per ring layer: K, N, kc (its K panels of 64), mt (its tiles of
    128 features), c0 (its first chunk in the ring's order: layer by layer, mt * kc chunks a
    layer), b_off (its float32 bias, mt * 128 entries, zeros past N), and the activation
    buffers it reads (`src`: x's is buffer 0) and writes (`dst`, None for the last ring layer).
    A one-wide last layer after another (DLRM's top MLP) is no ring layer: a dot of the layer
    before's output in its epilogue (`dot`, its weights as float32 at dot_off, the warps'
    partial sums at red_off). Shared memory: the ring (1024-byte aligned slots), two
    activation buffers of 64-column panels (block_m rows x 128 bytes, swizzled; layer i reads
    buffer i % 2), the biases, the dot's operands, 2 * stages mbarriers.
    `split`: the cluster's CTAs share one row tile of `block_m` rows and take every cluster-th
    128-feature tile of each layer (no multicast: each streams its own tiles' weights), sending
    each written panel to the others by bulk copies; then one mbarrier a ring layer for the
    panels coming in, one for the dot's partials (CTA 0 sums `cluster` x block_m of them at
    dotp_off)."""
    L = len(widths) - 1
    ring = ring_weights(widths)
    dot = ring < L
    panel = block_m * 128
    layers, c0, b_off = [], 0, 0
    for i in range(ring):
        K, N = widths[i], widths[i + 1]
        kc, mt = -(-K // RING_K), -(-N // RING_ROWS)
        layers.append({"i": i, "K": K, "N": N, "kc": kc, "mt": mt, "c0": c0, "b_off": b_off, "src": i % 2,
                       "dst": None if i == ring - 1 else (i + 1) % 2, "last": i == L - 1,
                       "feeds_dot": dot and i == ring - 1})
        c0 += mt * kc
        b_off += mt * RING_ROWS * 4
    bufs = [max([l["kc"] * panel for l in layers if l["src"] == b], default=0) for b in (0, 1)]
    off = stages * RING_SLOT
    buf_off = [off, off + bufs[0]]
    off += bufs[0] + bufs[1]
    for l in layers:
        l["b_off"] += off
    off += b_off
    dot_off = red_off = 0
    if dot:
        dot_off = off
        off += layers[-1]["mt"] * RING_ROWS * 4
        red_off = off
        off += RING_WARPS * block_m * 4
    dotp_off = 0
    if dot and split:
        dotp_off = _round(off, 16)
        off = dotp_off + cluster * block_m * 4
    bar_off = _round(off, 8)
    off = bar_off + (2 * stages + (ring + 1 if split else 0)) * 8
    return {"layers": layers, "dot": dot, "chunks": c0, "panel": panel, "buf_off": buf_off, "dot_off": dot_off,
            "red_off": red_off, "dotp_off": dotp_off, "bar_off": bar_off, "smem": off + 1024,  # + the ring's 1024-byte alignment
            "slot": RING_SLOT, "threads": RING_WARPS * 32 + 32}


def check_ring(dtype: str, k: Mapping[str, Any]):
    widths = k["widths"]
    problems = check_common(dtype, widths, "WGMMA m64nNk16, TMA ring")
    if any(p[0] == "widths" for p in problems):
        return problems
    if k["block_m"] not in (16, 32, 64):
        problems.append(("block_m", "the ring variant's rows a CTA are one wgmma's N: 16, 32 or 64"))
    if k["warps"] != RING_WARPS:
        problems.append(("warps", f"the ring variant runs {RING_WARPS} consumer warps (two warpgroups; "
                                  "its producer warp comes on top)"))
    if k["cluster"] not in RING_CLUSTERS:
        problems.append(("cluster", f"the ring variant multicasts to clusters of {', '.join(map(str, RING_CLUSTERS))}"))
    if k["stages"] < 4:
        problems.append(("stages", "the ring needs at least 4 slots (each consumer warpgroup holds two)"))
    if k["split_n"]:
        if k["cluster"] < 2:
            problems.append(("split_n", "a split ring variant (split_n) splits the features over a cluster of 2 or 4"))
        elif any(-(-n // RING_ROWS) < k["cluster"] for n in widths[1:ring_weights(widths)]):
            # (a CTA's panel of layer i is overwritten by its layer i + 2, once every peer has sent
            # it layer i + 1, so after each peer's copy of the panel landed: every peer must own a tile)
            problems.append(("split_n", f"a split ring variant gives each of its {k['cluster']} CTAs at least one "
                                      f"{RING_ROWS}-feature tile of every layer but the last it streams: a layer "
                                      f"{min(widths[1:ring_weights(widths)])} wide has fewer; use a smaller cluster"))
    if problems:
        return problems
    plan = ring_plan(widths, k["cluster"], k["block_m"], k["stages"], bool(k["split_n"]))
    if plan["smem"] > SMEM_MAX:
        problems.append(("stages", f"{plan['smem']} bytes of shared memory ({k['stages']} ring slots of "
                                   f"{RING_SLOT}, the activation panels, biases) exceed {SMEM_MAX}; "
                                   "use fewer stages or a smaller block_m"))
    return problems


def check_common(dtype: str, widths, mma: str) -> list:
    """What both CUDA cluster variants require: a 16-bit dtype, 1 to MAX_LAYERS layers."""
    problems = []
    if dtype not in ("bfloat16", "float16"):
        problems.append(("dtypes", f"the CUDA variant runs bfloat16 and float16 ({mma})"))
    if not 2 <= len(widths) <= MAX_LAYERS + 1:
        problems.append(("widths", f"{len(widths)} widths make {len(widths) - 1} layers; "
                                   f"1 to {MAX_LAYERS} are supported"))
    return problems


def check_wgmma(dtype: str, k: Mapping[str, Any]):
    widths = k["widths"]
    problems = check_common(dtype, widths, "WGMMA m64nNk16")
    if any(p[0] == "widths" for p in problems):
        return problems
    if k["block_m"] not in (64, 128):
        problems.append(("block_m", "the WGMMA variant's row tile is one or two warpgroups of 64 rows: 64 or 128"))
        return problems
    if k["warps"] != k["block_m"] // 16:
        problems.append(("warps", f"the WGMMA variant runs one warpgroup (4 warps) per 64 rows: "
                                  f"warps {k['block_m'] // 16} for block_m {k['block_m']}"))
    plan = wgmma_plan(widths, k["cluster"], k["block_m"], ITEMSIZE[dtype])
    wide = [l for l in plan["layers"] if l["n"] > WGMMA_N_MAX]
    if wide:
        problems.append(("cluster", f"layer {wide[0]['i']} gives each CTA {wide[0]['n']} columns, more than one "
                                    f"wgmma's {WGMMA_N_MAX}; use a larger cluster"))
    if plan["smem"] > SMEM_MAX - 1024:
        problems.append(("cluster", f"{plan['smem']} bytes of shared memory (weight slices, biases, activation "
                                    f"tiles) exceed {SMEM_MAX - 1024}; use a larger cluster or a smaller block_m"))
    return problems


def check_mma_sync(dtype: str, k: Mapping[str, Any]):
    widths = k["widths"]
    problems = check_common(dtype, widths, "mma.sync m16n8k16")
    if any(p[0] == "widths" for p in problems):
        return problems
    if k["block_m"] // 16 > k["warps"]:
        problems.append(("block_m", f"{k['block_m']} rows are {k['block_m'] // 16} 16-row tiles, more than the "
                                    f"{k['warps']} warps"))
    plan = cuda_plan(widths, k["cluster"], k["block_m"], k["warps"], ITEMSIZE[dtype])
    smem = plan["smem"]
    if plan["x_registers"] > X_VECTORS_MAX:
        problems.append(("warps", f"each thread would hold {plan['x_registers']} 16-byte vectors of x (at most "
                                  f"{X_VECTORS_MAX}); use more warps or a smaller block_m"))
    if smem > SMEM_MAX:
        problems.append(("cluster", f"{smem} bytes of shared memory (weight slices and two activation tiles) "
                                    f"exceed {SMEM_MAX}; use a larger cluster or a smaller block_m"))
    return problems
