"""How fast int64 (or float32) rows reach an L2-resident accumulator by bulk reduction from shared memory.

    PYTHONUNBUFFERED=1 python benchmarks/bench_reduce.py [--rows 8388608] [--configs 8x1/1,8x2/1,...]
    python benchmarks/bench_reduce.py --compile-only      # fill TILELANG_CACHE_DIR on a machine without a GPU

The deterministic backward (``sparse_mqa_kernels.backward``) sends every dkv contribution as int64 rows with
``cp.reduce.async.bulk .add.u64`` from a shared-memory staging ring. This is that path and nothing else: each
thread block stages ``R`` rows of cheap integers per round in one of ``NBUF`` buffers, ``R`` threads send one
row each to a random accumulator row, and a buffer is rewritten once its last reduction has read it. The default
row count is the anchor's S * L = 8,388,608 rows of 576 (38.7 GB) into Skv = 8192 rows, so the time is the
reduction floor of a kernel that sends the anchor's bytes this way. A config ``RxB/K`` is R rows x B buffers
with K thread blocks per SM (shared memory is padded so that no more fit); ``w256`` sends 256-column rows;
``f32`` sends float32 rows with ``.add.f32`` instead (what a float32-atomic backward such as cuDNN's moves: half
the bytes, in an order-dependent sum); ``i32`` sends int32 rows with ``.add.u32`` (4 bytes a term, exact: what an
int32 fixed point with a scale per KV row would send). Before timing, each config's sums are checked exactly
against torch's ``index_add_`` on a smaller row count (float32 and int32 rows carry small integers, so their sums
are exact too).

Configs ``red:PATTERN/K`` send the same terms without shared memory, as ``red.global.add`` from registers (what a
kernel does that reduces a [64 slots x 64 columns] wgmma accumulator straight to global memory, as cuDNN's SM90
backward does with float32); rows are grouped 64 to a tile, each tile's rows random as before:

- ``frag-u32`` / ``frag-u64`` / ``frag-f32``: one element a lane in the accumulator's own layout (4 lanes share a
  row, 2 adjacent columns each: 16 bytes of a row per instruction at 4 bytes, 32 at 8);
- ``tfrag-u32`` / ``tfrag-u64``: the layout of the transposed product (dkv^T, columns as wgmma's M, slots as N):
  8 lanes on 8 adjacent columns of each of 4 rows (a whole 32-byte sector of a row at 4 bytes, no transpose);
- ``line-u32``: 32 lanes on 32 adjacent columns of one row (128 bytes, as after a transpose);
- ``smem-u32``: that transpose included: each warp writes its 16 x 64 chunk in the fragment layout to its own
  padded shared-memory tile and sends it back line by line;
- ``v4-f32``: ``.v4.f32`` with 8 lanes on a row (4 rows x 128 bytes, cuDNN's shape).
"""

from __future__ import annotations

import argparse
import statistics
import sys

THREADS = 128
ACC_ROWS = 8192
SMEM_PER_SM = 228 * 1024  # an SM's shared memory; each block also takes 1 KB of it, and 227 KB at most
CONFIGS = ("8x1/1,8x2/1,8x4/1,16x2/1,8x2/2,8x2/3,8x1/6,8x1/1w256,8x2/3w256,8x2/1f32,16x2/1f32,8x2/3f32,"
           "8x2/1i32,16x2/1i32,8x2/3i32,16x4/1i32,red:frag-u32/1,red:frag-u64/1,red:frag-f32/1,red:line-u32/1,"
           "red:smem-u32/1,red:tfrag-u32/1,red:tfrag-u64/1,red:v4-f32/1,red:frag-u32/2,red:v4-f32/2")
RED_TILE = 64  # rows per tile in the red: configs (the slots of one top-k block)
RED_DTYPE = {"u32": "int32", "u64": "int64", "f32": "float32"}
RED_PATTERNS = ("frag-u32", "frag-u64", "frag-f32", "line-u32", "smem-u32", "tfrag-u32", "tfrag-u64", "v4-f32")
RED_TILE_COLS = 64  # smem-u32: columns per accumulator chunk (a [64 slots x 64 columns] wgmma tile)
ESIZE = {"int64": 8, "float32": 4, "int32": 4}  # bytes per element
SUFFIX = {"f32": "float32", "i32": "int32"}
SEND = {"int64": "sparse_mqa_bulk_add_u64", "float32": "sparse_mqa_bulk_add_f32", "int32": "sparse_mqa_bulk_add_u32"}


def parse(spec: str) -> tuple:
    """'8x2/3w256' -> (rows per round, buffers, blocks per SM, row width, element type); f32 / i32 at the end:
    float32 / int32 rows. 'red:frag-u32/2' -> ('red', 'frag', 2, 576, 'int32')."""
    width, dtype = 576, "int64"
    if spec.startswith("red:"):
        pattern, _, per_sm = spec[4:].partition("/")
        if pattern not in RED_PATTERNS:
            raise ValueError(f"unknown register pattern {pattern!r}: one of {', '.join(RED_PATTERNS)}")
        layout, t = pattern.split("-")
        return "red", layout, int(per_sm or 1), width, RED_DTYPE[t]
    if spec[-3:] in SUFFIX:
        spec, dtype = spec[:-3], SUFFIX[spec[-3:]]
    if spec.endswith("w256"):
        spec, width = spec[:-4], 256
    rb, per_sm = spec.split("/")
    rows, bufs = rb.split("x")
    return int(rows), int(bufs), int(per_sm), width, dtype


def build(rows, bufs, per_sm, width, dtype, n_sms):
    if rows == "red":
        return build_red(bufs, per_sm, width, dtype, n_sms)
    import tilelang
    import tilelang.language as T

    from sparse_mqa_kernels.backward import PRELUDE, TARGET
    from sparse_mqa_kernels.bench.ptx import PRELUDE_4B

    esize = ESIZE[dtype]
    wp = width + 16 // esize  # rows padded by 16 bytes, as the backward's staging rows are (bank spread)
    stage_bytes = bufs * rows * wp * esize
    # pad shared memory so that at most per_sm blocks fit on one SM
    pad = max(2, (min(SMEM_PER_SM // per_sm, 227 * 1024) - 1536 - stage_bytes) // esize)
    send = SEND[dtype]
    grid = n_sms * per_sm
    n_items = T.dynamic("n_items")

    @T.prim_func
    def bulk_reduce(Rows: T.Tensor([n_items], T.int32), Acc: T.Tensor([ACC_ROWS, width], dtype)):
        with T.Kernel(grid, threads=THREADS, prelude=PRELUDE + PRELUDE_4B) as bx:
            # the tail past the ring only holds shared memory (a separate buffer would be merged away)
            stage = T.alloc_shared([bufs * rows * wp + pad], dtype)
            tx = T.get_thread_binding()
            n_rounds = T.ceildiv(n_items, rows)
            for i in T.serial(T.ceildiv(T.max(n_rounds - bx, 0), grid)):
                g = bx + i * grid  # this round: items g * rows .. g * rows + rows - 1
                base = (i % bufs) * rows * wp
                if tx < rows:
                    T.call_extern("handle", f"sparse_mqa_bulk_wait_read_n<{bufs - 1}>")
                T.sync_threads()
                for r, d in T.Parallel(rows, width):
                    if dtype == "int64":
                        stage[base + r * wp + d] = T.cast(g * rows + r, T.int64) * 1024 + d
                    elif dtype == "int32":
                        stage[base + r * wp + d] = T.cast((g * rows + r) % 1024 * 1024 + d, T.int32)
                    else:
                        stage[base + r * wp + d] = T.cast((g * rows + r) % 64 + d % 7, T.float32)
                T.fence_proxy_async()
                T.sync_threads()
                if tx < rows:
                    if g * rows + tx < n_items:
                        T.call_extern("handle", send, T.address_of(stage[base + tx * wp]),
                                      T.address_of(Acc[Rows[g * rows + tx], 0]), width * esize)
                    T.call_extern("handle", "sparse_mqa_bulk_commit")
            if tx < rows:
                T.call_extern("handle", "sparse_mqa_bulk_wait_all")

    return tilelang.compile(bulk_reduce, out_idx=None, target=TARGET)


def build_red(layout: str, per_sm: int, width: int, dtype: str, n_sms: int):
    """A ``red:`` config's kernel: 128 threads, each warp 16 rows of a 64-row tile, terms sent from registers."""
    import tilelang
    import tilelang.language as T

    from sparse_mqa_kernels.backward import PRELUDE, TARGET
    from sparse_mqa_kernels.bench.ptx import PRELUDE_4B

    # smem-u32's per-warp tiles, rows padded by one word (spreads a warp's fragment stores over the banks)
    tile_words = 16 * (RED_TILE_COLS + 1)
    pad = max(4 * tile_words, (min(SMEM_PER_SM // per_sm, 227 * 1024) - 1536) // 4)  # holds occupancy at per_sm
    grid = n_sms * per_sm
    n_items = T.dynamic("n_items")
    tname = {"int32": "u32", "int64": "u64", "float32": "f32"}[dtype]

    def value(item, col):
        if dtype == "int64":
            return T.cast(item, T.int64) * 1024 + col
        if dtype == "int32":
            return T.cast(item % 1024 * 1024 + col, T.int32)
        return T.cast(item % 64 + col % 7, T.float32)

    @T.prim_func
    def red_reduce(Rows: T.Tensor([n_items], T.int32), Acc: T.Tensor([ACC_ROWS, width], dtype)):
        with T.Kernel(grid, threads=THREADS, prelude=PRELUDE + PRELUDE_4B) as bx:
            hold = T.alloc_shared([pad], T.int32)
            tx = T.get_thread_binding()
            assert width % 32 == 0, dtype  # (dtype named here: TileLang resolves the annotations from the closure)
            w, lane = tx // 32, tx % 32
            n_tiles = T.ceildiv(n_items, RED_TILE)
            if tx == 0:
                hold[pad - 1] = 0
            for i in T.serial(T.ceildiv(T.max(n_tiles - bx, 0), grid)):
                t0 = (bx + i * grid) * RED_TILE + 16 * w  # this warp's first item
                if layout == "frag":
                    for half in T.serial(2):
                        item = t0 + lane // 4 + 8 * half
                        if item < n_items:
                            row = Rows[item]
                            for cg in T.serial(width // 8):
                                for e in T.serial(2):
                                    col = 8 * cg + 2 * (lane % 4) + e
                                    T.call_extern("handle", f"smqa_red_{tname}", T.address_of(Acc[row, col]),
                                                  value(item, col))
                elif layout == "tfrag":
                    # the 4 warps share the tile's 64 slots and split each 64-column chunk 16 a warp
                    s0 = (bx + i * grid) * RED_TILE
                    for c in T.serial(width // 64):
                        for half in T.serial(2):
                            col = c * 64 + 16 * w + lane // 4 + 8 * half
                            for g8 in T.serial(8):
                                for e in T.serial(2):
                                    item = s0 + 8 * g8 + 2 * (lane % 4) + e
                                    if item < n_items:
                                        T.call_extern("handle", f"smqa_red_{tname}",
                                                      T.address_of(Acc[Rows[item], col]), value(item, col))
                elif layout == "smem":
                    base = w * tile_words
                    for c in T.serial(width // RED_TILE_COLS):
                        for half in T.serial(2):
                            for cg in T.serial(RED_TILE_COLS // 8):
                                for e in T.serial(2):
                                    r = lane // 4 + 8 * half
                                    col = 8 * cg + 2 * (lane % 4) + e
                                    hold[base + r * (RED_TILE_COLS + 1) + col] = value(t0 + r, c * RED_TILE_COLS + col)
                        T.call_extern("handle", "__syncwarp")
                        for r in T.serial(16):
                            if t0 + r < n_items:
                                row = Rows[t0 + r]
                                for k in T.serial(RED_TILE_COLS // 32):
                                    col = 32 * k + lane
                                    T.call_extern("handle", "smqa_red_u32",
                                                  T.address_of(Acc[row, c * RED_TILE_COLS + col]),
                                                  hold[base + r * (RED_TILE_COLS + 1) + col])
                        T.call_extern("handle", "__syncwarp")
                elif layout == "line":
                    for r in T.serial(16):
                        if t0 + r < n_items:
                            row = Rows[t0 + r]
                            for k in T.serial(width // 32):
                                col = 32 * k + lane
                                T.call_extern("handle", "smqa_red_u32", T.address_of(Acc[row, col]),
                                              value(t0 + r, col))
                else:
                    for step in T.serial(4):
                        item = t0 + 4 * step + lane // 8
                        if item < n_items:
                            row = Rows[item]
                            for k in T.serial(width // 32):
                                col = 32 * k + 4 * (lane % 8)
                                T.call_extern("handle", "smqa_red_v4_f32", T.address_of(Acc[row, col]),
                                              value(item, col), value(item, col + 1), value(item, col + 2),
                                              value(item, col + 3))

    return tilelang.compile(red_reduce, out_idx=None, target=TARGET)


def expected(rows_idx, width, dtype):
    """What the kernel adds, summed per accumulator row: item * 1024 + column (int64), (item % 1024) * 1024 +
    column (int32; the check's sums stay far below 2**31), or the small integers item % 64 + column % 7 (float32,
    exact in any order)."""
    import torch

    items = torch.arange(rows_idx.numel(), device=rows_idx.device, dtype=torch.int64)[:, None]
    cols = torch.arange(width, device=rows_idx.device, dtype=torch.int64)[None, :]
    vals = {"int64": items * 1024 + cols, "int32": items % 1024 * 1024 + cols, "float32": items % 64 + cols % 7}[dtype]
    out = torch.zeros(ACC_ROWS, width, dtype=torch.int64, device=rows_idx.device).index_add_(0, rows_idx.long(), vals)
    return out.to(getattr(torch, dtype))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096 * 2048, help="rows sent (default: the anchor's S * L)")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--sms", type=int, default=132, help="SMs to size the grid for (read from the GPU if present)")
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args(argv)
    specs = a.configs.split(",")
    if a.compile_only:
        for s in specs:
            build(*parse(s), a.sms)
            print(f"compiled {s}", flush=True)
        return 0

    import torch

    from sparse_mqa_kernels.bench import timing

    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if n_sms != a.sms:
        print(f"note: {n_sms} SMs here, kernels compiled for --sms {a.sms} are rebuilt", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_idx = torch.randint(0, ACC_ROWS, (a.rows,), generator=g, device="cuda", dtype=torch.int32)
    check_idx = rows_idx[:100_003]
    print(f"{'config':16s} {'ms':>8s} {'TB/s':>6s}  exact  ({a.rows} rows into {ACC_ROWS})", flush=True)
    for s in specs:
        rows, bufs, per_sm, width, dtype = parse(s)
        k = build(rows, bufs, per_sm, width, dtype, n_sms)
        acc = torch.zeros(ACC_ROWS, width, dtype=getattr(torch, dtype), device="cuda")
        k(check_idx, acc)
        exact = torch.equal(acc, expected(check_idx, width, dtype))
        times = timing.time_calls(lambda _: k(rows_idx, acc), 1, 2, a.iters, "cuda")
        ms = statistics.median(times)
        print(f"{s:16s} {ms:8.3f} {a.rows * width * ESIZE[dtype] / ms / 1e9:6.2f}  {exact}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
